"""``[env] use = "reasoning-gym"``: reasoning-gym's generators as an env group, their scorers as rewards."""

import asyncio

import pytest

from i3core.errors import ConfigError
from i3core.plugins.envs.reasoning_gym_env import ANSWER_INSTRUCTION, extract_answer
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer, token_id
from i3core.testing import ScriptedClient, make_component

from .conftest import ROOT, assert_ledger, quickstart_run, run_cli

TWO = {"datasets": ["spell_backward", "letter_counting"], "size": 50}


def test_rows_are_tagged_with_their_dataset_and_demonstrate_the_reference_answer(builtins):
    env = make_component("env", "reasoning-gym", plugins=builtins, **TWO)
    rows = env.examples()
    assert len(rows) == 100 and {r.task for r in rows} == {"spell_backward", "letter_counting"}
    first = rows[0]
    assert first.prompt.endswith(f"\n{ANSWER_INSTRUCTION}\n") and env.stop_text == "</answer>"
    assert env.demonstration(first) == f"<answer>{first.answer}</answer>"
    assert env.member(first).score(f"I think so.\n<answer> {first.answer} </answer>", first) == 1.0
    assert env.member(first).score(f"<answer>{first.answer}", first) == 1.0  # a server that cut the stop text
    assert env.member(first).score(first.answer, first) == 0.0  # no answer tag: no answer


MATRIX = {"datasets": ["rotate_matrix"], "size": 20, "args": {"rotate_matrix": {"min_n": 2, "max_n": 3}}}


def scripted_rollouts(env, example, replies):
    """``env``'s rollouts of ``example`` on a scripted model writing ``replies`` (byte tokens; it stops at the
    end-of-text token only, so the env's own scoring meets the stop text in the completion)."""
    client = ScriptedClient(build_tokenizer(), replies, stop_token_ids=[token_id("<|endoftext|>")])
    return [asyncio.run(env.rollout(client, example)) for _ in replies]


def test_a_multi_line_answer_written_by_the_model_gets_reward_one(builtins):
    """rotate_matrix answers span lines: the completion stops at </answer>, not at the first newline, and the
    whole matrix is scored; a partial matrix is not."""
    env = make_component("env", "reasoning-gym", plugins=builtins, **MATRIX, max_tokens=64)
    example = env.examples()[0]
    lines = example.answer.splitlines()
    assert len(lines) >= 2
    right, first_line, tail = scripted_rollouts(env, example, [
        f"<answer>\n{example.answer}\n</answer><|endoftext|>", f"<answer>{lines[0]}</answer>",
        f"Rotated:\n<answer>{example.answer}</answer> and more text after it"])
    assert right.reward == 1.0 and first_line.reward < 1.0 and tail.reward == 1.0
    assert right.metrics["rubric_error/reward"] == 0.0


def test_line_format_refuses_a_multi_line_dataset_when_the_config_is_read(builtins):
    """The probe scores the reference answer as a rollout's completion is scored: a multi-line answer can never
    reach 1 with one-line answers, and the config says so."""
    with pytest.raises(ConfigError) as error:
        make_component("env", "reasoning-gym", plugins=builtins, **MATRIX, answer_format="line")
    assert "gives the reference answer of row 0 less than 1 (it spans lines" in str(error.value)
    env = make_component("env", "reasoning-gym", plugins=builtins, datasets=["spell_backward"], size=5,
                         answer_format="line", answer_marker="Answer:")
    example = env.examples()[0]
    assert env.stop_text == "\n" and env.demonstration(example) == f"Answer: {example.answer}\n"
    (right, wrong) = scripted_rollouts(env, example, [f"Answer: {example.answer}\n", "Answer: zzz\n"])
    assert right.reward == 1.0 and wrong.reward < 1.0


def test_answers_are_read_after_the_marker_or_from_the_last_line():
    assert extract_answer("thinking...\nAnswer: 42 ", "Answer:") == "42"
    assert extract_answer("no marker here", "Answer:") == ""
    assert extract_answer("step one\n\nstep two\n 7 \n", None) == "7"


