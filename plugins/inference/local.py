"""Rollout source ``local``: the builtin engine inside the orchestrator's process, no server, no HTTP.

For one small machine (a laptop): the orchestrator's rollouts call the engine
directly, so a rollout costs no HTTP request, no JSON and no second copy of the
model in another process. The engine is the builtin server's
(:class:`~i3core.plugins.inference.server.Server` over
:class:`~i3core.plugins.inference.engine.Engine`, the same continuous
batching, in-flight weight swaps between two decode steps and per-token
versions); its decode steps run in a worker thread (torch releases the GIL)
while the event loop drives the envs.

What differs from ``builtin``: one engine, in this process, no ``servers``
count (so no ``broadcast`` weight sync: it needs server processes; each
version is read from the ``filesystem`` sync's directory, which stays in the
page cache on one machine, or, with the trainer colocated, taken from the
``memory`` sync's mailbox through its ``receiver``), nothing to restart (an
engine failure fails the run, as the orchestrator's own would), and nothing another machine can reach
(a cluster keeps ``builtin`` or ``vllm``). A sequence that fails alone in the engine (non-finite logits)
fails its rollout (:class:`~i3core.errors.SequenceFailed`, counted by the ledger); an engine that breaks fails
every waiting rollout and the run with :class:`~i3core.errors.EngineFailed`. ``threads`` sets torch's threads
for the whole orchestrator process.
"""

import asyncio
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import EngineFailed, I3Error, Problem, RequestRefused, SequenceFailed, ServerError
from i3core.plugins.inference.builtin import max_tokens_problems
from i3core.plugins.inference.engine import Request
from i3core.plugins.inference.protocol import BadRequest
from i3core.types import Completion
from i3core.weights import connect_receiver

LOCAL_URL = "local://engine"
"""The one "URL" this source hands the orchestrator (its logs name the server by it)."""


