"""Bad input: the broken configs of tests/bad_configs/ through the real CLI, and non-finite numbers in rollouts.

Each file's ``# expect:`` comments name its problems in order; ``i3core check``
and ``i3core run`` must print exactly one ``error:`` line per problem (each
containing its expectation) and a one-line count, exit 2, show no traceback
and write nothing.
"""

import math
from pathlib import Path

import pytest
import torch

from i3core import hookimpl

from .conftest import LEDGER, ROOT, run_cli


BAD_CONFIGS = sorted((Path(__file__).parent / "bad_configs").glob("*.toml"))


def expectations(path: Path) -> list[str]:
    return [line.removeprefix("# expect:").strip() for line in path.read_text(errors="replace").splitlines()
            if line.startswith("# expect:")]


def test_the_corpus_covers_every_kind_of_problem():
    names = {p.stem for p in BAD_CONFIGS}
    assert {"wrong_types", "unknown_keys", "unknown_components", "missing_use", "toml_syntax", "unknown_sections",
            "batch_not_divisible", "keep_not_above_lag", "broadcast_with_lag", "max_tokens_over_max_len"} <= names
    assert all(expectations(p) for p in BAD_CONFIGS)


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("path", BAD_CONFIGS, ids=lambda p: p.stem)
def test_bad_config_is_exit_2_with_one_line_per_problem(tmp_path, path, command):
    result = run_cli(command, str(path), cwd=tmp_path)
    expected = expectations(path)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == len(expected), "\n".join(lines)
    for line, expect in zip(errors, expected):
        assert expect in line, f"{expect!r} not in {line!r}"
    plural = "s" if len(expected) != 1 else ""
    assert lines == [*errors, f"{len(expected)} problem{plural} in {path}"]
    assert list(tmp_path.iterdir()) == []  # no run directory, no logs


class Poison:
    """A plugin that corrupts two rollouts of every group before the orchestrator packs them:
    one gets a NaN reward (as a broken rubric or reshaping plugin would give), one a NaN
    logprob on its first model token (as a broken inference server would send)."""

    def __init__(self):
        self.nan_rewards = self.nan_logprobs = 0
        self.batches = []
        self.steps = []

    @hookimpl
    def i3_on_group_scored(self, group):
        if len(group.rollouts) >= 2:
            group.rollouts[0].reward = float("nan")
            group.rollouts[1].completion_logprobs[0] = float("-inf" if self.nan_logprobs % 2 else "nan")
            self.nan_rewards += 1
            self.nan_logprobs += 1

    @hookimpl
    def i3_on_batch(self, batch, step):
        self.batches.append(batch)

    @hookimpl
    def i3_on_step_end(self, step, metrics):
        self.steps.append((dict(metrics), self.nan_rewards, self.nan_logprobs))


@pytest.mark.slow
def test_nonfinite_rewards_and_logprobs_are_masked_counted_and_never_trained_on(tmp_path):
    """The real stack (torchrun trainer, the orchestrator in this process with the quickstart's engine)."""
    from i3core.loop import run
    from i3core.config import load_config
    from i3core.testing import plugin_manager

    poison = Poison()
    plugins = plugin_manager(poison)
    config, _ = load_config(ROOT / "examples" / "quickstart.toml", [f"run.output_dir='{tmp_path / 'run'}'",
                            "run.max_steps=3", "sft.steps=0"], plugins=plugins)  # fmt: skip
    assert run.execute(config, plugins) == 0
    assert poison.batches and len(poison.steps) == 3
    for batch in poison.batches:  # what the trainer got: every number finite
        assert torch.isfinite(batch.advantages).all() and torch.isfinite(batch.inference_logprobs).all()
        assert batch.num_samples == 8 * 6  # 8 groups of 8, 2 masked in each
    for metrics, nan_rewards, nan_logprobs in poison.steps:
        assert metrics["rollouts/masked/nonfinite_reward"] == nan_rewards > 0
        assert metrics["rollouts/masked/nonfinite_logprob"] == nan_logprobs > 0
        assert metrics["rollouts/masked"] == nan_rewards + nan_logprobs
        assert metrics["rollouts/started"] == sum(metrics[k] for k in LEDGER)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["reward/mean"])


def test_untrainable_rollouts_are_named():
    """What the orchestrator masks before packing, by reason: no model token, a non-finite reward or logprob."""
    from i3core.loop.orchestrator import NO_MODEL_TOKENS, NONFINITE_LOGPROB, NONFINITE_REWARD, _untrainable
    from i3core.types import Example, Rollout

    def rollout(mask, logprobs=None, reward=1.0):
        logprobs = logprobs or [-0.5] * len(mask)
        return Rollout(Example("e", "p"), [1], list(range(len(mask))), logprobs, [3] * len(mask), mask, reward=reward)

    assert _untrainable(rollout([True, False])) is None
    assert _untrainable(rollout([False, False])) == NO_MODEL_TOKENS  # only env tokens: nothing the model sampled
    assert _untrainable(rollout([])) == NO_MODEL_TOKENS
    assert _untrainable(rollout([True], reward=float("nan"))) == NONFINITE_REWARD
    assert _untrainable(rollout([True, False], [float("-inf"), 0.0])) == NONFINITE_LOGPROB
    assert _untrainable(rollout([False, True], [float("nan"), -1.0])) is None  # an env token's logprob is unused
