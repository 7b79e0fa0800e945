"""The builtin inference server: an OpenAI-compatible HTTP API over an engine, one process.

The engine is :class:`Engine` over any model component that meets
:class:`~i3core.protocols.Model` (found by name through the plugin manager:
``--model tiny-moe``, the default), or the simulated one of
:mod:`~i3core.plugins.inference.simulated`; both serve the same API. Prompts
are encoded, chats rendered and stop tokens chosen by that model component.

Endpoints: ``POST /v1/completions`` (token-id or text prompts; returns token ids,
per-token logprobs and the policy version of every token), ``POST
/v1/chat/completions``, ``GET /health``, ``GET /metrics`` (counters, ``busy_slot_s`` and ``uptime_s``
for slot utilisation), ``POST
/update_weights`` (``{"path": dir, "version": n}``: a STABLE version directory of
the filesystem weight sync, read under its reader's lease; or ``{"version": n}``
alone on a server that receives weights by broadcast: it answers once that
version is live), ``POST /pause``, ``POST /resume``.

Everything that touches the engine runs in one task between decode steps, so
requests join, weights swap and pauses take effect only between two steps.
A malformed request gets a 4xx with a message; the server keeps serving.

Run: ``python -m i3core.plugins.inference.server --model-dir DIR --port 8000`` (add
``--model NAME --model-options JSON`` for another model component, ``--engine
simulated --timing JSON`` for the simulated engine).
"""

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from aiohttp import web

from i3core.config import build_component
from i3core.errors import I3Error
from i3core.lifetime import terminate_with_run
from i3core.manager import load_plugins
from i3core.plugins.inference.engine import Engine, EngineBase, Request, Sequence
from i3core.plugins.inference.openai_api import OpenAIRoutes
from i3core.plugins.inference.utility_routes import UtilityRoutes
from i3core.plugins.inference.protocol import (
    MAX_BODY_BYTES,
    BadRequest,
    UpdateWeightsRequest,
    VersionWaits,
    error_body,
    parse,
    parse_json_object,
    report_receiver_stopped,
)
from i3core.protocols import Model
from i3core.weights import check_max_len, connect_receiver, reading

