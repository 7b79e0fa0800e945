"""EnvGroup (routing, mixing, adaptive weights, nested config), turn-level credit and per-task batch metrics."""

import asyncio
import collections
import random

import pytest

from i3core.config import validate
from i3core.errors import ConfigError
from i3core.loop.orchestrator import _batch_metrics
from i3core.loop.packing import assign_advantages, pack, sample_from_rollout
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import ScriptedClient, make_component
from i3core.types import Example, Rollout

END = "<|im_end|>"


def group(**options):
    members = [{"use": "reverse-text", "num_examples": 30, "max_len": 5},
               {"use": "tool-calc", "name": "calc", "num_examples": 20, "max_tokens": 100, "max_total_tokens": 600}]
    return make_component("env", "group", members=members, **options)


def test_group_concatenates_member_datasets_with_task_ids():
    env = group()
    tasks = collections.Counter(e.task for e in env.examples())
    assert tasks == {"reverse-text": 30, "calc": 20}
    assert env.member(env.examples()[0]) is env.members["reverse-text"]
    with pytest.raises(ValueError, match="not a member"):
        env.member(Example("x", "p", task="other"))


def test_group_routes_rollouts_and_scoring_to_the_member():
    tok = build_tokenizer()
    env = group()
    text = next(e for e in env.examples() if e.task == "reverse-text")
    calc = next(e for e in env.examples() if e.task == "calc")
    reverse = asyncio.run(env.rollout(ScriptedClient(tok, [text.answer + "\n"]), text))
    solved = asyncio.run(env.rollout(ScriptedClient(tok, [f"Answer: {calc.answer}{END}"]), calc))
    assert reverse.reward == 1.0 and reverse.example.task == "reverse-text"
    assert reverse.state["completion"] == text.answer + "\n"
    assert solved.reward == 1.0 and solved.example.task == "calc" and "used_calculator" in solved.metrics


def test_fixed_mixing_follows_weights_whatever_the_dataset_sizes():
    env = make_component("env", "group", members=[{"use": "reverse-text", "num_examples": 500, "weight": 1.0},
                                                  {"use": "arithmetic", "num_examples": 10, "weight": 3.0}])
    stream = env.example_stream(random.Random(0))
    counts = collections.Counter(next(stream).task for _ in range(4000))
    assert 0.72 < counts["arithmetic"] / 4000 < 0.78
    assert env.metrics()["env/arithmetic/mix_weight"] == pytest.approx(0.75)


def scored(env, task, rewards):
    example = next(e for e in env.examples() if e.task == task)
    rollouts = [Rollout(example, [1], [2], [-0.1], [0], [True], reward=r) for r in rewards]
    asyncio.run(env.score_group(rollouts))


def test_adaptive_mixing_follows_the_share_of_groups_with_learning_signal():
    env = group(mixing="adaptive", adaptive_window=4, adaptive_floor=0.1)
    assert env.weights() == {"reverse-text": 0.5, "calc": 0.5}  # no groups yet: share 1 each
    for _ in range(4):
        scored(env, "calc", [0.0, 0.0, 0.0])  # all equal: zero advantage
        scored(env, "reverse-text", [0.2, 1.0, 0.4])
    metrics = env.metrics()
    assert metrics["env/calc/nonzero_adv_share"] == 0.0 and metrics["env/reverse-text/nonzero_adv_share"] == 1.0
    assert metrics["env/calc/mix_weight"] == pytest.approx(0.1 / 1.1)  # floored, still sampled
    stream = env.example_stream(random.Random(1))
    counts = collections.Counter(next(stream).task for _ in range(2000))
    assert 0.05 < counts["calc"] / 2000 < 0.13
    scored(env, "calc", [1.0, 0.0, 0.0])  # the window moves: one of the last 4 had signal
    assert env.nonzero_share("calc") == 0.25
    fixed = group()
    scored(fixed, "calc", [0.0, 0.0])
    assert fixed.weights() == {"reverse-text": 0.5, "calc": 0.5}


