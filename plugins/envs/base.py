"""The environment hierarchy's root and its first level, each level adding one capability.

- :class:`Environment`: a dataset, a :class:`~i3core.plugins.envs.rubric.Rubric`
  and ``async rollout(client, example)``: set up, generate, score, clean up
  (always), and hand back a :class:`~i3core.types.Rollout` with its tokens.
- :class:`SingleTurnEnv`: one text prompt in, one completion out (the
  tiny-model envs: a seeded synthetic dataset, a ``score`` function and an SFT
  ``demonstration``).
- :class:`~i3core.plugins.envs.multiturn.MultiTurnEnv` and below: chat,
  tools, sandboxes (their own modules).

A rollout's life is one ``state`` dict: ``example``, ``prompt``,
``completion`` (text, or the list of messages after the prompt), ``turn``,
``trajectory`` (the token accounting), ``stack`` (an ``AsyncExitStack``
closed when the rollout ends, for resources taken in ``setup``), plus
whatever a subclass keeps there. Reward functions may ask for it as
``state``.
"""

import contextlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import RolloutMasked
from i3core.plugins.envs.rubric import Rubric, Score
from i3core.protocols import InferenceClient
from i3core.types import Completion, Example, Rollout

ENV_TOKEN_VERSION = -1
"""The policy version recorded on prompt, tool and env tokens (nothing sampled them)."""


class EnvConfig(BaseModel):
    """What every environment takes."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="Seed of the dataset (its order, or the generated rows).")
    max_tokens: int = Field(32, ge=1, description="Completion length limit (per turn in multi-turn envs).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    credit: Literal["episode", "turn"] = Field(
        "episode", description="Credit assignment: one advantage per rollout (episode), or one per turn from "
                               "per-turn rewards (turn).")  # fmt: skip
    truncated: Literal["score", "zero", "mask"] = Field(
        "score", description="A rollout whose last model turn ran out of max_tokens before it ended (finish_reason "
                             "length): scored as any other (score); reward 0 (zero: not ending is no answer); or "
                             "left out of training, counted as masked 'truncated' (mask, TRL's "
                             "mask_truncated_completions).")  # fmt: skip


@dataclass
class Trajectory:
    """One token sequence per rollout: the prompt, then model and env tokens as they came.

    ``ids``, ``logprobs``, ``versions``, ``mask`` and ``turns`` are aligned,
    one entry per token after the prompt; ``mask`` is True only on tokens the
    model sampled (their logprob and version come from the server), env tokens
    carry logprob 0 and version :data:`ENV_TOKEN_VERSION`.
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """Why the last model turn ended (the server's ``finish_reason``)."""

    def add_model(self, completion: Completion, turn: int) -> None:
        n = len(completion.token_ids)
        if not (len(completion.logprobs) == len(completion.versions) == n):
            raise ValueError(f"a completion of {n} tokens with {len(completion.logprobs)} logprobs "
                             f"and {len(completion.versions)} versions")
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.mask += [True] * n
        self.turns += [turn] * n
        self.finish_reason = completion.finish_reason

    def add_env(self, ids: list[int], turn: int) -> None:
        n = len(ids)
        self.ids += ids
        self.logprobs += [0.0] * n
        self.versions += [ENV_TOKEN_VERSION] * n
        self.mask += [False] * n
        self.turns += [turn] * n

    @property
    def all_ids(self) -> list[int]:
        """The whole sequence so far: what the next generation request is sent."""
        return self.prompt_ids + self.ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


