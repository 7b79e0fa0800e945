"""The environment hierarchy at hook level: a scripted client stands in for the server, no model runs.

Every class gets its own test: Rubric, SingleTurnEnv, MultiTurnEnv (stop
conditions, timeouts, token accounting), ToolEnv, StatefulToolEnv.
"""

import asyncio
import json
import time

import pytest
from transformers import PreTrainedTokenizerFast

from i3core.errors import RolloutMasked
from i3core.plugins.envs import MultiTurnConfig, MultiTurnEnv, Rubric, StatefulToolEnv, ToolConfig, ToolEnv, tool_schema
from i3core.plugins.envs.base import ENV_TOKEN_VERSION
from i3core.plugins.envs.chat import ChatML, HFChatTemplate
from i3core.plugins.envs.tool_calc import calculate
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import ScriptedClient, make_component
from i3core.types import Example

END = "<|im_end|>"


@pytest.fixture
def tok():
    return build_tokenizer()


def run(coro):
    return asyncio.run(coro)


# -- Rubric --------------------------------------------------------------------


def state_for(completion, answer="42", task="t"):
    example = Example("e0", [{"role": "user", "content": "q"}], answer=answer, info={"k": 1}, task=task)
    return {"example": example, "prompt": example.prompt, "completion": completion, "metrics": {}}


def test_rubric_matches_arguments_by_name_and_weights():
    seen = {}

    def exact(completion, answer):
        return float(completion == answer)

    async def length(state, info, task):
        seen.update(info=info, task=task, has_state="example" in state)
        return len(state["completion"])

    def everything(**kwargs):
        seen["all"] = sorted(kwargs)
        return 0.5

    rubric = Rubric([exact, length], weights=[2.0, 0.1])
    rubric.add_metric(everything)
    score = run(rubric.score_rollout(state_for("42")))
    assert score.reward == pytest.approx(2.0 + 0.2)  # the metric has weight 0
    assert score.metrics["exact"] == 1.0 and score.metrics["length"] == 2.0 and score.metrics["everything"] == 0.5
    assert seen["info"] == {"k": 1} and seen["task"] == "t" and seen["has_state"]
    assert seen["all"] == ["answer", "completion", "example", "info", "prompt", "state", "task"]


def test_rubric_scores_async_functions_concurrently():
    async def slow_a(completion):
        await asyncio.sleep(0.3)
        return 1.0

    async def slow_b(completion):
        await asyncio.sleep(0.3)
        return 1.0

    start = time.perf_counter()
    score = run(Rubric([slow_a, slow_b]).score_rollout(state_for("x")))
    assert score.reward == 2.0 and time.perf_counter() - start < 0.55


def test_a_raising_reward_function_scores_zero_and_is_recorded():
    def broken(completion):
        raise RuntimeError("judge unavailable")

    def fine(completion):
        return 1.0

    def not_a_number(completion):
        return "yes"

    def exits(completion):  # in a task of its own, sys.exit() left the event loop and ended the run, exit 3
        raise SystemExit(3)

    score = run(Rubric([broken, fine, not_a_number, exits]).score_rollout(state_for("x")))
    assert score.reward == 1.0
    assert score.metrics["broken"] == 0.0 and score.metrics["rubric_error/broken"] == 1.0
    assert score.metrics["rubric_error/fine"] == 0.0 and score.metrics["rubric_error/not_a_number"] == 1.0
    assert score.metrics["rubric_error/exits"] == 1.0


def test_a_reward_function_asking_for_an_unknown_argument_is_an_error_metric():
    def wrong(completion, answr):
        return 1.0

    score = run(Rubric([wrong]).score_rollout(state_for("x")))
    assert score.reward == 0.0 and score.metrics["rubric_error/wrong"] == 1.0


def test_group_reward_functions_see_the_whole_group():
    def shortest_wins(completions):
        best = min(len(c) for c in completions)
        return [1.0 if len(c) == best else 0.0 for c in completions]

    def wrong_length(completions):
        return [1.0]

    rubric = Rubric()
    rubric.add_group_reward_func(shortest_wins, weight=0.5)
    rubric.add_group_reward_func(wrong_length)
    scores = run(rubric.score_group([state_for("aaa"), state_for("a"), state_for("aa")]))
    assert [s.reward for s in scores] == [0.0, 0.5, 0.0]
    assert all(s.metrics["rubric_error/wrong_length"] == 1.0 for s in scores)
    assert rubric.has_group_funcs and not Rubric([len]).has_group_funcs