def test_group_config_from_toml_validates_members_with_their_paths(builtins):
    data = {"env": {"use": "group", "members": [{"use": "reverse-text", "max_len": 4},
                                                {"use": "tool-calc", "weight": 2.0, "max_turns": 3}]}}
    config = validate(data, builtins)
    env = config.get("env").build()
    assert env.members["reverse-text"].config.max_len == 4 and env.members["tool-calc"].config.max_turns == 3
    assert config.to_dict()["env"]["members"][1] == {"use": "tool-calc", "name": None, "weight": 2.0, "max_turns": 3}
    bad = {"env": {"use": "group", "members": [{"use": "reverse-txt"}, {"use": "tool-calc", "max_turn": 3},
                                               {"use": "arithmetic"}, {"use": "arithmetic"}]}}
    with pytest.raises(ConfigError) as error:
        validate(bad, builtins)
    assert "repeated: arithmetic" in str(error.value)
    bad["env"]["members"] = bad["env"]["members"][:2]
    with pytest.raises(ConfigError) as error:
        validate(bad, builtins)
    paths = [p.path for p in error.value.problems]
    assert paths == ["env.members[0].use", "env.members[1].max_turn"]
    assert "did you mean 'reverse-text'" in str(error.value) and "did you mean 'max_turns'" in str(error.value)


# -- credit assignment ---------------------------------------------------------------


def turn_rollout(turn_rewards, turns, credit="turn"):
    n = len(turns)
    return Rollout(Example("e", "p"), [1, 2], list(range(n)), [-0.1] * n, [0] * n, [True] * n,
                   reward=sum(turn_rewards), turn_rewards=turn_rewards, completion_turns=turns, credit=credit)


def test_episode_credit_gives_every_token_the_rollout_advantage():
    rollouts = [turn_rollout([0.0, 1.0], [0, 0, 1], credit="episode"), turn_rollout([0.0, 0.0], [0, 1, 1], "episode")]
    assign_advantages(rollouts)
    assert [r.advantage for r in rollouts] == [0.5, -0.5]
    assert all(r.completion_advantages is None for r in rollouts)
    batch = pack([sample_from_rollout(r) for r in rollouts], seq_len=16)
    assert batch.advantages[batch.sequence_ids == 0].tolist() == [0.5] * 5


def test_turn_credit_gives_each_turn_its_return_minus_the_group_baseline():
    # returns G_t = sum of rewards from turn t on; baseline: the mean G_t of the rollouts that reached turn t
    a = turn_rollout([-0.1, -0.1, 1.0], [0, 0, 1, 2])  # G = [0.8, 0.9, 1.0]
    b = turn_rollout([0.0, 0.0], [0, 1, 1])  # G = [0.0, 0.0]
    c = turn_rollout([0.4], [0, 0])  # G = [0.4]
    assign_advantages([a, b, c])
    assert a.completion_advantages == pytest.approx([0.4, 0.4, 0.45, 0.0])
    assert b.completion_advantages == pytest.approx([-0.4, -0.45, -0.45])
    assert c.completion_advantages == pytest.approx([0.0, 0.0])
    assert a.advantage == pytest.approx(0.8 - 0.4)  # the episode advantage is still set
    sample = sample_from_rollout(a)
    batch = pack([sample], seq_len=8)
    assert batch.advantages[0, :6].tolist() == pytest.approx([0.0, 0.0, 0.4, 0.4, 0.45, 0.0])


def test_turn_credit_comes_from_the_env_config():
    tok = build_tokenizer()
    env = make_component("env", "tool-calc", num_examples=2, credit="turn", max_tokens=100, max_total_tokens=600)
    example = env.examples()[0]
    rollout = asyncio.run(env.rollout(ScriptedClient(tok, [f"Answer: {example.answer}{END}"]), example))
    assert rollout.credit == "turn" and rollout.turn_rewards == [1.0]