class LocalSource:
    """Rollout source ``local``: one builtin engine in the orchestrator's process."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_slots: int = Field(128, ge=1, description="Sequences the engine decodes together.")
        max_len: int = Field(256, ge=8, description="Longest prompt + completion, in tokens.")
        threads: int = Field(1, ge=1, description="torch CPU threads of the orchestrator process (the engine's).")

    def __init__(self, config: Config):
        self.config = config
        self.server = None
        self.receiver = None
        """Where later versions come from when they come other than as a directory (the ``memory`` sync)."""

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        """The engine refuses a request for more than ``max_len`` tokens: the env must ask for fewer."""
        return max_tokens_problems(run, config.max_len, "the engine")

    def start(self, model_dir: Path, log_dir: Path, version: int = 0, receiver: dict | None = None,
              model: dict | None = None) -> list[str]:
        """Build the engine on ``model_dir``'s weights, served as the model component ``model`` (the run's
        ``[model]``); one URL, :data:`LOCAL_URL`. ``receiver``: a weight sync's spec for versions that do not come
        as a directory, received in this process (the ``memory`` sync's; a broadcast's check_config refuses
        ``local`` first)."""
        from i3core.plugins.inference.server import builtin_server, model_component

        self.receiver = None if receiver is None else connect_receiver(receiver, 1)
        torch.set_num_threads(self.config.threads)
        spec = model or {"use": "tiny-moe"}
        component = model_component(spec["use"], {k: v for k, v in spec.items() if k != "use"})
        self.server = builtin_server(Path(model_dir), component, max_slots=self.config.max_slots,
                                     max_len=self.config.max_len, version=version, served_name="local",
                                     scraped=False,  # no /metrics here: no per-token books
                                     max_len_setting="inference.max_len")
        return [LOCAL_URL]

    def client(self, url: str, tokenizer, stop_token_ids: list[int], stop: list[str] = ()) -> "LocalClient":
        """The orchestrator's client of the engine (``url`` is :data:`LOCAL_URL`), stopping by default at
        ``stop_token_ids`` and the ``stop`` strings."""
        if self.server is None:
            raise I3Error('inference "local" has no engine before start()')
        return LocalClient(self.server, tokenizer, stop_token_ids, stop, receiver=self.receiver)

    def close(self) -> None:
        self.server = self.receiver = None


class LocalClient:
    """The engine as an :class:`~i3core.protocols.InferenceClient` with the HTTP client's extras
    (``health``, ``update_weights``, ``pause``, ``resume``, ``close``), called on the orchestrator's event loop.

    The engine task starts on the first call, in the running loop, and stops at :meth:`close`.
    """

    def __init__(self, server, tokenizer, stop_token_ids: list[int] | None = None, stop: list[str] = (),
                 receiver=None):
        self.server = server
        self.receiver = receiver
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop = list(stop)
        self._engine_task: asyncio.Task | None = None

    def _engine(self) -> None:
        if self._engine_task is None or self._engine_task.done():
            if self._engine_task is not None and not self._engine_task.cancelled() and self._engine_task.exception():
                raise self._engine_task.exception()  # the engine failed: so does the run
            self._engine_task = asyncio.get_running_loop().create_task(self.server.run_engine())

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float, seed: int | None = None) -> Completion:
        return await self.complete_ids(self.tokenizer.encode(prompt).ids, max_tokens=max_tokens,
                                       temperature=temperature, seed=seed)

    async def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                           stop_token_ids: list[int] | None = None, stop: list[str] | None = None,
                           seed: int | None = None) -> Completion:
        """One completion of ``prompt_ids``, as the HTTP client returns it (the text the engine made of it)."""
        self._engine()
        stop_ids = stop_token_ids if stop_token_ids is not None else self.stop_token_ids
        stop = stop if stop is not None else self.stop
        request = Request(list(prompt_ids), max_tokens, temperature, tuple(stop_ids or ()), seed, stop=tuple(stop))
        try:
            seq = self.server.new_sequence(request)
        except BadRequest as exc:  # what the HTTP client raises on a 400
            raise RequestRefused(f"{LOCAL_URL}: {exc}") from None
        seq = await self.server.generate(seq)
        if seq.finish_reason == "error":
            raise SequenceFailed(f"{LOCAL_URL}: generation failed: {seq.error}")
        self.server.requests_served += 1
        return Completion(
            text=seq.text,
            prompt_ids=list(prompt_ids),
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            finish_reason=seq.finish_reason,
        )

    async def health(self) -> dict:
        if self.server.failure is not None:
            raise EngineFailed(f"{LOCAL_URL}: {self.server.failure}")
        return {"status": "ok", "version": self.server.engine.version}

    async def update_weights(self, path: str | None, version: int) -> dict:
        """Load ``version`` from the directory ``path`` (read off the event loop), or without a path take it from
        the receiver (the newest version there: ``version`` or later); swapped in between two steps."""
        self._engine()
        if path is None:
            return await self._receive(version)
        try:
            await self.server.load_weights(Path(path), version)
        except ValueError as exc:
            raise ServerError(f"{LOCAL_URL}: {exc}") from None
        return {"status": "ok", "version": version}

    async def _receive(self, version: int) -> dict:
        if self.receiver is None:
            raise ServerError(f"{LOCAL_URL}: the local engine loads weights from a path only")
        if self.server.engine.version >= version:  # a newer one was taken already
            return {"status": "ok", "version": self.server.engine.version}
        got, tensors = await asyncio.to_thread(self.receiver.receive)
        try:
            state = self.server.engine.stage_tensors(tensors)
        except ValueError as exc:
            raise ServerError(f"{LOCAL_URL}: weight version {got}: {exc}") from None
        await self.server.offer(state, got)
        return {"status": "ok", "version": got}

    async def pause(self) -> dict:
        self.server.set_paused(True)
        return {"status": "paused", "version": self.server.engine.version}

    async def resume(self) -> dict:
        self.server.set_paused(False)
        return {"status": "running", "version": self.server.engine.version}

    async def close(self) -> None:
        if self._engine_task is not None:
            self._engine_task.cancel()
            await asyncio.gather(self._engine_task, return_exceptions=True)
            self._engine_task = None
