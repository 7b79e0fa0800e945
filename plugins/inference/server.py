"""The builtin inference server: an OpenAI-compatible HTTP API over an engine, one process.

The engine is :class:`Engine` over any model component that meets
:class:`~i3core.protocols.Model` (found by name through the plugin manager:
``--model tiny-moe``, the default), or the simulated one of
:mod:`~i3core.plugins.inference.simulated`; both serve the same API. Prompts
are encoded, chats rendered and stop tokens chosen by that model component.

Endpoints: ``POST /v1/completions`` (token-id or text prompts; returns token ids,
per-token logprobs and the policy version of every token), ``POST
/v1/chat/completions``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /i3/metrics`` (JSON counters,
``busy_slot_s`` and ``uptime_s`` for slot utilisation), ``GET /openapi.json``, and the admin routes
(they ask for the admin token): ``POST /update_weights`` (``{"path": dir, "version": n}``: a STABLE version
directory of the filesystem weight sync under the run's weight directories, read under its reader's lease; or
``{"version": n}`` alone on a server that receives weights by broadcast: it answers once that version is live),
``POST /pause``, ``POST /resume``.

Everything that touches the engine runs in one task between decode steps, so
requests join, weights swap, aborts and pauses take effect only between two steps.
A malformed request gets a 4xx with a message; a sequence that fails alone a 500; the server keeps serving.
An engine that breaks fails every waiting request (503) and the process (exit 1); SIGTERM/SIGINT end it
gracefully (exit 0): see :func:`serve`.

Run: ``python -m i3core.plugins.inference.server --model-dir DIR --port 8000`` (add
``--model NAME --model-options JSON`` for another model component, ``--engine
simulated --timing JSON`` for the simulated engine).
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pydantic
import structlog
import torch
from aiohttp import web

from i3core.config import build_component
from i3core.errors import EngineFailed, I3Error, SequenceFailed
from i3core.lifetime import ADMIN_TOKEN_ENV, API_KEY_ENV, terminate_with_run
from i3core.manager import load_plugins
from i3core.plugins.inference.engine import Engine, EngineBase, Request, Sequence
from i3core.plugins.inference.observability import (CLIENT_GONE, CONTENT_TYPE, ServerMetrics, UnscrapedMetrics,
                                                    configure_logging, request_log)
from i3core.plugins.inference.openai_api import OpenAIRoutes
from i3core.plugins.inference.utility_routes import UtilityRoutes
from i3core.plugins.inference.protocol import (
    MAX_BODY_BYTES,
    STREAM_END,
    BadRequest,
    bearer_matches,
    is_admin_route,
    unauthorized,
    weights_path,
    ShuttingDown,
    error_response,
    first_line,
    UpdateWeightsRequest,
    VersionWaits,
    error_body,
    parse,
    parse_json_object,
    report_receiver_stopped,
)
from i3core.protocols import Model
from i3core.weights import check_max_len, connect_receiver, reading

log = structlog.get_logger("i3core.server")

class Server:
    """The HTTP API over any :class:`EngineBase`; ``model`` (a :class:`~i3core.protocols.Model` component)
    encodes and decodes text, renders chats and says where completions stop. :func:`builtin_server` puts a
    model's own engine behind it."""

    def __init__(self, engine: EngineBase, model: Model, model_name: str, scraped: bool = True):
        self.engine = engine
        self.model = model
        self.tokenizer = engine.tokenizer if engine.tokenizer is not None else model.tokenizer()
        self.max_text_chars = _max_text_chars(self.tokenizer, engine.max_len)
        """The longest text :meth:`encode` tokenizes (None: no bound known)."""
        self.model_name = model_name
        self._adds: list[tuple[Sequence, asyncio.Future]] = []
        self._aborts: list[Sequence] = []
        self._futures: dict[int, asyncio.Future] = {}
        self._followers: dict[int, tuple[Sequence, asyncio.Queue]] = {}
        """Sequences whose every step is watched (:meth:`follow`): True is put once one finished."""
        self._update: tuple[dict, int, asyncio.Future] | None = None
        self._wake = asyncio.Event()
        self._paused = False
        self.weight_roots: list[Path] = []
        """Directories ``/update_weights`` may read from (the run's weight versions); empty: any path."""
        self.receiving = False
        """Whether weights arrive by broadcast (:meth:`offer`) and ``/update_weights`` may omit the path."""
        self.failure: str | None = None
        """Why the engine broke (then ``/health`` answers 503 with it and the server process exits)."""
        self.draining = False
        """Shutting down: requests in flight finish, new ones are refused (503)."""
        self.refusal: I3Error | None = None
        """What every new request gets (the engine broke, the server is shutting down); None: serving."""
        self._waits = VersionWaits()
        self._waits.live = engine.version
        self.updates = 0
        self.update_pause_s = 0.0
        """Time the engine stood still swapping weights, over all updates."""
        self.tokens_generated = 0
        self.requests_served = 0
        self.busy_slot_s = 0.0
        """Slot-seconds spent generating: each step's wall time times the sequences it decoded."""
        self.started = time.time()
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="i3core-engine")
        """The one thread every engine step runs on: torch's intra-op thread pool stays that thread's."""
        self.metrics = (ServerMetrics if scraped else UnscrapedMetrics)(model_name, self._state)
        """Prometheus' books (:mod:`~i3core.plugins.inference.observability`); not kept per token where
        ``scraped`` is False (an engine without ``/metrics``)."""

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, param: str = "messages") -> str:
        """The model's chat template on ``messages``. A template that refuses them (HF templates'
        ``raise_exception``: roles that do not alternate, a system turn out of place) or cannot render them
        (a field a message lacks) answers the client, as vLLM does; a template that does not parse is the
        server's error.

        :raises BadRequest: naming ``param``.
        """
        try:
            return self.model.render_chat(messages, tools)
        except Exception as exc:
            if not _template_refusal(exc):
                raise
            raise BadRequest(f"the chat template refused the {param}: {first_line(exc)}", param=param) from None

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """``text``'s token ids (:meth:`encode_many`)."""
        return (await self.encode_many([text], add_special_tokens=add_special_tokens, param=param))[0]

    async def encode_many(self, texts: list[str], *, add_special_tokens: bool = True,
                          param: str = "prompt") -> list[list[int]]:
        """Each of ``texts`` as token ids. A text longer than any context of this engine can hold, whatever its
        tokens (:attr:`max_text_chars`), is refused before the tokenizer runs; long texts are encoded on a thread
        by the tokenizer's batch call, which lets go of the interpreter (its single-text call holds it, and with
        it every other request and the engine: 19 s for 15 MB).

        :raises BadRequest: ``context_length_exceeded``, naming ``param``.
        """
        for text in texts:
            if self.max_text_chars is not None and len(text) > self.max_text_chars:
                raise BadRequest(f"This model's maximum context length is {self.engine.max_len} tokens. However, "
                                 f"the {param} has {len(text)} characters, more than that many tokens of this "
                                 "tokenizer could hold. Please reduce the length of the prompt.", param=param,
                                 code="context_length_exceeded")
        batch = getattr(self.tokenizer, "encode_batch", None)
        if sum(map(len, texts)) <= INLINE_ENCODE_CHARS or not callable(batch):
            return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids for text in texts]
        encodings = await asyncio.to_thread(batch, texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    # -- the engine task ---------------------------------------------------

    async def run_engine(self) -> None:
        """Drive the engine until cancelled: between two steps take joins, aborts and weight swaps, then step.

        A step that raises breaks the engine: every caller waiting on it gets :class:`EngineFailed` at once, so
        does every later one (:attr:`failure` says why), and the error ends this task.
        """
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._between_steps()
                if self._paused or not self.engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = time.perf_counter()
                finished = await loop.run_in_executor(self._stepper, self.engine.step)
                self.busy_slot_s += (time.perf_counter() - start) * (len(self.engine.running) + len(finished))
                self.metrics.after_step(self.engine.running.values(), finished)
                for seq in finished:
                    self.tokens_generated += len(seq.token_ids)
                    future = self._futures.pop(seq.id, None)
                    if future is not None and not future.done():
                        future.set_result(seq)
                for seq, updates in self._followers.values():  # streams and stop strings: every step
                    if seq.token_ids or seq.finish_reason is not None:
                        # what the step left, read here while the engine thread is idle: the follower never
                        # sees a token count from one step with the finish reason of the next
                        updates.put_nowait((len(seq.token_ids), seq.finish_reason))
        except Exception as exc:
            self.failure = f"the engine failed: {type(exc).__name__}: {first_line(exc)}"
            self.refuse(EngineFailed(self.failure))
            raise EngineFailed(self.failure) from exc

    def refuse(self, error: I3Error) -> None:
        """Answer every caller waiting on the engine with ``error`` at once, and every later one (the engine
        broke, or the server is shutting down)."""
        self.refusal = error
        pending = [future for _, future in self._adds] + list(self._futures.values())
        if self._update is not None:
            pending.append(self._update[2])
            self._update = None
        self._adds.clear()
        self._futures.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)
                future.add_done_callback(lambda f: f.exception())  # retrieved even if nobody waits any more
        for _, updates in self._followers.values():
            updates.put_nowait(error)
        self._wake.set()

    def _between_steps(self) -> None:
        if self._update is not None:
            state, version, done = self._update
            self._update = None
            start = time.perf_counter()
            self.engine.load_state(state, version)
            self.update_pause_s += time.perf_counter() - start
            self.updates += 1
            self.metrics.weight_updates.inc()
            if not done.done():
                done.set_result(version)
        for seq, future in self._adds:
            self._futures[seq.id] = future
            self.engine.waiting.append(seq)
            self.metrics.arrived(seq)
        self._adds.clear()
        for seq in self._aborts:
            self.engine.abort(seq)
            self.metrics.left(seq)
        self._aborts.clear()

    def new_sequence(self, request: Request) -> Sequence:
        """``request`` checked by the engine and wrapped, not yet queued.

        :raises BadRequest: an empty or too long prompt, sampling settings out of range.
        """
        try:
            return self.engine.new_sequence(request)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _admit(self) -> None:
        if self.refusal is not None:
            raise self.refusal
        if self.draining:
            raise ShuttingDown("the server is shutting down")

    def busy(self) -> bool:
        """Whether any request is queued or generating."""
        return bool(self._adds or self._futures or self._followers or self.engine.has_work())

    async def generate(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` and wait until it finishes; cancelling the wait aborts it between two steps.

        :raises EngineFailed: the engine broke (before or while ``seq`` waited).
        :raises ShuttingDown: the server is shutting down.
        """
        self._admit()
        future = asyncio.get_running_loop().create_future()
        self._adds.append((seq, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: free its slot between two steps
            self._futures.pop(seq.id, None)
            self.abort(seq)
            raise

    async def follow(self, seq: Sequence) -> AsyncIterator[tuple[int, str | None]]:
        """Queue ``seq`` and yield ``(tokens, finish_reason)`` after every step that gave it tokens, last once it
        finished: how many tokens ``seq`` had and why it had finished (None: it goes on) when that step ended.
        Read ``seq``'s lists only up to ``tokens`` (the engine thread may already be appending the next step's).
        Leaving the loop early (a stop string, a client gone) aborts it between two steps.

        :raises EngineFailed: the engine broke. :raises ShuttingDown: the server is shutting down.
        """
        self._admit()
        updates: asyncio.Queue = asyncio.Queue()
        self._followers[seq.id] = (seq, updates)
        done = asyncio.get_running_loop().create_future()
        self._adds.append((seq, done))
        self._wake.set()
        try:
            while True:
                update = await updates.get()
                if isinstance(update, Exception):
                    raise update
                yield update
                if update[1] is not None:
                    return
        finally:
            self._followers.pop(seq.id, None)
            if not done.done():
                self._futures.pop(seq.id, None)
                self.abort(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` between two steps (its slot is freed)."""
        self._aborts.append(seq)
        self._wake.set()

    # -- HTTP handlers (the OpenAI routes are in openai_api) -----------------

    async def health(self, http: web.Request) -> web.Response:
        """200 ``{"status": "ok", "version", "paused"}`` while serving; 503 with the reason once the engine broke
        (``{"status": "error", "error"}``) or the server is shutting down."""
        if self.refusal is not None:
            status = "error" if self.failure is not None else "shutting down"
            return web.json_response({"status": status, "error": str(self.refusal), "version": self.engine.version},
                                     status=503)
        body = {"status": "ok", "version": self.engine.version, "paused": self._paused}
        if self._waits.failure is not None:
            body["weights_error"] = self._waits.failure
        return web.json_response(body)

    def _state(self) -> dict:
        engine = self.engine
        return {"running": len(engine.running), "waiting": len(engine.waiting) + len(self._adds),
                "max_slots": engine.max_slots, "version": engine.version, "paused": self._paused}

    async def prometheus(self, http: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus' text format (:mod:`~i3core.plugins.inference.observability`)."""
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def counters(self, http: web.Request) -> web.Response:
        """``GET /i3/metrics``: the same counters as JSON, for i3core's own tools (and the vllm source's twin)."""
        return web.json_response(
            {
                **self._state(),
                "steps": self.engine.steps,
                "tokens_generated": self.tokens_generated,
                "requests_served": self.requests_served,
                "busy_slot_s": self.busy_slot_s,
                "updates": self.updates,
                "update_pause_s": self.update_pause_s,
                "uptime_s": time.time() - self.started,
            }
        )

    async def update_weights(self, http: web.Request) -> web.Response:
        request = parse(UpdateWeightsRequest, await _json_body(http))
        path, version = request.path, request.version
        if path is None:
            if not self.receiving:
                raise BadRequest("this server receives weights from a path only: give path")
            await self._waits.wait(version)
            return web.json_response({"status": "ok", "version": self.engine.version})
        if self.weight_roots:
            path = weights_path(path, self.weight_roots)
        try:
            await self.load_weights(Path(path), version)
        except (ValueError, OSError) as exc:  # not a weight version (a file, a missing or unreadable one...)
            raise BadRequest(str(exc)) from None
        return web.json_response({"status": "ok", "version": version})

    async def load_weights(self, path: Path, version: int) -> None:
        """Read the weight version directory ``path`` off the event loop and swap it in as ``version`` between
        two steps; returns once it is live.

        :raises ValueError: missing or mismatched weights (every name and shape is checked before the live
            engine is touched).
        """
        state = await asyncio.to_thread(self._stage_version, path)
        await self._swap(state, version)

    def _stage_version(self, path: Path):
        with reading(path):  # the trainer's pruning waits until we are done
            return self.engine.stage(path)

    async def _swap(self, state, version: int) -> None:
        self._admit()
        done = asyncio.get_running_loop().create_future()
        if self._update is not None:  # a newer version supersedes one not yet swapped in
            self._update[2].set_result(version)
        self._update = (state, version, done)
        self._wake.set()
        await done

    async def offer(self, state, version: int, error: str | None = None) -> None:
        """A version that arrived by broadcast: swap it in (or record why it could not be)."""
        if error is not None:
            self._waits.rejected(version, error)
            return
        await self._swap(state, version)
        self._waits.arrived(version)

    def set_paused(self, paused: bool) -> None:
        """Hold decoding between two steps (requests still queue), or let it go on."""
        self._paused = paused
        self._wake.set()

    async def pause(self, http: web.Request) -> web.Response:
        self.set_paused(True)
        return web.json_response({"status": "paused", "version": self.engine.version})

    async def resume(self, http: web.Request) -> web.Response:
        self.set_paused(False)
        return web.json_response({"status": "running", "version": self.engine.version})


SERVED_BY_ENGINE = ("load_hf", "render_chat", "end_of_turn_ids")
"""What the builtin engine needs of a model component beyond training (its module's cached decode aside)."""


INLINE_ENCODE_CHARS = 16_384
"""Characters of a request's texts encoded on the event loop (well under a millisecond); more go to a thread."""


def _max_text_chars(tokenizer, max_len: int) -> int | None:
    """Characters beyond which a text has more than ``max_len`` tokens of ``tokenizer``: ``max_len`` of its longest
    token, twice over (a token's string holds at least as many characters as the text it stands for: a byte-level
    vocabulary writes one character per byte; the margin is for a normalizer that composes characters). None
    where the tokenizer lists no vocabulary."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(vocab):
        return None
    try:
        tokens = vocab(with_added_tokens=True)  # tokenizers.Tokenizer's: the special tokens too
    except TypeError:  # a tokenizer of another kind
        tokens = vocab()
    longest = max(map(len, tokens), default=0)
    return 2 * max_len * longest if longest else None


def model_component(name: str, options: dict, plugins=None) -> Model:
    """The model component ``name`` with ``options``, found through the plugin manager (any installed plugin)."""
    return build_component("model", {"use": name, **options}, plugins if plugins is not None else load_plugins())


def builtin_server(model_dir: Path, model: Model, *, max_slots: int, max_len: int, version: int,
                   served_name: str | None = None, scraped: bool = True, max_len_setting: str = "--max-len") -> Server:
    """The engine of ``model`` (a :class:`~i3core.protocols.Model` component) on the weights of the HF
    directory ``model_dir`` (``scraped``: whether its Prometheus books are kept, see :class:`Server`;
    ``max_len_setting``: what the user gave ``max_len`` as, for :func:`~i3core.weights.check_max_len`).

    :raises I3Error: the model cannot be served by the builtin engine (it has no cached decode).
    """
    missing = [name for name in SERVED_BY_ENGINE if not hasattr(model, name)]
    if missing:
        raise I3Error(f"model {type(model).__name__} cannot be served by the builtin server (no "
                      f"{', '.join(missing)}); serve it with [inference] use = \"vllm\"")
    check_max_len(model_dir, max_len, max_len_setting)
    engine = Engine(model.load_hf(model_dir), max_slots=max_slots, max_len=max_len, version=version,
                    tokenizer=model.tokenizer())
    return Server(engine, model, served_name or str(model_dir), scraped=scraped)


def _template_refusal(exc: Exception) -> bool:
    """Whether a chat template's error is about what it was given (jinja's errors at render time)."""
    try:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
    except ImportError:  # no jinja: a template in Python (tiny-moe's), whose errors are the server's
        return False
    return isinstance(exc, TemplateError) and not isinstance(exc, TemplateSyntaxError)


async def _json_body(http: web.Request) -> dict:
    return parse_json_object(await http.read())


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error as OpenAI's JSON with a message: ours (:func:`error_response`) and aiohttp's (404, 405, 413...).
    A bug in a handler is a 500 with its message (and a log line); the server keeps serving."""
    try:
        return await handler(request)
    except (BadRequest, SequenceFailed, EngineFailed, ShuttingDown) as exc:
        if STREAM_END in request:  # the stream's 200 is sent: no response can follow it, its last event says why
            return await request[STREAM_END](exc)
        status, body = error_response(exc)
        return web.json_response(body, status=status)
    except web.HTTPException as exc:
        if not 400 <= exc.status < 500:
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 405:
            message += f" (allowed: {', '.join(sorted(exc.allowed_methods))})"
        elif exc.status == 413:
            message = f"{exc.reason}: the body may hold at most {MAX_BODY_BYTES} bytes"
        return web.json_response(error_body(message), status=exc.status)
    except ConnectionResetError:  # a write to a client that left (before its stream's 200): nobody to answer
        return web.Response(status=CLIENT_GONE)
    except Exception as exc:  # a bug: this request fails, the server goes on
        log.exception("request failed", method=request.method, route=request.path)
        if STREAM_END in request:
            return await request[STREAM_END](exc)
        status, body = error_response(exc)
        return web.json_response(body, status=status)