def test_a_scorer_that_raises_scores_zero_and_counts_a_rubric_error(builtins):
    env = make_component("env", "reasoning-gym", plugins=builtins, datasets=["prime_factorization"], size=5)
    example = env.examples()[0]
    tokenizer = build_tokenizer()
    client = ScriptedClient(tokenizer, ["<answer>not a number</answer>", f"<answer>{example.answer}</answer>"],
                            stop_token_ids=[token_id("<|endoftext|>")])
    wrong, right = (asyncio.run(env.rollout(client, example)) for _ in range(2))
    assert wrong.reward == 0.0 and wrong.metrics["rubric_error/reward"] == 1.0  # prime_factorization raised
    assert right.reward == 1.0 and right.metrics["rubric_error/reward"] == 0.0


@pytest.mark.parametrize("options, words", [
    ({"datasets": ["spell_backwrd"]}, "unknown reasoning-gym dataset 'spell_backwrd' (did you mean 'spell_backward'?)"),
    ({"datasets": ["game_of_life_halting"]}, "its scorer gives a wrong answer 1.0"),
    ({"datasets": ["rush_hour"]}, "no reference answer"),
    ({"datasets": ["composite"]}, "list them in `datasets`"),
    ({"datasets": ["spell_backward"], "weights": [1.0, 2.0]}, "one positive number per dataset"),
    ({"datasets": ["spell_backward"], "args": {"spell_backward": {"max_len": 4}}}, "unexpected keyword argument"),
    ({"datasets": ["spell_backward"], "args": {"letter_counting": {}}}, "args name datasets not in `datasets`"),
    ({"datasets": ["spell_backward"], "answer_marker": "Answer:"}, 'set answer_format = "line" with it'),
])
def test_unusable_datasets_and_bad_options_are_refused_when_the_config_is_read(builtins, options, words):
    with pytest.raises(ConfigError) as error:
        make_component("env", "reasoning-gym", plugins=builtins, **options)
    assert words in str(error.value)


def test_check_says_each_bad_dataset_in_one_line(tmp_path):
    config = (ROOT / "examples" / "reasoning_gym.toml").read_text()
    config = config.replace('datasets = ["spell_backward", "letter_counting"]',
                            'datasets = ["spell_backward", "letter_countin", "boxnet"]')
    config = config.replace("weights = [3.0, 1.0]", "weights = [3.0, 1.0, 1.0]")
    path = tmp_path / "bad.toml"
    path.write_text(config)
    result = run_cli("check", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean 'letter_counting'" in result.stderr and "'boxnet' cannot serve as a reward" in result.stderr


@pytest.mark.slow
def test_quickstart_with_only_its_env_changed_trains_on_reasoning_gym(tmp_path):
    quickstart = (ROOT / "examples" / "quickstart.toml").read_text()
    env = quickstart[quickstart.index("[env]"):quickstart.index("[sft]")]
    # rotate_matrix's question is ~500 bytes (tiny-moe's tokens): rows and the engine's context grow to fit it
    proc, out, rows = quickstart_run(tmp_path, "run.max_steps=3", "sft.steps=3", "trainer.seq_len=768",
                                     "inference.max_len=768", replace={
        env: '[env]\nuse = "reasoning-gym"\ndatasets = ["spell_backward", "letter_counting", "rotate_matrix"]\n'
             'max_tokens = 48\nargs = { rotate_matrix = { min_n = 2, max_n = 2 } }\n\n'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_ledger(rows)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    tasks = {k.split("/")[1] for r in rows for k in r if k.startswith("env/") and k.endswith("/reward/mean")}
    assert tasks <= {"spell_backward", "letter_counting", "rotate_matrix"} and tasks
    diffs = [r["mismatch/same_version_abs_diff"] for r in rows if r.get("mismatch/same_version_abs_diff") is not None]
    assert diffs and max(diffs) < 1e-4  # trainer and server agree on the same weights and tokens
