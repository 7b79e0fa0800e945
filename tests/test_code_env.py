"""The ``code`` env: its dataset and test harness (run here on trusted reference programs), and
SandboxEnv/CodeEnv rollouts in real ``local`` sandboxes (skipped where that backend is not installed)."""

import asyncio
import json
import subprocess
import sys

import pytest

from i3core.errors import I3Error
from i3core.plugins.envs.code import HARNESS, MARK, extract_program, parse_results
from i3core.plugins.envs.code_problems import PROBLEMS
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.sandbox.pool import SandboxPool
from i3core.testing import ScriptedClient, make_component
from tests.sandbox_backends import backend_for

END = "<|im_end|>"


def harness_on_host(tmp_path, program: str, tests: list[str], timeout: float = 60) -> tuple[list[bool], str | None]:
    """The harness run by this machine's python on a trusted program (the dataset's own checks)."""
    (tmp_path / "solution.py").write_text(program)
    (tmp_path / "tests.json").write_text(json.dumps(tests))
    (tmp_path / "nonce").write_text("n0nce")
    (tmp_path / "harness.py").write_text(HARNESS)
    try:
        out = subprocess.run([sys.executable, "harness.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=timeout).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return parse_results(out, "n0nce", len(tests))


def test_dataset_has_50_problems_whose_reference_solutions_pass_their_tests(tmp_path):
    assert len(PROBLEMS) >= 50 and len({p.name for p in PROBLEMS}) == len(PROBLEMS)
    assert all(len(p.tests) >= 2 for p in PROBLEMS)
    program = "".join(p.solution + "\n" for p in PROBLEMS)
    tests = [t for p in PROBLEMS for t in p.tests]
    passed, error = harness_on_host(tmp_path, program, tests)
    assert error is None and all(passed), [t for t, ok in zip(tests, passed) if not ok]


def test_harness_scores_partial_programs_and_ignores_forged_lines(tmp_path):
    tests = ["f(1) == 2", "f(2) == 4", "f(3) == 6"]
    assert harness_on_host(tmp_path, "def f(x):\n    return 2 if x == 1 else 4\n", tests)[0] == [True, True, False]
    passed, error = harness_on_host(tmp_path, "def f(x):\n    return 1 / 0\n", tests)
    assert passed == [False] * 3 and error is None
    passed, error = harness_on_host(tmp_path, "def f(x) return x\n", tests)
    assert passed == [False] * 3 and error.startswith("SyntaxError")
    forged = (f"import os\nfor i in range(3):\n    print('{MARK} ' + os.environ.get('NONCE', 'guess') + f' {{i}} 1')\n"
              "print(open('nonce').read() if os.path.exists('nonce') else 'gone')\ndef f(x):\n    return 0\n")
    assert harness_on_host(tmp_path, forged, tests)[0] == [False] * 3
    hangs = "def f(x):\n    if x == 3:\n        while True:\n            pass\n    return 2 * x\n"
    assert harness_on_host(tmp_path, hangs, tests, timeout=8)[0] == [True, True, False]


def test_extract_program_takes_the_last_code_block():
    assert extract_program("try:\n```python\nx = 1\n```\nbetter:\n```\nx = 2\n```") == "x = 2\n"
    assert extract_program("<think>```python\nbad\n```</think>def f(): pass") == "def f(): pass\n"
    assert extract_program("```python\ndef f():\n    return 1") == "def f():\n    return 1\n"  # cut at max_tokens


def test_code_env_needs_a_sandbox(builtins):
    env = make_component("env", "code", plugins=builtins)
    assert env.requires_sandbox and len(env.examples()) == len(PROBLEMS)
    example = env.examples()[0]
    assert env.demonstration(example).startswith("```python\ndef ")
    with pytest.raises(I3Error, match="no sandbox pool"):
        asyncio.run(env.rollout(ScriptedClient(build_tokenizer(), ["x" + END]), example))


# -- in real sandboxes ------------------------------------------------------------


def code_rollouts(tmp_path, replies_for, **options):
    """One rollout per (example, reply) through a pool of local sandboxes; the rollouts and the pool's stats."""
    async def go():
        pool = SandboxPool(backend_for("local", tmp_path), max_concurrent=4)
        await pool.start()
        env = make_component("env", "code", **options)
        env.bind_sandboxes(pool)
        tok = build_tokenizer()
        try:
            return await asyncio.gather(*(env.rollout(ScriptedClient(tok, [reply(example)]), example)
                                          for example in env.examples()[:4] for reply in replies_for)), pool.stats
        finally:
            await pool.close()

    return asyncio.run(go())


def test_code_env_reward_is_the_pass_rate_in_a_sandbox(tmp_path):
    right = lambda e: f"```python\n{e.info['solution']}```{END}"  # noqa: E731
    wrong = lambda e: f"```python\ndef {e.info['name']}(*args):\n    return None\n```{END}"  # noqa: E731
    broken = lambda e: f"def {e.info['name']}(:{END}"  # noqa: E731
    rollouts, stats = code_rollouts(tmp_path, [right, wrong, broken], max_tokens=300, max_total_tokens=500)
    for good, bad, crash in zip(rollouts[0::3], rollouts[1::3], rollouts[2::3]):
        assert good.reward == 1.0 and good.metrics["compiled"] == 1.0
        assert 0.0 <= bad.reward < 1.0 and bad.metrics["compiled"] == 1.0
        assert crash.reward == 0.0 and crash.metrics["compiled"] == 0.0
    assert stats["leased"] == 0  # every lease handed back


def test_code_env_a_hanging_program_times_out_and_keeps_earlier_passes(tmp_path):
    def hangs(example):
        return f"```python\nwhile True:\n    pass\n```{END}"

    rollouts, _ = code_rollouts(tmp_path, [hangs], test_timeout_s=1.0, max_tokens=300, max_total_tokens=500)
    assert all(r.reward == 0.0 and r.metrics["tests_timed_out"] == 1.0 for r in rollouts)


def test_sandbox_env_shell_tool_runs_in_the_rollouts_own_sandbox(tmp_path):
    def shell_then_answer(example):
        call = {"name": "shell", "arguments": {"command": "echo hi > note && cat note && pwd"}}
        return f"<tool_call>{json.dumps(call)}</tool_call>{END}"

    async def go():
        pool = SandboxPool(backend_for("local", tmp_path))
        await pool.start()
        env = make_component("env", "code", shell_tool=True, max_turns=2, max_tokens=300, max_total_tokens=900)
        env.bind_sandboxes(pool)
        example = env.examples()[0]
        replies = [shell_then_answer(example), f"```python\n{example.info['solution']}```{END}"]
        client = ScriptedClient(build_tokenizer(), replies)
        try:
            return await env.rollout(client, example)
        finally:
            await pool.close()

    rollout = asyncio.run(go())
    tool = [m for m in rollout.state["completion"] if m["role"] == "tool"][0]["content"]
    assert tool.startswith("exit code 0") and "hi" in tool and rollout.reward == 1.0
    schema = [t["function"] for t in make_component("env", "code", shell_tool=True).tool_specs()]
    assert list(schema[0]["parameters"]["properties"]) == ["command"]  # sandbox_id is hidden


def test_sft_pairs_of_a_chat_env_are_its_rendered_prompt_and_one_assistant_turn(builtins):
    tok = build_tokenizer()
    env = make_component("env", "code", plugins=builtins)
    example = env.examples()[0]
    prompt, answer = env.sft_ids(example, tok)
    text = tok.decode(prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nWrite the Python function") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(answer, skip_special_tokens=False) == env.demonstration(example) + END
    group = make_component("env", "group", plugins=builtins, members=[{"use": "code"}, {"use": "tool-calc"}])
    tagged = group.examples()[0]
    assert group.sft_ids(tagged, tok) == (prompt, answer) or tagged.id != example.id
    assert group.sft_ids(next(e for e in group.examples() if e.task == "tool-calc"), tok) is None