def test_rubric_refuses_mismatched_weights_and_duplicate_names():
    with pytest.raises(ValueError, match="weights"):
        Rubric([len], weights=[1.0, 2.0])
    rubric = Rubric([len])
    with pytest.raises(ValueError, match="already"):
        rubric.add_metric(len)


# -- SingleTurnEnv ---------------------------------------------------------------


def test_single_turn_env_rollout_through_a_scripted_client(tok):
    env = make_component("env", "reverse-text", num_examples=4)
    example = env.examples()[0]
    client = ScriptedClient(tok, [example.answer + "\n"], version=3)
    rollout = run(env.rollout(client, example))
    assert rollout.reward == 1.0 and rollout.metrics["reward"] == 1.0
    assert rollout.prompt_ids == tok.encode(example.prompt).ids == client.requests[0].prompt_ids
    assert rollout.completion_ids == tok.encode(example.answer + "\n").ids
    assert all(rollout.completion_mask) and set(rollout.completion_versions) == {3}
    assert rollout.oldest_version == 3 and rollout.credit == "episode"


@pytest.mark.parametrize("truncated", ["score", "zero", "mask"])
def test_a_completion_cut_at_max_tokens_is_scored_zeroed_or_masked(tok, truncated):
    """reverse-text's ratio pays a run-on completion for the letters it holds; ``truncated`` says what a rollout
    that never ended is worth. One that stopped is scored the same way under every setting."""
    env = make_component("env", "reverse-text", num_examples=4, max_tokens=8, truncated=truncated)
    example = env.examples()[0]
    ended = run(env.rollout(ScriptedClient(tok, [example.answer + "\n"], stop=["\n"]), example))
    assert ended.finish_reason == "stop" and ended.reward == 1.0
    run_on = ScriptedClient(tok, [example.answer + "zzzzzzzzzz"], stop=["\n"])
    if truncated == "mask":
        with pytest.raises(RolloutMasked) as masked:
            run(env.rollout(run_on, example))
        assert masked.value.reason == "truncated" and "max_tokens (8)" in str(masked.value)
        return
    rollout = run(env.rollout(run_on, example))
    assert rollout.finish_reason == "length" and len(rollout.completion_ids) == 8
    assert rollout.metrics["reward"] > 0  # the rubric's own score is kept as a metric
    assert (rollout.reward == 0.0) == (truncated == "zero")


def test_truncated_zero_also_zeroes_turn_rewards_and_group_rewards(tok):
    env = guess_env(max_tokens=3, truncated="zero")
    rollout = run(env.rollout(ScriptedClient(tok, ["7" + END, "12345"]), env.examples()[5]))
    assert rollout.finish_reason == "length"
    assert rollout.reward == 0.0 and rollout.turn_rewards == [0.0, 0.0]

    def nothing(completion):
        return 0.0

    def half_each(completions):
        return [0.5] * len(completions)

    group_env = make_component("env", "reverse-text", num_examples=4, max_tokens=4, truncated="zero")
    group_env.rubric = Rubric([nothing])
    group_env.rubric.add_group_reward_func(half_each)
    example = group_env.examples()[0]
    rollouts = [run(group_env.rollout(ScriptedClient(tok, [reply], stop=["\n"]), example))
                for reply in ["a\n", "abcdefgh"]]
    run(group_env.score_group(rollouts))
    assert [r.reward for r in rollouts] == [0.5, 0.0]


# -- MultiTurnEnv ----------------------------------------------------------------


class Guess(MultiTurnEnv):
    """Guess a number; the env answers higher/lower (a user turn) and rewards each wrong guess -0.1."""

    def load_examples(self):
        return [Example(f"g{n}", "guess a number 0-9", answer=str(n)) for n in range(10)]

    def build_rubric(self):
        def solved(completion, answer):
            return float(completion[-1]["content"].split("</think>")[-1].strip() == answer)

        return Rubric([solved])

    async def is_completed(self, messages, state):
        return messages[-1]["content"].split("</think>")[-1].strip() == state["example"].answer

    async def env_response(self, messages, state):
        guess = messages[-1]["content"].split("</think>")[-1].strip()
        state["turn_reward"] = -0.1
        hint = "higher" if guess.isdigit() and int(guess) < int(state["example"].answer) else "lower"
        return [{"role": "user", "content": hint}]


def guess_env(**options):
    return Guess(MultiTurnConfig(**{"max_tokens": 40, "max_total_tokens": 400, **options}))


