"""Rubric: weighted reward functions over a finished rollout, scored concurrently.

A reward function declares the arguments it wants by name and gets exactly
those: ``prompt``, ``completion``, ``answer``, ``state``, ``info``, ``task``,
``example`` (a ``**kwargs`` parameter gets them all). It returns a float and
may be ``async``. The rollout's reward is ``sum(weight_i * f_i)``; every
function's value is also a rollout metric under its name, so a function with
weight 0 is a metric only.

Group-level functions see every rollout of one prompt group at once and take
the plural names (``prompts``, ``completions``, ``answers``, ``states``,
``infos``, ``tasks``, ``examples``); they return one float per rollout (e.g.
a rank among the group, or a pairwise judge). They run when the group's last
rollout is back.

A function that raises scores 0 for that rollout (the others still count);
the metric ``rubric_error/<name>`` is 1 for it (0 otherwise, so its batch mean
is the error rate) and the error is logged. Sync functions run inline on the
event loop: one doing I/O should be ``async``.
"""

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from i3core.errors import RolloutMasked, SandboxError

log = structlog.get_logger("i3core.envs.rubric")

ROLLOUT_ARGS = ("prompt", "completion", "answer", "state", "info", "task", "example")
"""What a rollout-level reward function may ask for."""
GROUP_ARGS = tuple(f"{name}s" for name in ROLLOUT_ARGS)
"""What a group-level reward function may ask for: one list per name, a rollout each."""


@dataclass
class Score:
    """A rollout's weighted reward and the value of every function (metrics)."""

    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RewardFunc:
    func: Callable
    weight: float
    name: str
    group: bool

    @functools.cached_property
    def parameters(self) -> Mapping[str, inspect.Parameter]:
        """``func``'s parameters (read once: ``inspect.signature`` costs more than a cheap reward itself)."""
        return inspect.signature(self.func).parameters

    def wanted(self, available: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments ``func`` declares, from ``available``."""
        params = self.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(available)
        unknown = [n for n, p in params.items() if n not in available and p.default is inspect.Parameter.empty]
        if unknown:
            choices = GROUP_ARGS if self.group else ROLLOUT_ARGS
            raise TypeError(f"reward function {self.name} asks for {unknown}; it may ask for {', '.join(choices)}")
        return {n: available[n] for n in params if n in available}

    async def call(self, available: dict[str, Any]):
        try:
            result = self.func(**self.wanted(available))
            if inspect.isawaitable(result):
                result = await result
        except SystemExit as exc:  # in a task of its own: asyncio would let it out of the loop, ending the run
            raise RuntimeError(f"{self.name} called sys.exit({exc.code!r})") from None
        return result


def rollout_args(state: dict) -> dict[str, Any]:
    """The arguments a rollout-level function may ask for, from a rollout state."""
    example = state["example"]
    return {"prompt": state["prompt"], "completion": state["completion"], "answer": example.answer, "state": state,
            "info": example.info, "task": example.task, "example": example}


class Rubric:
    """Reward functions with weights; see the module docstring for how they are called."""

    def __init__(self, funcs: list[Callable] | None = None, weights: list[float] | None = None):
        self.funcs: list[RewardFunc] = []
        weights = weights if weights is not None else [1.0] * len(funcs or [])
        if len(weights) != len(funcs or []):
            raise ValueError(f"{len(funcs or [])} reward functions but {len(weights)} weights")
        for func, weight in zip(funcs or [], weights):
            self.add_reward_func(func, weight)

    def add_reward_func(self, func: Callable, weight: float = 1.0, name: str | None = None) -> None:
        """Add a rollout-level reward function."""
        self._add(RewardFunc(func, weight, name or func.__name__, group=False))

    def add_metric(self, func: Callable, name: str | None = None) -> None:
        """Add a function that is logged, never rewarded (weight 0)."""
        self.add_reward_func(func, 0.0, name)

    def add_group_reward_func(self, func: Callable, weight: float = 1.0, name: str | None = None) -> None:
        """Add a group-level reward function (plural arguments; one float per rollout)."""
        self._add(RewardFunc(func, weight, name or func.__name__, group=True))

    def _add(self, func: RewardFunc) -> None:
        if any(f.name == func.name for f in self.funcs):
            raise ValueError(f"a reward function named {func.name!r} is already in the rubric")
        self.funcs.append(func)

    @property
    def has_group_funcs(self) -> bool:
        return any(f.group for f in self.funcs)

    async def score_rollout(self, state: dict) -> Score:
        """Run every rollout-level function concurrently on one finished rollout."""
        funcs = [f for f in self.funcs if not f.group]
        available = rollout_args(state)
        results = await asyncio.gather(*(f.call(available) for f in funcs), return_exceptions=True)
        score = Score()
        for func, result in zip(funcs, results):
            value, failed = _value(func, result, state["example"].id)
            if func.weight:  # a metric (weight 0) never enters the reward, not even as a NaN
                score.reward += func.weight * value
            score.metrics[func.name] = value
            score.metrics[f"rubric_error/{func.name}"] = float(failed)
        return score

    async def score_group(self, states: list[dict]) -> list[Score]:
        """Run every group-level function concurrently over one group; one :class:`Score` per rollout
        holding only the group functions' part (added to each rollout's own score by the env)."""
        funcs = [f for f in self.funcs if f.group]
        per_rollout = [rollout_args(s) for s in states]
        available = {f"{name}s": [args[name] for args in per_rollout] for name in ROLLOUT_ARGS}
        results = await asyncio.gather(*(f.call(available) for f in funcs), return_exceptions=True)
        scores = [Score() for _ in states]
        for func, result in zip(funcs, results):
            if not isinstance(result, BaseException) and (not hasattr(result, "__len__") or len(result) != len(states)):
                got = f"{len(result)} values" if hasattr(result, "__len__") else type(result).__name__
                result = ValueError(f"returned {got} for a group of {len(states)}")
            for i, score in enumerate(scores):
                value, failed = _value(func, result if isinstance(result, BaseException) else result[i],
                                       states[i]["example"].id)
                if func.weight:
                    score.reward += func.weight * value
                score.metrics[func.name] = value
                score.metrics[f"rubric_error/{func.name}"] = float(failed)
        return scores


def _value(func: RewardFunc, result, example_id: str) -> tuple[float, bool]:
    """The function's value and whether it failed (raised, or returned something that is not a number)."""
    if isinstance(result, BaseException):
        if not isinstance(result, Exception) or isinstance(result, SandboxError | RolloutMasked):
            raise result  # a cancellation, or the sandbox failed (not the function): the rollout is masked
        log.warning("reward function failed; scored 0", func=func.name, example=example_id,
                    error=f"{type(result).__name__}: {result}")
        return 0.0, True
    try:
        return float(result), False
    except (TypeError, ValueError):
        log.warning("reward function returned a non-number; scored 0", func=func.name, example=example_id,
                    value=repr(result)[:80])
        return 0.0, True
