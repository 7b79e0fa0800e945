"""i3core's routes inside ``vllm serve`` (a vLLM endpoint plugin, entry point ``vllm.endpoint_plugins: i3core``).

The ``vllm`` rollout source starts ``vllm serve`` with ``VLLM_PLUGINS`` naming
this plugin and ``I3CORE_VLLM`` (JSON: initial ``version``, optional broadcast
``receiver`` spec and ``rank``, ``prefix_caching``). Next to vLLM's own OpenAI
API it serves the same contract as the builtin server, so the orchestrator's
client is one class:

- ``POST /v1/completions``: token-id (or text) prompts, tokens in, tokens out;
  every token comes back with its logprob (after temperature, vLLM's
  ``processed_logprobs``) and the policy version that sampled it; ``stop``
  strings are vLLM's own, ``stop_token_ids`` default to every eos id (the
  tokenizer's and generation_config's, where vLLM stops), and the text is
  :func:`i3core.text.completion_text` of the tokens, as the builtin server's;
- ``POST /update_weights`` ``{"path", "version"}`` or, with a broadcast
  receiver, ``{"version"}``; ``POST /pause``, ``POST /resume``; ``GET /health``
  (JSON with the live version); ``GET /i3/metrics``. The weight and pause routes ask for the run's admin token
  (``$I3CORE_ADMIN_TOKEN``, inherited from ``i3core run``) and load only from the directory of the served version's
  siblings.

An update pauses the engine with ``mode="keep"`` (running sequences stay where
they are), has the worker extension
(:class:`~i3core.plugins.inference.vllm_worker.WeightUpdateExtension`) check
and apply the weights, and resumes: the same sequences go on under the new
version. The worker reports how many tokens each request had produced at that
moment, which is where that request's tokens change version.

A run that trains a LoRA adapter starts vLLM on the base with LoRA enabled and
``I3CORE_VLLM``'s ``adapter`` naming version 0's adapter directory. Every
version is then an adapter that ``/update_weights`` loads through vLLM's
adapter API (``add_lora``, read under the version's reader lease); nothing is
paused and no base weight is touched. A request runs to its end on the adapter
that was live when it started, so every token's version is that adapter's.
"""

import asyncio
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from i3core.lifetime import ADMIN_TOKEN_ENV
from i3core.text import completion_text
from i3core.plugins.inference.protocol import (
    BadRequest,
    CompletionRequest,
    UpdateWeightsRequest,
    VersionWaits,
    bearer_matches,
    completion_choice,
    envelope,
    error_body,
    parse,
    parse_json_object,
    report_receiver_stopped,
    unauthorized,
    weights_path,
)

COMPLETIONS_ROUTE = "/i3/v1/completions"
"""i3core's token route: beside vLLM's own OpenAI ``/v1/completions``, which stays as vLLM serves it (an OpenAI
client or agent scaffold sees vLLM's API unchanged)."""
SETTINGS_ENV = "I3CORE_VLLM"
"""Environment variable with this plugin's settings (JSON), set by the ``vllm`` rollout source."""


@dataclass
class Tracked:
    """One request being generated: its tokens and where their version changes."""

    version: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    fences: list[tuple[int, int]] = field(default_factory=list)
    """``(tokens produced before the update, new version)``, in update order."""

    def versions(self) -> list[int]:
        out, version, fences = [], self.version, list(self.fences)
        for i in range(len(self.token_ids)):
            while fences and fences[0][0] <= i:
                version = fences.pop(0)[1]
            out.append(version)
        return out