def test_multi_turn_tokens_mask_logprobs_and_versions(tok):
    env = guess_env()
    example = env.examples()[7]
    replies = ["3" + END, "8" + END, "7" + END]
    client = ScriptedClient(tok, replies, version=5)
    rollout = run(env.rollout(client, example))
    assert rollout.reward == pytest.approx(1.0 - 0.2) and rollout.turn_rewards == pytest.approx([-0.1, -0.1, 1.0])
    assert rollout.metrics["turns"] == 3 and rollout.metrics["stop/completed"] == 1.0
    full = rollout.prompt_ids + rollout.completion_ids
    sampled = [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m]
    assert sampled == [t for r in replies for t in tok.encode(r).ids]
    for token, mask, logprob, version in zip(rollout.completion_ids, rollout.completion_mask,
                                             rollout.completion_logprobs, rollout.completion_versions):
        assert (logprob, version) == ((-0.25, 5) if mask else (0.0, ENV_TOKEN_VERSION))
    # every request is the previous one plus what the model sampled plus the env's tokens, as ids
    for before, after in zip(client.requests, client.requests[1:]):
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    assert full[: len(client.requests[-1].prompt_ids)] == client.requests[-1].prompt_ids
    assert tok.decode(full, skip_special_tokens=False).endswith(
        f"<|im_start|>user\nlower{END}\n<|im_start|>assistant\n7{END}")
    assert set(rollout.completion_turns) == {0, 1, 2} and client.requests[0].stop_token_ids == [tok.token_to_id(END)]


@pytest.mark.parametrize("options, replies, reason, turns", [
    ({"max_turns": 2}, ["1" + END, "2" + END], "max_turns", 2),
    ({"max_tokens": 4}, ["123456789" + END], "truncated", 1),
    ({"max_total_tokens": 70}, ["1" + END] * 5, "length", None),
])  # fmt: skip
def test_multi_turn_stop_conditions(tok, options, replies, reason, turns):
    env = guess_env(**options)
    rollout = run(env.rollout(ScriptedClient(tok, replies), env.examples()[9]))
    assert rollout.metrics[f"stop/{reason}"] == 1.0, rollout.metrics
    assert sum(v for k, v in rollout.metrics.items() if k.startswith("stop/")) == 1.0
    if turns is not None:
        assert rollout.metrics["turns"] == turns
    assert len(rollout.prompt_ids) + len(rollout.completion_ids) <= env.config.max_total_tokens


def test_multi_turn_rollout_timeout_keeps_the_turns_done(tok):
    class Slow(Guess):
        async def env_response(self, messages, state):
            await asyncio.sleep(5)

    env = Slow(MultiTurnConfig(max_tokens=8, timeout_s=0.3))
    rollout = run(env.rollout(ScriptedClient(tok, ["1" + END]), env.examples()[9]))
    assert rollout.metrics["stop/timeout"] == 1.0 and rollout.metrics["turns"] == 1 and any(rollout.completion_mask)
    env = Slow(MultiTurnConfig(max_tokens=8, env_timeout_s=0.2))
    rollout = run(env.rollout(ScriptedClient(tok, ["1" + END]), env.examples()[9]))
    assert rollout.metrics["stop/env_timeout"] == 1.0


def test_multi_turn_rollout_cancelled_as_the_env_answers_ends_cancelled(tok):
    """A run stopping cancels its rollouts; the cancel lands as env_response returns. Python 3.11's
    asyncio.wait_for handed back the reply and dropped the cancel: the rollout went on with its next turns."""
    rollout_task = None

    class AnswersAsTheRunStops(Guess):
        async def env_response(self, messages, state):
            rollout_task.cancel()
            return [{"role": "user", "content": "lower"}]

    env = AnswersAsTheRunStops(MultiTurnConfig(max_tokens=8, max_turns=3))

    async def go():
        nonlocal rollout_task
        rollout_task = asyncio.create_task(env.rollout(ScriptedClient(tok, ["1" + END] * 3), env.examples()[9]))
        with pytest.raises(asyncio.CancelledError):
            await rollout_task

    run(go())


THINK_STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""Like Qwen3's: assistant turns before the last user turn lose their <think> part when rendered."""