class Server:
    """The HTTP API over any :class:`EngineBase`; ``model`` (a :class:`~i3core.protocols.Model` component)
    encodes and decodes text, renders chats and says where completions stop. :func:`builtin_server` puts a
    model's own engine behind it."""

    def __init__(self, engine: EngineBase, model: Model, model_name: str):
        self.engine = engine
        self.model = model
        self.tokenizer = model.tokenizer()
        self.model_name = model_name
        self._adds: list[tuple[Sequence, asyncio.Future]] = []
        self._aborts: list[Sequence] = []
        self._futures: dict[int, asyncio.Future] = {}
        self._followers: dict[int, tuple[Sequence, asyncio.Queue]] = {}
        """Sequences whose every step is watched (:meth:`follow`): True is put once one finished."""
        self._update: tuple[dict, int, asyncio.Future] | None = None
        self._wake = asyncio.Event()
        self._paused = False
        self.receiving = False
        """Whether weights arrive by broadcast (:meth:`offer`) and ``/update_weights`` may omit the path."""
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

    # -- the engine task ---------------------------------------------------

    async def run_engine(self) -> None:
        while True:
            self._between_steps()
            if self._paused or not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = time.perf_counter()
            finished = await asyncio.get_running_loop().run_in_executor(self._stepper, self.engine.step)
            self.busy_slot_s += (time.perf_counter() - start) * (len(self.engine.running) + len(finished))
            for seq in finished:
                self.tokens_generated += len(seq.token_ids)
                future = self._futures.pop(seq.id, None)
                if future is not None and not future.done():
                    future.set_result(seq)
            for seq, updates in self._followers.values():  # streams and stop strings: every step
                if seq.token_ids or seq.finish_reason is not None:  # (max_tokens 0 finishes with none)
                    updates.put_nowait(seq.finish_reason is not None)

    def _between_steps(self) -> None:
        if self._update is not None:
            state, version, done = self._update
            self._update = None
            start = time.perf_counter()
            self.engine.load_state(state, version)
            self.update_pause_s += time.perf_counter() - start
            self.updates += 1
            if not done.done():
                done.set_result(version)
        for seq, future in self._adds:
            self._futures[seq.id] = future
            self.engine.waiting.append(seq)
        self._adds.clear()
        for seq in self._aborts:
            self.engine.abort(seq)
        self._aborts.clear()

    def new_sequence(self, request: Request) -> Sequence:
        """``request`` checked by the engine and wrapped, not yet queued.

        :raises BadRequest: an empty or too long prompt, sampling settings out of range.
        """
        try:
            return self.engine.new_sequence(request)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def generate(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` and wait until it finishes; cancelling the wait aborts it between two steps."""
        future = asyncio.get_running_loop().create_future()
        self._adds.append((seq, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: free its slot between two steps
            self._futures.pop(seq.id, None)
            self.abort(seq)
            raise

    async def follow(self, seq: Sequence) -> AsyncIterator[Sequence]:
        """Queue ``seq`` and yield it after every step that gave it tokens, last once it finished. Leaving the
        loop early (a stop string, a client gone) aborts it between two steps."""
        updates: asyncio.Queue = asyncio.Queue()
        self._followers[seq.id] = (seq, updates)
        done = asyncio.get_running_loop().create_future()
        self._adds.append((seq, done))
        self._wake.set()
        try:
            while True:
                finished = await updates.get()
                yield seq
                if finished:
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
        body = {"status": "ok", "version": self.engine.version, "paused": self._paused}
        if self._waits.failure is not None:
            body["weights_error"] = self._waits.failure
        return web.json_response(body)

    async def metrics(self, http: web.Request) -> web.Response:
        engine = self.engine
        return web.json_response(
            {
                "version": engine.version,
                "running": len(engine.running),
                "waiting": len(engine.waiting) + len(self._adds),
                "max_slots": engine.max_slots,
                "steps": engine.steps,
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
        try:
            await self.load_weights(Path(path), version)
        except ValueError as exc:
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


def model_component(name: str, options: dict, plugins=None) -> Model:
    """The model component ``name`` with ``options``, found through the plugin manager (any installed plugin)."""
    return build_component("model", {"use": name, **options}, plugins if plugins is not None else load_plugins())


def builtin_server(model_dir: Path, model: Model, *, max_slots: int, max_len: int, version: int,
                   served_name: str | None = None) -> Server:
    """The engine of ``model`` (a :class:`~i3core.protocols.Model` component) on the weights of the HF
    directory ``model_dir``.

    :raises I3Error: the model cannot be served by the builtin engine (it has no cached decode).
    """
    missing = [name for name in SERVED_BY_ENGINE if not hasattr(model, name)]
    if missing:
        raise I3Error(f"model {type(model).__name__} cannot be served by the builtin server (no "
                      f"{', '.join(missing)}); serve it with [inference] use = \"vllm\"")
    check_max_len(model_dir, max_len)
    engine = Engine(model.load_hf(model_dir), max_slots=max_slots, max_len=max_len, version=version)
    return Server(engine, model, served_name or str(model_dir))


async def _json_body(http: web.Request) -> dict:
    return parse_json_object(await http.read())


@web.middleware
async def _errors(request: web.Request, handler):
    """Every client error as JSON with a message: ours (400) and aiohttp's (404, 405, 413, ...)."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return web.json_response(error_body(str(exc), exc.param, exc.code), status=exc.status)
    except web.HTTPException as exc:
        if not 400 <= exc.status < 500:
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 405:
            message += f" (allowed: {', '.join(sorted(exc.allowed_methods))})"
        elif exc.status == 413:
            message = f"{exc.reason}: the body may hold at most {MAX_BODY_BYTES} bytes"
        return web.json_response(error_body(message), status=exc.status)


def make_app(server: Server, receiver=None) -> web.Application:
    """The HTTP app; with a broadcast ``receiver`` a thread takes the versions it delivers."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app.add_routes(
        [
            *OpenAIRoutes(server).routes(),
            *UtilityRoutes(server).routes(),
            web.get("/health", server.health),
            web.get("/metrics", server.metrics),
            web.post("/update_weights", server.update_weights),
            web.post("/pause", server.pause),
            web.post("/resume", server.resume),
        ]
    )

    async def engine_task(app):
        task = asyncio.create_task(server.run_engine())
        yield
        task.cancel()

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
    args = parser.parse_args(argv)
    terminate_with_run()  # started by `i3core run`: stop (SIGTERM, a graceful exit) if that run is killed
    torch.set_num_threads(args.threads)
    try:
        server, receiver = _build(args)
    except I3Error as exc:  # one line in the server's log; the source reports the exit
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    announce = f"i3core server: {server.model_name} on http://{args.host}:{args.port}"
    web.run_app(make_app(server, receiver), host=args.host, port=args.port, access_log=None,
                print=lambda _: print(announce, flush=True))


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
