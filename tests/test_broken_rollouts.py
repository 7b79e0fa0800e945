"""A broken env or plugin against the real orchestrator: a run that can train nothing stops with one line saying
why, an empty dataset is refused, and one rollout's bad output fails (or masks) that rollout alone.

Each orchestrator here runs the real ``reverse-text`` env (subclassed to break it the way a buggy plugin would)
against a :class:`~i3core.testing.ScriptedClient`: no model, no trainer.
"""

import asyncio
import json
import math
import signal

import numpy
import pytest
import torch

from i3core import hookimpl
from i3core.config import validate
from i3core.errors import I3Error
from i3core.loop.orchestrator import FAILED_IN_A_ROW, NONFINITE_REWARD, ClientSlot, Orchestrator, _untrainable
from i3core.plugins.envs.reverse_text import ReverseText
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import ScriptedClient, make_component, plugin_manager
from i3core.types import Example, Rollout

TIME_LIMIT_S = 20.0
"""What a run that must stop gets (it takes about a second): past it, the test fails as a run that never ends."""


class BatchCut(Exception):
    """Raised by ``before_cut``: the run reached a batch."""


def orchestrator(tmp_path, env, *plugins, before_cut=None, **schedule) -> Orchestrator:
    """A real orchestrator over ``env`` (the ``async`` scheduler, groups of 4, two a batch unless ``schedule`` says
    otherwise) with ``plugins`` registered, and one scripted server answering "abc" to everything."""
    schedule = {"group_size": 4, "batch_size": 8, "inflight": 16, **schedule}
    builtins = plugin_manager(*plugins, installed=False)
    config = validate({"run": {"output_dir": str(tmp_path), "max_steps": 3}, "env": {"use": "reverse-text"},
                       "scheduler": {"use": "async", **schedule}}, builtins)
    scheduler = make_component("scheduler", "async", plugins=builtins, **schedule)
    client = ScriptedClient(build_tokenizer(), ["abc\n"] * 4 * FAILED_IN_A_ROW)
    return Orchestrator(config, builtins, env, scheduler, None, [ClientSlot(client, "scripted")], [],
                        before_cut=before_cut)


def run(orchestrator: Orchestrator) -> None:
    """``orchestrator.run()``, failing as a run that never ends past :data:`TIME_LIMIT_S` (an alarm a little later
    stops a loop that never awaits, too)."""
    async def bounded():
        async with asyncio.timeout(TIME_LIMIT_S):
            await orchestrator.run()

    def never_ends(signum, frame):
        raise TimeoutError(f"the run was still going after {TIME_LIMIT_S}s, not awaiting anything")

    previous = signal.signal(signal.SIGALRM, never_ends)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S + 1)
    try:
        asyncio.run(bounded())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Scored(ReverseText):
    """``reverse-text`` whose every reward is ``reward``."""

    reward = float("nan")

    def score(self, completion: str, example: Example) -> float:
        return self.reward


class Huge(Scored):
    reward = 1e200  # finite in Python, infinite in the batch's float32


class NoModelTokens(ReverseText):
    async def rollout(self, client, example):
        rollout = await super().rollout(client, example)
        rollout.completion_mask = [False] * len(rollout.completion_ids)
        return rollout


class CancelsItself(ReverseText):
    async def rollout(self, client, example):
        raise asyncio.CancelledError()


class Exits(ReverseText):
    async def rollout(self, client, example):
        raise SystemExit(3)


class EmptiesGroups:
    @hookimpl
    def i3_on_group_scored(self, group):
        group.rollouts.clear()


def env(cls):
    return cls(ReverseText.Config())


