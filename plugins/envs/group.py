"""``group``: several environments trained together, each row tagged with its member's task id.

```toml
[env]
use = "group"
mixing = "adaptive"          # or "fixed" (the default)

[[env.members]]
use = "reverse-text"         # any registered env; its other keys are its options
weight = 1.0
max_len = 5

[[env.members]]
use = "tool-calc"
name = "calc"                # the task id (default: the env's name)
weight = 2.0
```

Prompts are drawn member by member: each draw picks a member with
probability proportional to its weight, then that member's next row (its
dataset reshuffled every epoch), so weights set the mix whatever the dataset
sizes. Rollouts and group scoring go to the member that owns the row
(``example.task``); every step logs ``env/<task>/...`` per member (reward,
share of the batch, metrics) and ``env/<task>/mix_weight``.

Adaptive mixing (``mixing = "adaptive"``, an open question of the
INTELLECT-3 report): a group whose rewards are all equal has zero advantage
everywhere and teaches nothing. Each member's weight is its configured
weight times its share of non-zero-advantage groups among its last
``adaptive_window`` groups (``env/<task>/nonzero_adv_share``), floored at
``adaptive_floor`` so a member that learned nothing lately is still sampled
and measured. A member with no groups yet counts as share 1.
"""

import dataclasses
import random
from collections import deque
from collections.abc import Iterator
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from i3core.config import ComponentRef
from i3core.protocols import InferenceClient
from i3core.types import Example, Rollout


class Member(ComponentRef):
    """One ``[[env.members]]`` entry: ``use``, ``name``, ``weight`` and the env's own options."""

    kind: ClassVar[str] = "env"

    name: str | None = Field(None, description="Task id of this member's rows (default: `use`); unique.")
    weight: float = Field(1.0, gt=0, description="Relative probability of drawing a prompt from this member.")

    @property
    def task(self) -> str:
        return self.name or self.use


class EnvGroup:
    """Routes each row to the member env it came from; mixes members by weight (fixed or adaptive)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        members: list[Member] = Field(min_length=1, description="The member envs ([[env.members]]).")
        mixing: Literal["fixed", "adaptive"] = Field(
            "fixed", description="fixed: draw members by weight; adaptive: weight x recent share of "
                                 "non-zero-advantage groups.")  # fmt: skip
        adaptive_window: int = Field(32, ge=1, description="Recent groups per member that adaptive mixing counts.")
        adaptive_floor: float = Field(0.05, gt=0, le=1, description="Lowest share adaptive mixing gives a member.")

        @model_validator(mode="after")
        def _unique(self):
            tasks = [m.task for m in self.members]
            if dupes := sorted({t for t in tasks if tasks.count(t) > 1}):
                raise ValueError(f"member task ids must be unique; repeated: {', '.join(dupes)} (set `name`)")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.init_members({m.task: m.build() for m in config.members}, {m.task: m.weight for m in config.members})

    def init_members(self, members: dict, weights: dict[str, float]) -> None:
        """Take ``members`` (task id -> env) drawn by ``weights`` (task id -> relative weight); ``config`` holds
        ``mixing``, ``adaptive_window`` and ``adaptive_floor``. A subclass that makes its own members calls it."""
        config = self.config
        self.members = members
        self.base_weights = weights
        stops = {env.stop_text for env in self.members.values()}
        if len(stops) > 1:
            raise ValueError(f"member envs stop text completions at different texts: {sorted(stops)}")
        self.stop_text = stops.pop()
        self.requires_sandbox = any(getattr(env, "requires_sandbox", False) for env in self.members.values())
        self._recent = {task: deque(maxlen=config.adaptive_window) for task in self.members}
        self._examples: list[Example] | None = None

    # -- dataset and routing ----------------------------------------------------

    def examples(self) -> list[Example]:
        """Every member's rows, in member order, each tagged with its member's task id."""
        if self._examples is None:
            self._examples = [dataclasses.replace(e, task=task) for task, env in self.members.items()
                              for e in env.examples()]
        return self._examples

    def member(self, example: Example):
        env = self.members.get(example.task)
        if env is None:
            raise ValueError(f"example {example.id!r} has task {example.task!r}, not a member of this group "
                             f"({', '.join(self.members)})")
        return env

    async def rollout(self, client: InferenceClient, example: Example) -> Rollout:
        return await self.member(example).rollout(client, example)

    async def score_group(self, rollouts: list[Rollout]) -> None:
        """The member's group scoring, then the group's outcome for adaptive mixing."""
        example = rollouts[0].example
        score_group = getattr(self.member(example), "score_group", None)
        if score_group is not None:
            await score_group(rollouts)
        self._recent[example.task].append(len({r.reward for r in rollouts}) > 1)

    def demonstration(self, example: Example) -> str | None:
        return self.member(example).demonstration(example)

    def sft_ids(self, example: Example, tokenizer) -> tuple[list[int], list[int]] | None:
        member = self.member(example)
        sft_ids = getattr(member, "sft_ids", None)
        if sft_ids is not None:
            return sft_ids(example, tokenizer)
        demonstration = member.demonstration(example)
        return None if demonstration is None else (tokenizer.encode(example.prompt).ids,
                                                   tokenizer.encode(demonstration, add_special_tokens=False).ids)

    def max_rollout_tokens(self) -> int | None:
        bounds = [getattr(env, "max_rollout_tokens", lambda: None)() for env in self.members.values()]
        return max((b for b in bounds if b is not None), default=None)

    def bind_sandboxes(self, pool) -> None:
        for env in self.members.values():
            bind = getattr(env, "bind_sandboxes", None)
            if bind is not None:
                bind(pool)

    # -- mixing ----------------------------------------------------------------

    def nonzero_share(self, task: str) -> float:
        recent = self._recent[task]
        return sum(recent) / len(recent) if recent else 1.0

    def weights(self) -> dict[str, float]:
        """Each member's probability of being drawn next (they sum to 1)."""
        raw = dict(self.base_weights)
        if self.config.mixing == "adaptive":
            raw = {t: w * max(self.config.adaptive_floor, self.nonzero_share(t)) for t, w in raw.items()}
        total = sum(raw.values())
        return {t: w / total for t, w in raw.items()}

    def example_stream(self, rng: random.Random) -> Iterator[Example]:
        """Endless prompts: a member drawn by :meth:`weights` (read at each draw), then its next row."""
        by_task: dict[str, list[Example]] = {}
        for example in self.examples():
            by_task.setdefault(example.task, []).append(example)
        streams = {task: _cycle(rows, random.Random(rng.random())) for task, rows in by_task.items()}
        while True:
            weights = self.weights()
            task = rng.choices(list(weights), weights=list(weights.values()))[0]
            yield next(streams[task])

    def metrics(self) -> dict[str, float]:
        """Per member: its mixing weight now and its recent share of non-zero-advantage groups."""
        out = {}
        for task, weight in self.weights().items():
            out[f"env/{task}/mix_weight"] = weight
            out[f"env/{task}/nonzero_adv_share"] = self.nonzero_share(task)
        return out


def _cycle(rows: list[Example], rng: random.Random) -> Iterator[Example]:
    rows = list(rows)
    while True:
        rng.shuffle(rows)
        yield from rows
