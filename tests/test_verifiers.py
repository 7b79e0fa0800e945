"""A verifiers 0.4 environment evaluated against ``i3core serve``, through verifiers' own eval and training clients.

The environment is a small taskset written here (a module in a temporary directory, found by verifiers' loader as
any installed taskset is) played by verifiers' ``null`` harness: its chat program, a PEP 723 script, runs in the
local ``subprocess`` runtime and talks to verifiers' interception server, which forwards each turn to ``i3core
serve`` on a saved tiny-moe (random weights: the text is noise; what is checked is that rewards, token ids,
logprobs and the server's per-token versions come back and agree with each other), and on a scripted one whose
weights make it write "z" whatever it reads (so it says the word "zzz" of one task and not "abc" of another).

verifiers prepares that chat program with ``uv sync --script`` on first use, which needs its dependencies. Nothing
may be downloaded while the tests run, so ``.ci/run`` downloads them into a wheelhouse (``$I3CORE_VERIFIERS_WHEELS``,
default ``.ci/verifiers-wheels``) and these tests point uv at it alone (``UV_DEFAULT_INDEX`` and ``UV_FIND_LINKS``) with a
fresh uv cache. Without the wheelhouse they skip, unless ``I3CORE_REQUIRE_VERIFIERS=1`` (CI sets it) fails them.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest
import torch
import uv
import verifiers.v1 as vf
from transformers import AutoTokenizer
from verifiers.v1.utils.loaders import load_environment

from i3core.testing import make_component

from .conftest import ADMIN_TOKEN, i3core_serve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny-served"
MAX_TOKENS = 8
TASKSET = textwrap.dedent('''
    import verifiers.v1 as vf


    class EchoData(vf.TaskData):
        word: str


    class EchoTask(vf.Task[EchoData]):
        @vf.reward(weight=1.0)
        async def says_word(self, trace: vf.Trace) -> float:
            return float(self.data.word in (trace.messages[-1].content or ""))

        @vf.metric
        async def reply_chars(self, trace: vf.Trace) -> float:
            return float(len(trace.messages[-1].content or ""))


    class EchoConfig(vf.TasksetConfig):
        num_tasks: int = 2


    class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
        def load(self):
            words = ["abc", "zzz", "hello"][: self.config.num_tasks]
            return [EchoTask(EchoData(prompt=f"Say {w}.", word=w), self.config.task) for w in words]


    __all__ = ["EchoTaskset"]
''')


UNSCORED = TASKSET.replace("@vf.reward(weight=1.0)", "@vf.metric").replace("def says_word", "def said_word")
"""The same taskset with no reward function: its episodes end unscored."""
SAYS = "z"
"""What the scripted model writes, token after token."""


def parrot(module) -> None:
    """Weights under which tiny-moe writes :data:`SAYS` whatever it reads: every token embeds to the same vector,
    no block adds to it (zero output projections), so the last hidden state is constant and the LM head gives
    :data:`SAYS` logit 16 and every other token 0 (logprob about -3e-5: the sampler still draws it)."""
    from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer

    (say,) = build_tokenizer().encode(SAYS).ids
    with torch.no_grad():
        module.embed.weight.fill_(1.0)
        for block in module.blocks:
            block.attn.o_proj.weight.zero_()
            block.moe.down.zero_()
        module.norm.weight.fill_(1.0)
        module.lm_head.weight.zero_()
        module.lm_head.weight[say] = 16.0 / module.lm_head.weight.shape[1]


@pytest.fixture(scope="module")
def offline_uv(tmp_path_factory):
    """uv on PATH, resolving the chat program's dependencies from the prepared wheelhouse only, into a fresh cache;
    and the test taskset importable."""
    wheels = Path(os.environ.get("I3CORE_VERIFIERS_WHEELS", ROOT / ".ci" / "verifiers-wheels"))
    if not any(wheels.glob("*.whl")):
        reason = f"no wheelhouse for verifiers' chat program at {wheels} (.ci/run prepares it)"
        if os.environ.get("I3CORE_REQUIRE_VERIFIERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    modules = tmp_path_factory.mktemp("taskset")
    (modules / "i3_echo_taskset.py").write_text(TASKSET)
    (modules / "i3_unscored_taskset.py").write_text(UNSCORED)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{Path(uv.find_uv_bin()).parent}{os.pathsep}{os.environ['PATH']}")
        patch.setenv("UV_DEFAULT_INDEX", wheels.as_uri())  # in place of PyPI: uv has no variable for --no-index
        patch.setenv("UV_FIND_LINKS", str(wheels))
        patch.setenv("UV_PYTHON_DOWNLOADS", "never")
        patch.setenv("UV_CACHE_DIR", str(tmp_path_factory.mktemp("uv-cache")))
        patch.syspath_prepend(str(modules))
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``i3core serve DIR`` in a subprocess, on a tiny-moe directory whose tokenizer carries a chat template;
    yields (base URL, model dir)."""
    directory = tmp_path_factory.mktemp("served") / "model"
    with i3core_serve(directory, NAME) as url:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["chat_template"]  # save_hf writes it: what verifiers' renderer reads
        yield url, directory