@pytest.mark.parametrize("broken, plugins, line", [
    (Scored, (), f"every rollout of the last {FAILED_IN_A_ROW} was masked (nonfinite_reward); nothing can be trained"),
    (Huge, (), f"every rollout of the last {FAILED_IN_A_ROW} was masked (nonfinite_reward)"),
    (NoModelTokens, (), f"every rollout of the last {FAILED_IN_A_ROW} was masked (no_model_tokens)"),
    (ReverseText, (EmptiesGroups(),), f"every rollout of the last {FAILED_IN_A_ROW} was masked (group_filtered)"),
    (CancelsItself, (), f"{FAILED_IN_A_ROW} rollouts in a row failed, none succeeded between them; "
                        "the last: cancelled by the env"),
    (Exits, (), f"{FAILED_IN_A_ROW} rollouts in a row failed, none succeeded between them; "
                "the last: RuntimeError: the env called sys.exit(3)"),  # was the process's exit 3, no line
], ids=["nan_reward", "reward_beyond_float32", "no_model_tokens", "hook_empties_groups", "env_cancels_itself",
        "env_calls_sys_exit"])
def test_a_run_that_can_train_nothing_stops_with_one_line_saying_why(tmp_path, broken, plugins, line):
    orch = orchestrator(tmp_path, env(broken), *plugins)
    with pytest.raises(I3Error) as stopped:
        run(orch)
    assert str(stopped.value).startswith(line), str(stopped.value)
    assert orch.step == 1 and orch.ledger.trained == 0
    assert orch.ledger.masked + orch.ledger.failed >= FAILED_IN_A_ROW
    assert orch.ledger.unaccounted(orch._in_flight()) == 0  # removed rollouts are counted too


class MostlyNaN(ReverseText):
    """Every rollout masked but one in ``KEEP_EVERY``: a long run of masks, never FAILED_IN_A_ROW in a row."""

    KEEP_EVERY = FAILED_IN_A_ROW - 100
    calls = 0

    def score(self, completion: str, example: Example) -> float:
        self.calls += 1
        return 0.5 if self.calls % self.KEEP_EVERY == 0 else float("nan")


def test_masked_rollouts_between_trained_ones_never_stop_the_run(tmp_path):
    def before_cut():
        raise BatchCut

    orch = orchestrator(tmp_path, env(MostlyNaN), before_cut=before_cut)
    with pytest.raises(BatchCut):  # two groups kept, FAILED_IN_A_ROW * 2 masked: the batch is cut
        run(orch)
    assert orch.ledger.masked_reasons[NONFINITE_REWARD] > FAILED_IN_A_ROW


def test_an_env_with_no_examples_is_refused_naming_it(tmp_path):
    class Empty(ReverseText):
        def load_examples(self):
            return []

    with pytest.raises(I3Error, match="^env 'reverse-text' has no examples: its dataset is empty$"):
        run(orchestrator(tmp_path, env(Empty)))


class BadOutput(ReverseText):
    """The ``i``-th rollout of a group broken by ``CORRUPT[i]`` (what it returns is what the env returns), as a
    buggy env would break it."""

    CORRUPT = [
        lambda r: None,
        lambda r: {"reward": 1.0},
        lambda r: setattr(r, "reward", "abc") or r,
        lambda r: setattr(r, "reward", None) or r,
        lambda r: setattr(r, "completion_logprobs", r.completion_logprobs[:-1]) or r,
        lambda r: r.metrics.update(label="abc", missing=None) or r,  # metrics dropped: the rollout trains
        lambda r: r.metrics.update(x=torch.tensor(2.0)) or setattr(r, "reward", numpy.float32(0.25)) or r,
        lambda r: r,
    ]
    calls = 0

    async def rollout(self, client, example):
        rollout = await super().rollout(client, example)
        self.calls += 1
        return self.CORRUPT[self.calls - 1](rollout)


class NumpyRewards:
    """Reshapes every reward into a numpy number, as an ``i3_on_group_scored`` plugin may."""

    @hookimpl
    def i3_on_group_scored(self, group):
        for rollout in group.rollouts:
            rollout.reward = numpy.float32(rollout.reward)