def test_batch_metrics_are_split_per_task_and_exclude_env_token_versions():
    def rollout(task, reward, versions, mask):
        return Rollout(Example("e", "p", task=task), [1], [5] * len(mask), [0.0] * len(mask), versions, mask,
                       reward=reward, metrics={"turns": 2.0 if task == "calc" else 1.0})

    rollouts = [rollout("calc", 1.0, [3, -1, 4], [True, False, True]), rollout("calc", 0.0, [4], [True]),
                rollout("reverse", 0.5, [4, 4], [True, True])]
    metrics = _batch_metrics(rollouts, trained_version=4)
    assert metrics["env/calc/reward/mean"] == 0.5 and metrics["env/reverse/reward/mean"] == 0.5
    assert metrics["env/calc/share"] == pytest.approx(2 / 3) and metrics["env/calc/metrics/turns"] == 2.0
    assert metrics["metrics/turns"] == pytest.approx(5 / 3)
    assert metrics["off_policy/max_steps"] == 1  # version -1 of the env token is no policy version
    assert metrics["off_policy/tokens_at_0"] == 4 and metrics["off_policy/tokens_at_1"] == 1


def test_orchestrator_scores_groups_through_the_env_and_counts_a_failed_scoring(tmp_path, builtins):
    from i3core.config import RunConfig, RunSection
    from i3core.loop.orchestrator import OpenGroup, Orchestrator

    def rank(completions):
        return [float(len(c)) for c in completions]

    async def broken_scoring(rollouts):
        raise RuntimeError("the group scorer is down")

    env = make_component("env", "group", plugins=builtins, members=[{"use": "arithmetic"}])
    env.members["arithmetic"].rubric.add_group_reward_func(rank)
    config = RunConfig(run=RunSection(output_dir=tmp_path, max_steps=1))
    orchestrator = Orchestrator(config, builtins, env, None, None, [], [])
    example = env.examples()[0]
    tok = build_tokenizer()

    async def scored_group(failing: bool):
        rollouts = [await env.rollout(ScriptedClient(tok, [reply]), example) for reply in ("1\n", "22\n")]
        if failing:
            env.members["arithmetic"].score_group = broken_scoring
        group = OpenGroup(example, slot=None, outstanding=0, position=0, rollouts=rollouts)
        orchestrator._open.add(group)
        orchestrator._score_group(group)
        assert orchestrator._in_flight() == 2  # scoring: still in flight
        await asyncio.gather(*orchestrator._scoring, return_exceptions=True)
        orchestrator._collect()
        return rollouts

    rollouts = asyncio.run(scored_group(failing=False))
    assert [r.metrics["rank"] for r in rollouts] == [2.0, 3.0]  # the group function saw both completions
    assert orchestrator._ready and orchestrator._ready[0].rollouts == rollouts and not orchestrator._open
    assert env.nonzero_share("arithmetic") == 1.0
    orchestrator._ready.clear()
    asyncio.run(scored_group(failing=True))
    assert orchestrator.ledger.failed == 2 and not orchestrator._ready and orchestrator._in_flight() == 0


def test_a_run_refuses_rollouts_longer_than_the_servers_or_the_trainer_hold(builtins):
    from i3core.config import validate
    from i3core.errors import I3Error
    from i3core.loop.run import _check_rollout_length

    def check(env_options, max_len, seq_len):
        config = validate({"env": env_options, "inference": {"use": "builtin", "max_len": max_len},
                           "trainer": {"seq_len": seq_len}}, builtins)
        _check_rollout_length(config.get("env").build(), config, config.get("inference").build())

    group = {"use": "group", "members": [{"use": "reverse-text"}, {"use": "tool-calc", "max_total_tokens": 400}]}
    check(group, 400, 512)
    with pytest.raises(I3Error, match="max_len is 320"):
        check(group, 320, 512)
    with pytest.raises(I3Error, match="trainer.seq_len is 256"):
        check({"use": "tool-calc", "max_total_tokens": 300}, 512, 256)
    check({"use": "reverse-text"}, 64, 64)  # unbounded single-turn envs are not checked


def test_turn_returns_follow_a_reshaped_reward():
    """An i3_on_group_scored plugin changes ``reward`` only: the difference counts on the last turn."""
    from i3core.loop.packing import turn_returns

    rollout = turn_rollout([0.5, 0.5], [0, 1])
    assert turn_returns(rollout) == pytest.approx([1.0, 0.5])
    rollout.reward = 2.0  # reshaped after the env scored it
    assert turn_returns(rollout) == pytest.approx([2.0, 1.5])