@pytest.fixture(scope="module")
def parrot_served(tmp_path_factory):
    """``i3core serve`` on the scripted tiny-moe of :func:`parrot`; yields (base URL, model dir)."""
    directory = tmp_path_factory.mktemp("parrot") / "model"
    with i3core_serve(directory, NAME, prepare=parrot) as url:
        yield url, directory


def evaluate(client: vf.BaseClientConfig, rollouts: int) -> list[vf.Episode]:
    """Every task of the test taskset, ``rollouts`` episodes each, through verifiers' own env machinery."""
    config = vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": "i3_echo_taskset"},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    })
    env = load_environment(config)
    ctx = vf.ModelContext(model=NAME, client=client, sampling=vf.Sampling(max_tokens=MAX_TOKENS, temperature=1.0))

    async def scenario():
        async with env.serving():
            slots = [slot for task in env.taskset for slot in env.slots(task, rollouts)]
            return await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))

    return asyncio.run(scenario())


def plain(text: str) -> str:
    """``text`` without tiny-moe's special tokens."""
    for special in ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"):
        text = text.replace(special, "")
    return text


def check_scored(episode: vf.Episode) -> vf.Trace:
    """The episode's one trace, finished, with its reward and metric as the task defines them on its reply."""
    (trace,) = episode.traces
    assert trace.ok and episode.ok, [e.message for e in [*episode.errors, *trace.errors]]
    reply = trace.messages[-1]
    assert reply.role == "assistant" and trace.calls[0].usage.completion_tokens <= MAX_TOKENS
    word = trace.task.data["word"] if isinstance(trace.task.data, dict) else trace.task.data.word
    assert trace.rewards["says_word"].score == float(word in (reply.content or ""))
    assert trace.reward == trace.rewards["says_word"].score
    assert trace.metrics["reply_chars"] == len(reply.content or "")
    return trace


def test_eval_client_scores_episodes_over_chat_completions(offline_uv, served):
    url, _ = served
    episodes = evaluate(vf.EvalClientConfig(base_url=url + "/v1", api_key_var="I3CORE_TEST_NO_KEY"), rollouts=2)
    assert len(episodes) == 4
    for episode in episodes:
        trace = check_scored(episode)
        assert trace.calls[0].model == NAME
        assert [m.role for m in trace.messages] == ["user", "assistant"]