def test_one_rollouts_bad_output_fails_it_alone_and_the_batch_is_written(tmp_path):
    """One group of 8, each rollout broken its own way: 5 fail naming why, 3 train (numbers coerced to float, a
    metric that is no number dropped), and the batch, its metrics and the state saved as JSON are written."""
    orch = orchestrator(tmp_path, env(BadOutput), NumpyRewards(), group_size=8, batch_size=8, inflight=8)

    async def one_group():
        orch._fill()
        assert len(orch._running) == 8
        await asyncio.gather(*orch._running)
        orch._collect()
        await asyncio.gather(*orch._scoring)  # the env's group scoring
        orch._collect()

    orch.paths.make()  # as `i3core run` does before the orchestrator starts
    asyncio.run(one_group())
    assert orch.ledger.failed == 5 and orch.ledger.masked == 0
    errors = [line["error"] for line in orch.rollout_log.pending if line["outcome"] == "failed"]
    assert errors == ["env 'reverse-text' returned NoneType, not a Rollout",
                      "env 'reverse-text' returned dict, not a Rollout",
                      "env 'reverse-text' returned a reward that is not a number: 'abc'",
                      "env 'reverse-text' returned a reward that is not a number: None",
                      "env 'reverse-text' returned token lists of different lengths (completion_ids 4, "
                      "completion_logprobs 3, completion_versions 4, completion_mask 4, completion_turns 4)"], errors
    [group] = orch._ready
    assert all(type(r.reward) is float and all(type(v) is float for v in r.metrics.values()) for r in group.rollouts)
    assert orch._cut_batch(1)  # packs, saves the state as JSON, writes the batch
    metrics = json.loads(orch.paths.orchestrator_state(1).read_text())["batch_metrics"]
    assert metrics["metrics/x"] == 2.0 and "metrics/label" not in metrics and "metrics/missing" not in metrics
    assert metrics["reward/min"] == 0.25 and orch.ledger.trained == 3
    assert orch.paths.batch(1).exists()


def test_rewards_beyond_float32_are_masked_like_nonfinite_ones():
    def rollout(reward, turn_rewards=()):
        return Rollout(Example("e", "p"), [1], [2], [-0.5], [0], [True], reward=reward, turn_rewards=list(turn_rewards))

    assert _untrainable(rollout(1e200)) == _untrainable(rollout(-1e308)) == NONFINITE_REWARD
    assert _untrainable(rollout(1.0, [1e200, -1e200])) == NONFINITE_REWARD
    assert _untrainable(rollout(1e30)) is None and math.isfinite(numpy.float32(1e30))


def test_the_jsonl_sink_writes_numpy_and_torch_numbers(tmp_path):
    sink = make_component("metric_sink", "jsonl", plugins=plugin_manager(installed=False))
    sink.open(tmp_path)
    sink.write(1, {"a": numpy.float32(0.5), "b": torch.tensor(2.0), "c": numpy.int64(3), "d": torch.tensor(math.nan),
                   "e": 4, "f": True})
    sink.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 1, "a": 0.5, "b": 2.0, "c": 3, "d": None, "e": 4, "f": True}
    assert type(row["c"]) is int


class TextRewards:
    """Reshapes one reward of each group into text, as a buggy ``i3_on_group_scored`` plugin may."""

    @hookimpl
    def i3_on_group_scored(self, group):
        group.rollouts[0].reward = "abc"


def test_a_rollout_a_plugin_breaks_after_group_scoring_fails_alone(tmp_path):
    """Checked again once plugins had their say on the group: the broken rollout fails naming when, the others
    train."""
    orch = orchestrator(tmp_path, env(ReverseText), TextRewards(), group_size=4, batch_size=4, inflight=4)

    async def one_group():
        orch._fill()
        await asyncio.gather(*orch._running)
        orch._collect()
        await asyncio.gather(*orch._scoring)
        orch._collect()

    asyncio.run(one_group())
    assert orch.ledger.failed == 1 and orch.ledger.masked == 0
    errors = [line["error"] for line in orch.rollout_log.pending if line["outcome"] == "failed"]
    assert errors == ["after group scoring: a reward that is not a number: 'abc'"], errors
    [group] = orch._ready
    assert len(group.rollouts) == 3 and orch._untrained_in_a_row == {}