class Environment(ABC):
    """A dataset, a rubric, and ``rollout``; subclasses say how a rollout is generated.

    :cvar requires_sandbox: the run refuses this env without a ``[sandbox]`` section.
    :cvar stop_text: the text that ends a text completion (the run's clients stop there by default).
    """

    Config = EnvConfig
    requires_sandbox = False
    stop_text = "\n"

    def __init__(self, config: EnvConfig):
        self.config = config
        self.rubric = self.build_rubric()
        self._examples: list[Example] | None = None

    # -- dataset and rubric ------------------------------------------------

    def examples(self) -> list[Example]:
        """The dataset (built once by :meth:`load_examples`)."""
        if self._examples is None:
            self._examples = self.load_examples()
        return self._examples

    @abstractmethod
    def load_examples(self) -> list[Example]:
        """Build the dataset, seeded by ``config.seed``."""

    def build_rubric(self) -> Rubric:
        """The rubric scoring every rollout (called once, in ``__init__``)."""
        return Rubric()

    def demonstration(self, example: Example) -> str | None:
        """The reference completion of ``example`` for the SFT warm start, or None (no SFT on this env)."""
        return None

    def max_rollout_tokens(self) -> int | None:
        """The most tokens (prompt included) one rollout can hold, when the env bounds it; the run checks
        it against the servers' ``max_len`` and ``trainer.seq_len`` before starting."""
        return None

    def sft_ids(self, example: Example, tokenizer) -> tuple[list[int], list[int]] | None:
        """(prompt ids, completion ids) of ``example``'s demonstration for the SFT warm start, or None."""
        demonstration = self.demonstration(example)
        if demonstration is None:
            return None
        return tokenizer.encode(example.prompt).ids, tokenizer.encode(demonstration, add_special_tokens=False).ids

    # -- one rollout -----------------------------------------------------------

    def init_state(self, example: Example) -> dict:
        return {"example": example, "prompt": example.prompt, "completion": None, "turn": 0, "trajectory": None,
                "turn_rewards": [], "stop_reason": None, "metrics": {}}

    async def setup(self, state: dict) -> None:
        """Before generation; take resources here, entering them on ``state["stack"]`` so they are released."""

    async def cleanup(self, state: dict) -> None:
        """After scoring, whatever happened (also on failure or cancellation), before ``state["stack"]`` closes."""

    @abstractmethod
    async def generate(self, client: InferenceClient, state: dict) -> None:
        """Generate the rollout: fill ``state["trajectory"]`` and ``state["completion"]``."""

    async def rollout(self, client: InferenceClient, example: Example) -> Rollout:
        """Set up, generate, score, clean up; the :class:`Rollout` with its tokens and reward."""
        state = self.init_state(example)
        async with contextlib.AsyncExitStack() as stack:
            state["stack"] = stack
            try:
                await self.setup(state)
                await self.generate(client, state)
                if self._truncated(state) and self.config.truncated == "mask":
                    raise RolloutMasked("truncated", f"no end within max_tokens ({self.config.max_tokens})")
                score = await self.rubric.score_rollout(state)
            finally:
                await self.cleanup(state)
        del state["stack"]
        return self.to_rollout(state, score)

    def _truncated(self, state: dict) -> bool:
        """The last model turn ran out of ``max_tokens`` (and ``truncated`` is not ``score``)."""
        traj = state["trajectory"]
        return getattr(self.config, "truncated", "score") != "score" and traj is not None \
            and traj.finish_reason == "length"

    def to_rollout(self, state: dict, score: Score) -> Rollout:
        traj: Trajectory = state["trajectory"]
        turn_rewards = list(state["turn_rewards"])
        if self._truncated(state):  # truncated = "zero" (a "mask" rollout never gets here)
            score, turn_rewards = Score(0.0, score.metrics), [0.0] * len(turn_rewards)
        reward = score.reward + sum(turn_rewards)
        if turn_rewards:
            turn_rewards[-1] += score.reward
        completion = state["completion"]
        return Rollout(
            example=state["example"],
            prompt_ids=traj.prompt_ids,
            completion_ids=traj.ids,
            completion_logprobs=traj.logprobs,
            completion_versions=traj.versions,
            completion_mask=traj.mask,
            completion_text=completion if isinstance(completion, str) else "",
            reward=reward,
            metrics={**score.metrics, **state["metrics"]},
            completion_turns=traj.turns,
            turn_rewards=turn_rewards,
            credit=self.config.credit,
            finish_reason=traj.finish_reason,
            state=state,
        )

    async def score_group(self, rollouts: list[Rollout]) -> None:
        """Add the rubric's group-level rewards to one group's rollouts (the orchestrator calls it)."""
        if not self.rubric.has_group_funcs:
            return
        scores = await self.rubric.score_group([r.state for r in rollouts])
        for rollout, score in zip(rollouts, scores):
            if self._truncated(rollout.state):  # truncated = "zero": no group-level reward either
                continue
            rollout.reward += score.reward
            if rollout.turn_rewards:
                rollout.turn_rewards[-1] += score.reward
            rollout.metrics.update(score.metrics)


class SingleTurnConfig(EnvConfig):
    num_examples: int = Field(1000, ge=1, description="Size of the generated dataset.")


class SingleTurnEnv(Environment):
    """One text prompt in, one completion out, scored by :meth:`score`.

    Subclasses define ``Config`` (extending :class:`SingleTurnConfig`),
    ``make_example(rng, index)``, ``demonstration(example)`` (the SFT target)
    and ``score(completion, example)``; :meth:`build_rubric` may add more
    reward functions and metrics.
    """

    Config = SingleTurnConfig
    stop_text = "\n"
    """Generation stops at this text; every demonstration ends with it."""

    def load_examples(self) -> list[Example]:
        rng = random.Random(self.config.seed)
        return [self.make_example(rng, i) for i in range(self.config.num_examples)]

    @abstractmethod
    def make_example(self, rng: random.Random, index: int) -> Example:
        """The example at ``index`` of the dataset, drawn from ``rng``."""

    @abstractmethod
    def demonstration(self, example: Example) -> str:
        """The reference completion, the SFT target."""

    @abstractmethod
    def score(self, completion: str, example: Example) -> float:
        """The reward of ``completion`` for ``example``, in [0, 1]."""

    def build_rubric(self) -> Rubric:
        def reward(completion: str, example: Example) -> float:
            return self.score(completion, example)

        return Rubric([reward])

    async def generate(self, client: InferenceClient, state: dict) -> None:
        completion = await client.complete(
            state["prompt"], max_tokens=self.config.max_tokens, temperature=self.config.temperature
        )
        state["trajectory"] = traj = Trajectory(list(completion.prompt_ids))
        traj.add_model(completion, 0)
        state["completion"] = completion.text
        state["turn"] = 1