def test_train_client_gets_token_ids_logprobs_and_session_versions(offline_uv, served):
    url, directory = served
    client = vf.TrainClientConfig(base_url=url + "/v1", api_key_var="I3CORE_TEST_NO_KEY",
                                  renderer_model_name=str(directory))
    episodes = evaluate(client, rollouts=2)
    assert len(episodes) == 4
    tokenizer = AutoTokenizer.from_pretrained(directory)

    async def records(ids):
        async with aiohttp.ClientSession() as session:
            out = []
            for trace_id in ids:
                async with session.get(f"{url}/inference/v1/sessions/{trace_id}",
                                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as response:
                    assert response.status == 200
                    out.append(await response.json())
            return out

    traces = [check_scored(episode) for episode in episodes]
    for trace, record in zip(traces, asyncio.run(records([t.id for t in traces])), strict=True):
        (branch,) = trace.branches
        ids, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
        assert len(ids) == len(mask) == len(logprobs)
        prompt = tokenizer.apply_chat_template([m.model_dump(include={"role", "content"}) for m in trace.messages[:-1]],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        n = len(prompt)
        assert ids[:n] == prompt  # rendered with the model directory's chat template
        assert not any(mask[:n]) and all(mask[n:]) and 0 < len(ids) - n <= MAX_TOKENS
        assert all(lp < 0 for lp in logprobs[n:])  # the server's logprobs of the sampled tokens
        # the reply is the sampled text (which special tokens the renderer keeps in it is its own affair)
        assert plain(tokenizer.decode(ids[n:], skip_special_tokens=False)) == plain(trace.messages[-1].content or "")
        (turn,) = record["turns"]  # the server's record under X-Session-ID = the trace's id
        assert turn["prompt_len"] == n and turn["token_ids"] == ids[n:]
        assert turn["versions"] == [0] * (len(ids) - n)


# -- [env] use = "verifiers": episodes as i3core Rollouts ---------------------------------------------------------


def env_rollouts(url, directory, taskset, examples=None):
    """``[env] use = "verifiers"`` on ``taskset`` (its first two tasks), two rollouts of each example against the
    server at ``url``; (examples, results: a Rollout or the exception each rollout raised)."""
    from i3core.plugins.inference.client import InferenceClient

    env = make_component("env", "verifiers", id=taskset, args={"num_tasks": 2}, renderer_model=str(directory),
                         max_tokens=MAX_TOKENS, max_turns=2)
    examples = env.examples()
    tokenizer = AutoTokenizer.from_pretrained(directory)

    async def scenario():
        client = InferenceClient(url, tokenizer)
        try:
            return await asyncio.gather(*(env.rollout(client, e) for e in examples for _ in range(2)),
                                        return_exceptions=True)
        finally:
            await client.close()

    return examples, asyncio.run(scenario())


def test_verifiers_env_component_turns_episodes_into_rollouts(offline_uv, parrot_served):
    """A model that says the task's word gets reward 1, one that does not gets 0: the env's reward is the task's."""
    url, directory = parrot_served
    examples, results = env_rollouts(url, directory, "i3_echo_taskset")
    assert [e.prompt for e in examples] == ["Say abc.", "Say zzz."]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    for rollout in results:
        assert not isinstance(rollout, BaseException), rollout
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": rollout.example.prompt}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        assert rollout.prompt_ids == prompt and len(rollout.completion_ids) == MAX_TOKENS
        assert rollout.completion_text == SAYS * MAX_TOKENS and rollout.finish_reason == "length"
        assert all(rollout.completion_mask) and rollout.completion_versions == [0] * MAX_TOKENS
        assert all(-1e-3 < lp < 0 for lp in rollout.completion_logprobs)
        assert rollout.metrics["reply_chars"] == MAX_TOKENS
    assert [r.reward for r in results] == [0.0, 0.0, 1.0, 1.0]  # "abc" is not said; "zzz" is
    assert [r.metrics["reward/says_word"] for r in results] == [0.0, 0.0, 1.0, 1.0]


def test_an_unscored_episode_is_masked_with_its_reason(offline_uv, parrot_served):
    """A taskset with no reward function: verifiers sums no reward to 0, which must not train as a score of 0."""
    from i3core.errors import RolloutMasked

    url, directory = parrot_served
    _, results = env_rollouts(url, directory, "i3_unscored_taskset")
    assert len(results) == 4
    for result in results:
        assert isinstance(result, RolloutMasked) and result.reason == "verifiers_unscored", result


def test_a_verifiers_id_that_is_not_installed_is_one_clear_line():
    from i3core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        make_component("env", "verifiers", id="no_such_taskset_here", renderer_model="x")
    assert str(caught.value).strip().splitlines() == [
        "env.id: verifiers taskset 'no_such_taskset_here' is not installed (pip install its package), "
        "got 'no_such_taskset_here'"]


def test_verifiers_on_the_in_process_engine_is_refused_in_one_line(tmp_path):
    """examples/verifiers.toml with the quickstart's ``local`` engine: verifiers' harness has no URL to call."""
    config = tmp_path / "local.toml"
    text = (ROOT / "examples" / "verifiers.toml").read_text()
    config.write_text(text[:text.index("\n[inference]")] + '\n[inference]\nuse = "local"\n\n' + text[text.index("\n[env]"):])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "examples" / "i3-verifiers-example")}
    result = subprocess.run([sys.executable, "-m", "i3core.cli", "check", str(config)], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error")] == [
        'error: inference.use: env verifiers calls the model over HTTP: use "builtin" (servers = N) or "vllm", '
        'not "local"']
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_verifiers_environment_package_trains_two_steps(offline_uv, tmp_path):
    """examples/i3-verifiers-example, importable as an installed package is, trained by ``i3core run`` with
    examples/verifiers.toml: the renderer defaults to the served model's directory, and trainer and server agree
    on the logprobs of the tokens verifiers' training client sampled."""
    from .conftest import assert_ledger

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "i3-verifiers-example"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "i3core.cli", "run", str(ROOT / "examples" / "verifiers.toml"),
         "--set", f"run.output_dir='{out}'", "--set", "run.max_steps=2", "--set", "scheduler.group_size=4",
         "--set", "scheduler.batch_size=16", "--set", "scheduler.inflight=16"],
        capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert_ledger(rows)
    assert all(r["rollouts/trained"] > 0 for r in rows) and rows[-1]["rollouts/masked"] == 0
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    diffs = [r["mismatch/same_version_abs_diff"] for r in rows if r.get("mismatch/same_version_abs_diff") is not None]
    assert diffs and max(diffs) < 1e-4  # versions re-attached: samples of one version compare one to one