ENGINE_TASK = web.AppKey("engine_task", asyncio.Task)


def _guard(admin_token: str | None, api_key: str | None):
    """The middleware that asks the admin routes for ``admin_token`` and ``/v1/*`` for ``api_key`` (401)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if admin_token and is_admin_route(request.path):
            if not bearer_matches(request.headers.get("Authorization"), admin_token):
                raise unauthorized(f"{request.path} needs the admin token")
        elif api_key and request.path.startswith("/v1/"):
            if not bearer_matches(request.headers.get("Authorization"), api_key, admin_token):
                raise unauthorized(f"{request.path} needs the API key")
        return await handler(request)

    return guard


def make_app(server: Server, receiver=None, *, admin: bool = True, admin_token: str | None = None,
             api_key: str | None = None) -> web.Application:
    """The HTTP app; with a broadcast ``receiver`` a thread takes the versions it delivers.

    :param admin: serve the admin routes (:data:`ADMIN_ROUTES`: weights, pause, sessions); off: 404.
    :param admin_token: what the admin routes ask for (``Authorization: Bearer``); None: they are open.
    :param api_key: what ``/v1/*`` asks for, as vLLM's ``--api-key`` (the admin token is accepted too).
    """
    app = web.Application(middlewares=[request_log(server.metrics), _errors, _guard(admin_token, api_key)],
                          client_max_size=MAX_BODY_BYTES)
    routes = [
        *OpenAIRoutes(server).routes(),
        *UtilityRoutes(server).routes(),
        web.get("/health", server.health),
        web.get("/metrics", server.prometheus),
        web.get("/i3/metrics", server.counters),
    ]
    if admin:
        routes += [web.post("/update_weights", server.update_weights), web.post("/pause", server.pause),
                   web.post("/resume", server.resume)]
    app.add_routes([r for r in routes if admin or not is_admin_route(r.path)])

    async def engine_task(app):
        task = asyncio.create_task(server.run_engine())
        app[ENGINE_TASK] = task
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(engine_task)
    if receiver is not None:
        server.receiving = True

        async def receive_task(app):
            thread = threading.Thread(target=_receive_forever, args=(server, receiver, asyncio.get_running_loop()),
                                      name="weights-receiver", daemon=True)
            thread.start()
            yield

        app.cleanup_ctx.append(receive_task)
    return app


def _receive_forever(server: Server, receiver, loop: asyncio.AbstractEventLoop) -> None:
    """The receiver thread: take each broadcast version, check it off the engine task, hand it over.

    A version that does not fit is refused and the next one awaited; anything else breaks the group
    for good: every later wait for a version then fails with that reason, and ``/health`` says so.
    """
    try:
        while True:
            version, tensors = receiver.receive()
            try:
                state, error = server.engine.stage_tensors(tensors), None
            except ValueError as exc:
                state, error = None, str(exc)
            del tensors
            asyncio.run_coroutine_threadsafe(server.offer(state, version, error), loop).result()
    except Exception as exc:  # a broken group cannot be rejoined
        report_receiver_stopped(server._waits, loop, exc)


SHUTDOWN_GRACE_S = 5.0
"""How long SIGTERM/SIGINT lets requests in flight finish before they are answered 503."""
DRAIN_S = 1.0
"""After the engine broke or the grace ran out: time for the handlers to write their 5xx before the exit."""


async def serve(app: web.Application, server: Server, host: str, port: int,
                grace_s: float = SHUTDOWN_GRACE_S) -> int:
    """Serve ``app`` until SIGTERM/SIGINT (exit status 0) or until the engine breaks (1).

    Once it listens it says so on stdout, with the port it bound (``port`` 0: a free one the system chose).

    On a signal: stop accepting connections, refuse new requests (503), let requests in flight finish for
    ``grace_s``, answer what is left 503, close. When the engine breaks every waiting request has already had
    its 503 (:meth:`Server.run_engine`); the process says why in one line on stderr and exits 1, so a
    supervisor restarts it.
    """
    loop = asyncio.get_running_loop()
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=DRAIN_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"i3core server: {server.model_name} on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = app[ENGINE_TASK]
    waiting = asyncio.create_task(stop.wait())
    await asyncio.wait([waiting, engine], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    await site.stop()  # no new connections
    if server.failure is not None:
        print(f"error: {server.failure}", file=sys.stderr, flush=True)
        code = 1
    else:
        code = 0
        server.draining = True  # new requests on open connections: 503
        deadline = loop.time() + grace_s
        while server.busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        server.refuse(ShuttingDown(f"the server is shutting down (in-flight requests had {grace_s:g}s)"))
    await runner.cleanup()  # handlers still writing get DRAIN_S, the engine task is cancelled
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    return code


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="i3core builtin inference server")
    parser.add_argument("--model-dir", type=Path, required=True, help="HF directory written by save_hf")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-slots", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--max-len", type=int, default=512, help="longest prompt + completion in tokens")
    parser.add_argument("--version", type=int, default=0, help="policy version of the initial weights")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--model", default="tiny-moe", help="the model component that serves the directory")
    parser.add_argument("--model-options", default="{}", help="that component's Config fields as JSON")
    parser.add_argument("--served-model-name", default=None, help="the name responses echo (default: the directory)")
    parser.add_argument("--engine", choices=("model", "simulated"), default="model",
                        help="what generates: the model's own engine, or the simulated one")
    parser.add_argument("--timing", default="{}", help="simulated engine: TimingModel fields as JSON")
    parser.add_argument("--index", type=int, default=0, help="simulated engine: offsets its sampling seed")
    parser.add_argument("--receiver", default=None, help="weight-sync receiver spec (JSON) to take broadcasts from")
    parser.add_argument("--receiver-rank", type=int, default=1, help="this server's rank in the broadcast group")
    parser.add_argument("--admin-token", default=None,
                        help=f"what the admin routes (weights, pause, sessions) ask for (default: ${ADMIN_TOKEN_ENV}; "
                             "neither: they are open to whoever reaches the port)")
    parser.add_argument("--no-admin", action="store_true", help="serve no admin route at all (404)")
    parser.add_argument("--api-key", default=None, help=f"what /v1/* asks for as a Bearer token (default: ${API_KEY_ENV})")
    parser.add_argument("--weights-root", type=Path, action="append", default=[],
                        help="a directory /update_weights may read from (repeatable; default: the parent of "
                             "--model-dir, where a run's weight versions lie)")
    parser.add_argument("--log-format", choices=("json", "console"), default="json",
                        help="one line per request and event on stdout: JSON, or plain text for a person")
    parser.add_argument("--shutdown-grace-s", type=float, default=SHUTDOWN_GRACE_S,
                        help="on SIGTERM/SIGINT, seconds requests in flight may take before they are answered 503")
    args = parser.parse_args(argv)
    terminate_with_run()  # started by `i3core run`: stop (SIGTERM, a graceful exit) if that run is killed
    configure_logging(args.log_format)
    torch.set_num_threads(args.threads)
    try:
        server, receiver = _build(args)
    except KeyboardInterrupt:  # Ctrl-C while the weights load (`i3core serve` in a terminal)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except I3Error as exc:  # one line in the server's log; the source reports the exit
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:  # a config.json or weights file
        # that cannot be read, or whose JSON is not what the model component expects (a list, a missing key)
        print(f"error: cannot serve {args.model_dir}: {_load_failure(exc)}", file=sys.stderr)
        sys.exit(1)
    server.weight_roots = args.weights_root or [args.model_dir.resolve().parent]
    admin_token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if not args.no_admin and admin_token is None:
        log.warning("the admin routes are open to whoever reaches this port", hint=f"set ${ADMIN_TOKEN_ENV}")
    app = make_app(server, receiver, admin=not args.no_admin, admin_token=admin_token,
                   api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    try:
        sys.exit(asyncio.run(serve(app, server, args.host, args.port, args.shutdown_grace_s)))
    except KeyboardInterrupt:  # before serve() took SIGINT over
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (OSError, OverflowError) as exc:  # the address cannot be bound (in use, not this host's, no such port)
        print(f"error: cannot listen on {args.host}:{args.port}: {first_line(exc)}", file=sys.stderr)
        sys.exit(1)


def _load_failure(exc: Exception) -> str:
    """Why a model directory could not be loaded, in one line: a pydantic error's first problem with its field
    (``hidden_size: Input should be greater than 0``), else the exception's type and first line."""
    if isinstance(exc, pydantic.ValidationError):
        error, more = exc.errors()[0], exc.error_count() - 1
        field = ".".join(str(part) for part in error["loc"]) or "config"
        return f"{field}: {error['msg']}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")
    return f"{type(exc).__name__}: {first_line(exc)}"


def _build(args: argparse.Namespace) -> tuple[Server, object]:
    """The server and its weight receiver (None without ``--receiver``) that the command line asks for."""
    plugins = load_plugins()
    model = model_component(args.model, json.loads(args.model_options), plugins)
    if args.engine == "simulated":
        from i3core.plugins.inference.simulated import TimingModel, simulated_engine

        engine = simulated_engine(args.model_dir, model, TimingModel.model_validate_json(args.timing),
                                  max_slots=args.max_slots, max_len=args.max_len, version=args.version,
                                  index=args.index)
        server = Server(engine, model, args.served_model_name or f"simulated:{args.model_dir}")
    else:
        server = builtin_server(args.model_dir, model, max_slots=args.max_slots, max_len=args.max_len,
                                version=args.version, served_name=args.served_model_name)
    receiver = None
    if args.receiver is not None:
        receiver = connect_receiver(json.loads(args.receiver), args.receiver_rank, plugins)
    return server, receiver


if __name__ == "__main__":
    main()
