"""The interfaces each component kind meets; nothing else.

A component is built as ``cls(config)`` from its registered class; these are
the methods the core calls on it afterwards.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from i3core.types import Completion, Example, LossInputs, LossOutput, Rollout


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
    async def complete(self, prompt: str, *, max_tokens: int, temperature: float) -> Completion:
        """Generate one completion; every token carries its logprob and policy version."""


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
        """Publish a :class:`~i3core.trainer.PublishedWeights`; every trainer rank calls it."""

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