class I3Endpoints:
    """The endpoint plugin object vLLM builds (zero-argument factory)."""

    name = "i3core"
    required_tasks = ("generate",)

    def __init__(self):
        settings = json.loads(os.environ.get(SETTINGS_ENV, "{}"))
        self.version = int(settings.get("version", 0))
        self.receiver = settings.get("receiver")
        self.rank = int(settings.get("rank", 1))
        self.prefix_caching = bool(settings.get("prefix_caching", False))
        self.adapter = settings.get("adapter")
        """Version 0's adapter directory when vLLM serves a LoRA run (then :attr:`lora` is the live adapter)."""
        self.lora = None
        self.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
        self.weight_roots: list[Path] = []
        """Where ``/update_weights`` may read: the directory holding the served version (the run's versions)."""
        self.engine = None
        self.model_name = ""
        self.vocab_size = 0
        self.max_len = 0
        self.tokenizer = None
        self.eos_ids: list[int] = []
        """Where a completion stops when the request names no ``stop_token_ids``: as vLLM stops by default."""
        self.active: dict[str, Tracked] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._waits = VersionWaits()
        self._waits.live = self.version
        self._paused = False
        self.updates = 0
        self.update_pause_s = 0.0
        self.tokens_generated = 0
        self.requests_served = 0

    # -- vLLM's plugin interface ---------------------------------------------------

    def attach_router(self, app) -> None:
        from fastapi import APIRouter

        router = APIRouter()
        router.add_api_route(COMPLETIONS_ROUTE, self._handler(self.completions), methods=["POST"])
        router.add_api_route("/update_weights", self._handler(self.update_weights, admin=True), methods=["POST"])
        router.add_api_route("/pause", self._handler(self.pause, admin=True), methods=["POST"])
        router.add_api_route("/resume", self._handler(self.resume, admin=True), methods=["POST"])
        router.add_api_route("/health", self._handler(self.health), methods=["GET"])
        router.add_api_route("/i3/metrics", self._handler(self.metrics), methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.engine = engine_client
        if engine_client is None:
            return
        config = engine_client.model_config
        self.model_name = str(config.served_model_name or config.model)
        served = Path(self.adapter if self.adapter is not None else config.model)  # a LoRA run: its adapters
        self.weight_roots = [served.resolve().parent]
        self.vocab_size = config.get_vocab_size()
        self.max_len = config.max_model_len
        self.tokenizer = await _tokenizer(engine_client)
        eos = config.try_get_generation_config().get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = list(dict.fromkeys(i for i in [*eos, self.tokenizer.eos_token_id] if i is not None))
        if self.adapter is not None:
            await self._load_adapter(Path(self.adapter), self.version)
            self.updates = 0  # the version it started from
        if self.receiver is not None:
            threading.Thread(target=self._receive_forever, args=(asyncio.get_running_loop(),),
                             name="weights-watcher", daemon=True).start()

    # -- HTTP ---------------------------------------------------------------------

    def _handler(self, method, admin: bool = False):
        """``method`` as a route; an ``admin`` one asks for the run's admin token (``$I3CORE_ADMIN_TOKEN``)."""
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def handle(request: Request):
            try:
                if admin and self.admin_token and not bearer_matches(request.headers.get("Authorization"),
                                                                     self.admin_token):
                    raise unauthorized(f"{request.url.path} needs the admin token")
                body = {} if request.method == "GET" else parse_json_object(await request.body())
                return JSONResponse(await method(body))
            except BadRequest as exc:
                return JSONResponse(error_body(str(exc), exc.param, exc.code), status_code=exc.status)

        handle.__name__ = f"i3_{method.__name__}"
        return handle

    async def completions(self, body: dict) -> dict:
        request = parse(CompletionRequest, body)
        prompt_ids = request.prompt_ids(self.vocab_size, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        sampling = request.sampling(self.max_len, self.vocab_size, self.eos_ids)
        # The orchestrator's route: a completion that reaches max_len stops there ("length"), as on the builtin
        # server with clip_max_tokens (what the orchestrator's client sends).
        sampling.clip_max_tokens = True
        sampling.max_tokens = sampling.fit(len(prompt_ids), self.max_len)
        done = await asyncio.gather(*(self._generate(prompt_ids, sampling, i) for i in range(sampling.n)))
        self.requests_served += 1
        choices = [
            completion_choice(i, completion_text(self.tokenizer, t.token_ids, stop_token_ids=sampling.stop_token_ids,
                                                 stop=sampling.stop, skip_special_tokens=sampling.skip_special_tokens),
                              prompt_ids, t.token_ids, t.logprobs, t.versions(), finish)
            for i, (t, finish) in enumerate(done)
        ]
        return envelope("text_completion", f"cmpl-i3-{self.requests_served}", self.model_name, choices, prompt_ids)

    async def _generate(self, prompt_ids: list[int], sampling, i: int) -> tuple[Tracked, str | None]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, seed=sampling.seed_of(i),
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, stop=list(sampling.stop) or None,
            logprobs=0, skip_special_tokens=sampling.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        request_id = f"i3-{next(self._ids)}"
        tracked = self.active[request_id] = Tracked(self.version)
        finish = None
        try:
            async for output in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                                     request_id, lora_request=self.lora):
                piece = output.outputs[0]
                tracked.token_ids.extend(piece.token_ids)
                tracked.logprobs.extend(lp[t].logprob for lp, t in zip(piece.logprobs or [], piece.token_ids))
                finish = piece.finish_reason or finish
        finally:
            self.active.pop(request_id, None)
        self.tokens_generated += len(tracked.token_ids)
        return tracked, finish

    async def update_weights(self, body: dict) -> dict:
        request = parse(UpdateWeightsRequest, body)
        path, version = request.path, request.version
        if path is None:
            if self.receiver is None:
                raise BadRequest("this server receives weights from a path only: give path")
            await self._waits.wait(version)
            return {"status": "ok", "version": self.version}
        from i3core.weights import reading

        path = str(weights_path(path, self.weight_roots)) if self.weight_roots else path  # the worker takes a str
        try:
            with reading(Path(path)):  # the trainer's pruning waits until the worker has read it
                if self.lora is not None:
                    await self._load_adapter(Path(path), version)
                else:
                    await self._apply(version, "i3_load_path", (path,))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self._waits.arrived(version)
        return {"status": "ok", "version": version}

    async def pause(self, body: dict) -> dict:
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        self._paused = True
        return {"status": "paused", "version": self.version}

    async def resume(self, body: dict) -> dict:
        await self.engine.resume_generation()
        self._paused = False
        return {"status": "running", "version": self.version}

    async def health(self, body: dict) -> dict:
        health = {"status": "ok", "version": self.version, "paused": self._paused, "engine": "vllm"}
        if self._waits.failure is not None:
            health["weights_error"] = self._waits.failure
        return health

    async def metrics(self, body: dict) -> dict:
        return {"version": self.version, "running": len(self.active), "updates": self.updates,
                "update_pause_s": self.update_pause_s, "tokens_generated": self.tokens_generated,
                "requests_served": self.requests_served}

    # -- updates --------------------------------------------------------------------

    async def _load_adapter(self, path: Path, version: int) -> None:
        """Have vLLM load the adapter directory ``path`` as ``version``; requests started from now on use it
        (running ones keep theirs: their tokens are all of their own version).

        :raises ValueError: vLLM refused the adapter (its one-line reason).
        """
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"i3-v{version}", version + 1, str(path))
        async with self._lock:
            try:
                loaded = await self.engine.add_lora(request)
            except Exception as exc:  # vLLM hands a worker's exception back as a plain one
                raise ValueError(f"vLLM cannot load the adapter {path}: {_first_line(exc)}") from None
            if loaded is False:
                raise ValueError(f"vLLM did not load the adapter {path}")
            self.lora, self.version = request, version
            self.updates += 1

    async def _apply(self, version: int, method: str, args: tuple) -> dict:
        """Pause (keep), run ``method`` on the worker, fence every running request, resume."""
        async with self._lock:
            start = time.perf_counter()
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                results = await self.engine.collective_rpc(method, args=args)
                if len(results) != 1:
                    raise ValueError(f"{len(results)} vLLM workers answered: i3core's weight updates serve "
                                     "one worker per server (no tensor parallelism yet)")
                (result,) = results
                if self.prefix_caching:
                    await self.engine.reset_prefix_cache()
                if result["version"] is not None:
                    version = result["version"]
                counts = result["counts"]
                for request_id, tracked in self.active.items():
                    # vLLM's own id is ours plus "-<suffix>"; a request it does not hold yet has made no token.
                    made = next((n for internal, n in counts.items()
                                 if internal == request_id or internal.startswith(request_id + "-")), None)
                    tracked.fences.append((len(tracked.token_ids) if made is None else made, version))
                self.version = version
                self.updates += 1
            except Exception as exc:  # vLLM hands a worker's exception back as a plain one
                raise ValueError(_first_line(exc)) from None
            finally:
                if not self._paused:
                    await self.engine.resume_generation()
                self.update_pause_s += time.perf_counter() - start
            return result

    def _receive_forever(self, loop: asyncio.AbstractEventLoop) -> None:
        """A daemon thread: watch the broadcast group's store for each round, then have the worker take it.

        The watcher only reads the store (it never joins the group or touches a device). A version
        that does not fit is refused; any other failure stops receiving for good, and every later
        wait for a version fails with that reason.
        """
        from i3core.weights import connect_receiver

        try:
            watcher = connect_receiver(self.receiver, self.rank)
            while True:
                version = watcher.wait_round()
                try:
                    asyncio.run_coroutine_threadsafe(self._apply(version, "i3_receive", (self.receiver, self.rank)),
                                                     loop).result()
                except ValueError as exc:
                    loop.call_soon_threadsafe(self._waits.rejected, version, str(exc))
                    continue
                loop.call_soon_threadsafe(self._waits.arrived, version)
        except Exception as exc:  # a broken group cannot be rejoined
            report_receiver_stopped(self._waits, loop, exc, f"{type(exc).__name__}: {_first_line(exc)}")


async def _tokenizer(engine_client):
    getter = getattr(engine_client, "get_tokenizer", None)
    if getter is not None:
        tokenizer = getter()
        return await tokenizer if asyncio.iscoroutine(tokenizer) else tokenizer
    return engine_client.tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
