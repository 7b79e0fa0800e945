"""The built-in components, built through the registry as a run builds them."""

import asyncio
import json

import pytest
import torch

from i3core.testing import make_component
from i3core.types import Completion


def test_adamw_groups_and_steps(builtins):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = make_component("optimizer", "adamw", plugins=builtins, lr=0.1, weight_decay=0.5).build(
        model.named_parameters()
    )
    decay, no_decay = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])] and decay["weight_decay"] == 0.5
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    before = model[0].weight.detach().clone()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)


def test_adamw_refuses_no_parameters(builtins):
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_component("optimizer", "adamw", plugins=builtins).build([])


@pytest.mark.parametrize("name", ["arithmetic", "reverse-text"])
def test_envs_are_seeded_and_score_their_demonstrations(builtins, name):
    env = make_component("env", name, plugins=builtins, num_examples=50, seed=3)
    again = make_component("env", name, plugins=builtins, num_examples=50, seed=3)
    other = make_component("env", name, plugins=builtins, num_examples=50, seed=4)
    assert env.examples() == again.examples() and env.examples() != other.examples()
    for example in env.examples():
        assert env.score(env.demonstration(example), example) == 1.0
        assert 0.0 <= env.score("zzz", example) < 1.0


def test_reverse_text_similarity_is_partial(builtins):
    env = make_component("env", "reverse-text", plugins=builtins)
    example = env.examples()[0]
    half = example.answer[: len(example.answer) // 2]
    assert 0.0 < env.score(half, example) < 1.0


class EchoClient:
    """A real in-process client over a fixed answer; the env sees the same interface as a server's."""

    def __init__(self, text):
        self.text = text

    async def complete(self, prompt, *, max_tokens, temperature):
        ids = [ord(c) for c in self.text][:max_tokens]
        return Completion(self.text, [ord(c) for c in prompt], ids, [-0.5] * len(ids), [2] * len(ids))


def test_single_turn_rollout_carries_tokens_versions_and_reward(builtins):
    env = make_component("env", "arithmetic", plugins=builtins)
    example = env.examples()[0]
    rollout = asyncio.run(env.rollout(EchoClient(example.answer + "\n"), example))
    assert rollout.reward == 1.0 and rollout.completion_versions == [2] * len(rollout.completion_ids)
    assert all(rollout.completion_mask) and rollout.prompt_ids == [ord(c) for c in example.prompt]


def test_jsonl_sink_writes_valid_json_for_nonfinite_values(builtins, tmp_path):
    sink = make_component("metric_sink", "jsonl", plugins=builtins)
    sink.open(tmp_path)
    sink.write(1, {"loss": float("nan"), "reward/mean": 0.5})
    sink.write(2, {"loss": 0.25})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": None, "reward/mean": 0.5}, {"step": 2, "loss": 0.25}]


def test_async_starts_a_group_only_within_max_sample_lag_versions_of_the_weights_that_train_it(builtins):
    """A new group joins the batch after the open ones (8 groups a batch here); the batch of step s trains version
    s - 1, and a group sampled now, on ``served`` weights, may be at most ``max_sample_lag`` versions behind it."""
    scheduler = make_component("scheduler", "async", plugins=builtins, group_size=8, batch_size=64, max_sample_lag=1)
    # step 5 trains version 4; the servers hold 4: this batch and the next may fill (16 groups)
    assert scheduler.may_start_group(5, 4, open_groups=15)
    assert not scheduler.may_start_group(5, 4, open_groups=16)
    # the servers are one version behind: only the batch of step 5 itself
    assert scheduler.may_start_group(5, 3, open_groups=7)
    assert not scheduler.may_start_group(5, 3, open_groups=8)
    # two behind (the trainer waits for them): nothing new until newer weights arrive
    assert not scheduler.may_start_group(5, 2, open_groups=0)
    lax = make_component("scheduler", "async", plugins=builtins, group_size=8, batch_size=64, max_sample_lag=3)
    assert lax.may_start_group(5, 2, open_groups=8)
    unbounded = make_component("scheduler", "async", plugins=builtins, group_size=8, batch_size=64)
    assert unbounded.may_start_group(5, 0, open_groups=1000)  # the default: a free slot always takes a group


def test_async_refuses_a_sample_lag_below_the_forced_update_lag(builtins):
    with pytest.raises(Exception, match="max_sample_lag .0. must be at least weight_update_lag .1."):
        make_component("scheduler", "async", plugins=builtins, group_size=8, batch_size=64, max_async=1,
                       weight_update_lag=1, max_sample_lag=0)