def test_tokens_in_out_survive_a_template_that_strips_earlier_reasoning(tok):
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, chat_template=THINK_STRIPPING_TEMPLATE)
    env = guess_env()
    example = env.examples()[7]
    replies = ["<think>start low</think>3" + END, "<think>go up a lot</think>8" + END, "<think>one less</think>7" + END]
    client = ScriptedClient(hf, replies, version=2)
    rollout = run(env.rollout(client, example))
    assert isinstance(env.renderer(client), HFChatTemplate) and rollout.reward == pytest.approx(0.8)
    full = rollout.prompt_ids + rollout.completion_ids
    sampled = [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m]
    assert sampled == [t for r in replies for t in hf.encode(r, add_special_tokens=False)]
    for before, after in zip(client.requests, client.requests[1:]):  # each request extends the last, untouched
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    # Re-rendering the chat (what re-tokenising each turn amounts to) drops the earlier reasoning: the model
    # would be trained on a sequence it never saw, with logprobs of tokens that are not there.
    rerendered = hf.apply_chat_template(rollout.state["prompt"] + rollout.state["completion"], tokenize=False)
    assert "start low" not in rerendered and "start low" in hf.decode(full)
    rerendered_ids = hf.encode(rerendered, add_special_tokens=False)
    assert rerendered_ids != full[: len(rerendered_ids)]


def test_chat_template_continuation_is_what_the_full_render_adds(tok):
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, chat_template=THINK_STRIPPING_TEMPLATE)
    renderer = HFChatTemplate(hf)
    first = [{"role": "user", "content": "hi"}]
    turn = "ok" + END
    tool = [{"role": "tool", "content": "42"}]
    ids = renderer.prompt_ids(first) + hf.encode(turn, add_special_tokens=False) + renderer.continuation_ids(tool)
    full = hf.apply_chat_template([*first, {"role": "assistant", "content": "ok"}, *tool], tokenize=False,
                                  add_generation_prompt=True)
    assert ids == hf.encode(full, add_special_tokens=False)
    chatml = ChatML(tok)
    assert tok.decode(chatml.continuation_ids(tool), skip_special_tokens=False) == (
        f"\n<|im_start|>tool\n42{END}\n<|im_start|>assistant\n")


# -- ToolEnv ---------------------------------------------------------------------


def test_a_function_becomes_a_tool_from_its_signature_and_docstring():
    def search(query: str, limit: int = 3, exact: bool = False) -> list[str]:
        """Search the notes.

        Args:
            query: words to look for
            limit: most results
        """

    spec = tool_schema(search)
    fn = spec["function"]
    assert spec["type"] == "function" and fn["name"] == "search" and fn["description"] == "Search the notes."
    assert fn["parameters"]["required"] == ["query"]
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for"}
    assert props["limit"] == {"type": "integer", "default": 3, "description": "most results"}
    assert props["exact"]["type"] == "boolean"
    calc = tool_schema(calculate)["function"]
    assert calc["parameters"]["properties"]["expression"]["description"].startswith("the expression")


