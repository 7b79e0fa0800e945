"""The interfaces each component kind meets; nothing else.

A component is built as ``cls(config)`` from its registered class; these are
the methods the core calls on it afterwards.
"""

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from i3core.types import Completion, Example, ExecResult, LossInputs, LossOutput, Rollout


@runtime_checkable
class Loss(Protocol):
    def __call__(self, inputs: LossInputs) -> LossOutput:
        """The scalar loss over the packed tokens ``[T]`` and its metrics."""


@runtime_checkable
class Optimizer(Protocol):
    def build(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        """A torch optimizer over plain or FSDP2-sharded (DTensor) parameters."""


@runtime_checkable
class InferenceClient(Protocol):
    """One inference server, as an env sees it. Tokens in, tokens out: a multi-turn env keeps
    the token ids it was given and sends them back with ``complete_ids``, never re-tokenising."""

    tokenizer: Any
    """Encodes env text: ``tokenizer.encode(text).ids`` (``tokenizers``) or ``encode(text)`` (transformers)."""

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float) -> Completion:
        """Generate one completion of a text prompt; every token carries its logprob and policy version."""

    async def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                           stop_token_ids: list[int] | None = None) -> Completion:
        """Generate one completion of a token-id prompt, stopping at ``stop_token_ids`` (None: the
        client's default); the stop token, when hit, is the last of ``token_ids``."""


@runtime_checkable
class Environment(Protocol):
    def examples(self) -> list[Example]:
        """The environment's dataset, in a seeded order."""

    async def rollout(self, client: InferenceClient, example: Example) -> Rollout:
        """Drive one rollout of ``example`` through ``client`` and score it."""


@runtime_checkable
class Scheduler(Protocol):
    """What the orchestrator asks its scheduler; ``step`` is the next batch to cut."""

    group_size: int
    groups_per_batch: int
    rollout_slots: int
    weight_update_lag: int

    def may_start_group(self, step: int, served_version: int, open_groups: int) -> bool:
        """Whether a new prompt group may start now (``open_groups``: started, not yet trained or dropped)."""

    def may_cut(self, step: int, served_version: int) -> bool:
        """Whether the batch of ``step`` may be handed to the trainer while the servers hold ``served_version``."""

    def is_stale(self, oldest_version: int, step: int) -> bool:
        """Whether a group whose oldest token is ``oldest_version`` is dropped instead of trained at ``step``."""


@runtime_checkable
class WeightSync(Protocol):
    """Moves each policy version from the trainer to the servers; ``root`` is the run's ``broadcasts/``."""

    def publish(self, root: Path, weights) -> None:
        """Publish a :class:`~i3core.loop.trainer.PublishedWeights`; every trainer rank calls it."""

    def is_ready(self, root: Path, version: int) -> bool:
        """Whether ``version`` has reached the servers' side (the orchestrator then tells them to load it)."""

    def location(self, root: Path, version: int) -> Path | None:
        """The directory a server loads ``version`` from, or None when the transport delivers it."""

    def receiver(self, root: Path) -> dict | None:
        """What each server needs to receive weights other than from a path (JSON), or None."""


@runtime_checkable
class MetricSink(Protocol):
    def open(self, output_dir: Path) -> None:
        """Start writing under the run's output directory."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Record one trainer step's metrics."""

    def close(self) -> None:
        """Flush and release; called once, also after a failure."""


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run model-written code, with a private work directory.

    Paths given to ``write_file``/``read_file`` are relative to the work
    directory (which is also each command's working directory); anything that
    leaves it, directly or through a symlink, raises
    :class:`~i3core.errors.SandboxFileError`. A failure of the sandbox itself
    raises :class:`~i3core.errors.SandboxError`; a failing command does not.
    """

    id: str

    async def exec(self, cmd: str | Sequence[str], timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` (an argv list, or a string for ``/bin/sh -c``) in the work directory.

        ``timeout`` in seconds (None: the backend's default); on expiry every
        process the command started is killed and ``timed_out`` is set.
        """

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace ``path`` (str is written as UTF-8); parent directories are made."""

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path``, at most the backend's ``max_file_bytes``."""

    async def reset(self) -> None:
        """Kill every process of the sandbox and empty its work directory, for reuse by another rollout."""

    async def alive(self) -> bool:
        """Whether the sandbox still works (cheap; the pool polls it during a rollout)."""

    async def close(self) -> None:
        """Kill every process the sandbox started and free it; idempotent."""

    async def __aenter__(self) -> "Sandbox": ...

    async def __aexit__(self, *exc_info) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes sandboxes; the ``[sandbox]`` component."""

    async def create(self) -> Sandbox:
        """A new, started sandbox; raises :class:`~i3core.errors.SandboxError` if it cannot start."""

    async def aclose(self) -> None:
        """Close every sandbox this backend made that is still open, and release the backend."""
