"""The data that moves between the roles and into components.

Shapes: ``T`` is the number of tokens of a packed batch (every sample's prompt
and completion tokens, concatenated).
"""

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LossInputs:
    """What a loss component receives: 1-D tensors, one entry per token ``[T]``.

    :ivar trainer_logprobs: ``[T]`` float, log p of each token under the trainer
        (requires grad); computed on the loss tokens only, 0 where ``loss_mask`` is False.
    :ivar inference_logprobs: ``[T]`` float, log p under the policy version that
        sampled the token.
    :ivar advantages: ``[T]`` float, the sample's advantage on each of its tokens.
    :ivar loss_mask: ``[T]`` bool, True on model-generated tokens, False on
        prompt, tool and env tokens.
    :ivar sequence_ids: ``[T]`` int, which sample each token belongs to.
    :ivar num_loss_tokens: the global normaliser (loss tokens across
        micro-batches and ranks); ``None`` means ``loss_mask.sum()``. On a
        batch handed over in parts (``[trainer] stream_groups``) the total is
        not known until the last part: the trainer passes 1 and divides the
        gradients by the total once it is, so a loss must be linear in
        ``1 / num_loss_tokens`` (a sum over tokens or samples divided by it,
        as every loss additive over micro-batches is).
    """

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    sequence_ids: torch.Tensor
    num_loss_tokens: int | float | torch.Tensor | None = None

    def normaliser(self) -> torch.Tensor:
        """``num_loss_tokens`` as a float tensor, at least 1 (an all-masked batch gives zero loss)."""
        n = self.loss_mask.sum() if self.num_loss_tokens is None else self.num_loss_tokens
        return torch.as_tensor(n, dtype=self.trainer_logprobs.dtype).clamp_min(1)


@dataclass
class LossOutput:
    """A scalar ``loss`` to call ``backward()`` on, and float ``metrics`` to log."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Example:
    """One dataset row of an environment."""

    id: str
    prompt: Any
    """The prompt: text for text-completion envs, a list of chat messages for chat envs."""
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    task: str = ""
    """Which environment the row belongs to (set by an env group to its member's name); per-task metrics use it."""


@dataclass
class Rollout:
    """One trajectory of one example: tokens, logprobs, versions and its reward.

    ``completion_ids``, ``completion_logprobs``, ``completion_versions`` and
    ``completion_mask`` are aligned, one entry per completion token; the mask is
    True on model tokens and False on tool/env tokens of multi-turn rollouts
    (those carry logprob 0 and version -1).

    Credit assignment: with ``credit = "episode"`` every model token gets the
    rollout's advantage; with ``"turn"`` the orchestrator gives each turn its own
    advantage from ``turn_rewards`` (``completion_turns`` says which turn each
    completion token belongs to) and writes it to ``completion_advantages``.
    """

    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_versions: list[int]
    completion_mask: list[bool]
    completion_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    finish_reason: str | None = None
    """Why the last model turn ended (``stop``, ``length``, ... as the server said); None if nothing was generated."""
    completion_turns: list[int] = field(default_factory=list)
    """The turn (0, 1, ...) of each completion token; empty means one turn."""
    turn_rewards: list[float] = field(default_factory=list)
    """Reward earned in each turn (their sum is ``reward``); empty means all of it in the last turn."""
    credit: str = "episode"
    """``episode``: one advantage per rollout; ``turn``: one per turn (see the class docstring)."""
    completion_advantages: list[float] | None = None
    """Per-token advantages of the completion (turn-level credit), or None: ``advantage`` on every token."""
    state: dict[str, Any] = field(default_factory=dict, repr=False)
    """The env's final rollout state (messages, custom keys), for group-level scoring and inspection."""

    @property
    def model_versions(self) -> list[int]:
        """The policy versions of the model-sampled tokens (tool and env tokens have none)."""
        return [v for v, m in zip(self.completion_versions, self.completion_mask) if m]

    @property
    def oldest_version(self) -> int:
        return min(self.model_versions, default=0)


@dataclass
class Group:
    """Every rollout of one prompt (``group_size`` of them)."""

    example: Example
    rollouts: list[Rollout]

    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


@dataclass
class TrainBatch:
    """A packed batch for one trainer step: rows of ``seq_len`` tokens.

    Every tensor is ``[rows, seq_len]``; ``position_ids`` restart at 0 for each
    sample so packed samples never attend to each other.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    sequence_ids: torch.Tensor
    versions: torch.Tensor
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    streamed_rows: int = 0
    """Leading rows the trainer was handed earlier, as the batch's parts (``[trainer] stream_groups``)."""

    ROWS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "sequence_ids", "versions")
    """The ``[rows, seq_len]`` fields."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class Completion:
    """What an inference client returns for one prompt.

    ``token_ids``, ``logprobs`` and ``versions`` are aligned, one entry per
    generated token; ``versions[i]`` is the policy version that sampled token i.
    """

    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"


@dataclass
class ExecResult:
    """What one command run in a sandbox did.

    :ivar exit_code: the command's exit status; negative ``-N`` when signal N
        ended it; ``None`` when it never finished (timed out and killed).
    :ivar stdout, stderr: decoded UTF-8 (undecodable bytes replaced), each at
        most the backend's ``max_output_bytes``.
    :ivar timed_out: the command ran past its timeout and was killed, with
        every process it started.
    :ivar oom_killed: the memory limit killed a process of the command;
        ``None`` where the backend cannot tell.
    :ivar truncated: stdout or stderr was longer than ``max_output_bytes``; the
        rest was read and thrown away.
    :ivar duration_s: wall time from start to the last byte of output.
    """

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    oom_killed: bool | None = None
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out