async def slow_tool(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "done"


def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


class Tools(ToolEnv):
    tools = (divide, slow_tool)

    def load_examples(self):
        return [Example("t0", "divide 6 by 3", answer="2")]


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def quit_tool(code: int) -> str:
    """Exit the process (a plugin's bug)."""
    raise SystemExit(code)


class QuittingTools(ToolEnv):
    tools = (quit_tool,)

    def load_examples(self):
        return [Example("q0", "quit", answer="")]


def test_a_tool_that_calls_sys_exit_is_an_error_the_model_reads_not_the_runs_exit(tok):
    """Tool calls run in tasks of their own, out of which asyncio lets SystemExit leave the loop: a tool's
    ``sys.exit(3)`` ended the run with exit 3 and no line. It is the call's error, as any exception is."""
    env = QuittingTools(ToolConfig(max_tokens=400, max_total_tokens=2000, max_turns=2, tool_timeout_s=5))
    client = ScriptedClient(tok, [call("quit_tool", code=3) + END, "done" + END])
    rollout = run(env.rollout(client, env.examples()[0]))
    assert [m["content"] for m in rollout.state["completion"] if m["role"] == "tool"] == ["Error: SystemExit: 3"]


def test_tool_calls_results_and_errors_go_back_as_tool_messages(tok):
    env = Tools(ToolConfig(max_tokens=400, max_total_tokens=2000, max_turns=3, tool_timeout_s=0.2))
    turn1 = ("<think>maybe <tool_call>{not this}</tool_call></think>" + call("divide", a=6, b=3)
             + call("divide", a=1, b=0) + "<tool_call>{broken json</tool_call>" + call("nope") + END)
    turn2 = call("divide", a="six", b=1) + call("divide", a=1, b=2, c=3) + call("slow_tool", seconds=1.0) + END
    client = ScriptedClient(tok, [turn1, turn2, "It is 2" + END])
    rollout = run(env.rollout(client, env.examples()[0]))
    completion = rollout.state["completion"]
    assert [m["role"] for m in completion] == ["assistant", *["tool"] * 4, "assistant", *["tool"] * 3, "assistant"]
    calls = completion[0]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_0_0", "call_0_1", "call_0_2", "call_0_3"]  # the one in <think> ignored
    assert calls[0]["function"] == {"name": "divide", "arguments": '{"a": 6, "b": 3}'}
    results = [m["content"] for m in completion if m["role"] == "tool"]
    assert results[0] == "2.0"
    assert results[1] == "Error: ZeroDivisionError: division by zero"
    assert results[2].startswith("Error: could not parse the tool call")
    assert results[3].startswith("Error: unknown tool 'nope'; tools: divide, slow_tool")
    assert results[4].startswith("Error: bad arguments for divide: a:")
    assert results[5] == "Error: divide takes no argument c"
    assert results[6] == "Error: slow_tool timed out after 0.2s"
    assert all(m["tool_call_id"] == c["id"] for m, c in zip(completion[1:5], calls))
    assert rollout.metrics["tool_calls"] == 7 and rollout.metrics["tool_errors"] == 6
    assert rollout.metrics["stop/completed"] == 1.0 and rollout.metrics["turns"] == 3
    # the tool results are env tokens: not trained on
    text = tok.decode([t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if not m],
                      skip_special_tokens=False)
    assert "ZeroDivisionError" in text and "<|im_start|>tool\n2.0" in text
    prompt = tok.decode(rollout.prompt_ids, skip_special_tokens=False)
    assert "divide(a: integer, b: integer): Divide a by b." in prompt


def test_tool_calc_solves_with_the_calculator_and_scores_the_final_answer(tok):
    env = make_component("env", "tool-calc", num_examples=3, max_tokens=150, max_total_tokens=600)
    example = env.examples()[0]
    expression = example.prompt[0]["content"]
    good = ScriptedClient(tok, [call("calculate", expression=expression) + END, f"Answer: {example.answer}" + END])
    rollout = run(env.rollout(good, example))
    assert rollout.reward == 1.0 and rollout.metrics["used_calculator"] == 1.0
    assert rollout.state["completion"][1]["content"] == example.answer
    wrong = run(env.rollout(ScriptedClient(tok, ["Answer: 1" + END]), example))
    assert wrong.reward == 0.0 and wrong.metrics["used_calculator"] == 0.0
    assert calculate("2**3 + 7 // 2") == "11"
    with pytest.raises(ValueError):
        calculate("__import__('os')")
    with pytest.raises(ValueError):
        calculate("9**9**9")


class Notes(StatefulToolEnv):
    """A tool whose session id comes from the rollout state, never from the model."""

    def __init__(self, config):
        super().__init__(config)
        self.add_tool(self.read_note, hidden=("session_id",))
        self.sessions = {}

    def load_examples(self):
        return [Example("n0", "read the note", answer="hello")]

    async def setup(self, state):
        state["session_id"] = f"s{len(self.sessions)}"
        self.sessions[state["session_id"]] = "hello"

    async def cleanup(self, state):
        self.sessions.pop(state["session_id"])

    async def read_note(self, session_id: str, upper: bool = False) -> str:
        """Read the note."""
        note = self.sessions[session_id]
        return note.upper() if upper else note


def test_stateful_tool_args_are_injected_and_hidden_from_the_model(tok):
    env = Notes(ToolConfig(max_tokens=200, max_total_tokens=800))
    assert list(env.tool_specs()[0]["function"]["parameters"]["properties"]) == ["upper"]
    client = ScriptedClient(tok, [call("read_note", upper=True) + call("read_note", session_id="other") + END,
                                  "hello" + END])
    rollout = run(env.rollout(client, env.examples()[0]))
    results = [m["content"] for m in rollout.state["completion"] if m["role"] == "tool"]
    assert results == ["HELLO", "Error: read_note takes no argument session_id"]
    assert env.sessions == {}  # cleanup ran
    assert "session_id" not in tok.decode(rollout.prompt_ids, skip_special_tokens=False)


def test_cleanup_runs_when_generation_fails(tok):
    env = Notes(ToolConfig(max_tokens=200, max_total_tokens=800))
    with pytest.raises(AssertionError, match="only 0 replies"):
        run(env.rollout(ScriptedClient(tok, []), env.examples()[0]))
    assert env.sessions == {}
