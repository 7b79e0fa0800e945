"""The clients the ecosystem evaluates, load-tests and drives agents with, run for real against `i3core serve`.

Each client is the released package (CI installs them in environments of their own, see .ci/run: they pull
openai 3.x while verifiers pins openai<3, and aiperf's pins clash with inspect-ai's) talking to `i3core serve`
on a saved `hf` Qwen3 with a BPE tokenizer and a tool-capable chat template (examples/make_hf_model.py). The
weights are random, so what is checked is that each client's own path goes through end to end and what it
reads back is what the weights say, not that the model is any good. Nothing is downloaded: the hub and
litellm's price map are off, lm-eval's tokenizer is the saved model directory and its tasks local JSONL files.

Run (marked ``clients``): ``I3CORE_REQUIRE_CLIENTS=1 .ci/venv-clients/bin/python -m pytest -m clients
tests/test_clients.py``, with ``I3CORE_AIPERF`` naming aiperf's executable.
"""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = [pytest.mark.clients, pytest.mark.slow]

NAME = "qwen3-served"
MAX_LEN = 512
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": "none",
           "DO_NOT_TRACK": "1"}
"""Nothing leaves the machine during a test."""
START_TIMEOUT_S = 300
"""torch, transformers and the model load in ~40 s on a loaded 2-core machine; a server not up by then failed."""
os.environ.update(OFFLINE)


def require(module: str):
    """The client ``module``, or a skip (a failure with ``I3CORE_REQUIRE_CLIENTS=1``, as in CI)."""
    try:
        return __import__(module)
    except ImportError as exc:
        if os.environ.get("I3CORE_REQUIRE_CLIENTS"):
            pytest.fail(f"{module} is not installed here ({exc}): run this file in the clients environment")
        pytest.skip(f"{module} is not installed (the clients environment of .ci/run has it)")


@contextmanager
def serve(directory: Path, max_len: int = MAX_LEN):
    """``i3core serve`` on the hf directory; yields its base URL, stops it afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(directory.parent / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "serve", str(directory), "--port", str(port),
                             "--max-len", str(max_len), "--served-model-name", NAME, "--model", "hf",
                             "--model-option", f"path={json.dumps(str(directory))}"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert proc.poll() is None, (directory.parent / f"serve-{port}.log").read_text()
                assert time.monotonic() < deadline, f"i3core serve did not listen within {START_TIMEOUT_S} s"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A saved hf Qwen3 (random weights) with its BPE tokenizer and ChatML tool template."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from make_hf_model import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("clients") / "qwen3", "qwen3", seed=0)


@pytest.fixture(scope="module")
def url(qwen3):
    with serve(qwen3) as base:
        yield base


# -- openai-agents: its default model is the Responses API -----------------------------------------------------


def test_openai_agents_default_responses_model_streams_with_a_function_tool(request):
    agents = require("agents")
    url = request.getfixturevalue("url")  # after the client is known to be there
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseCompletedEvent

    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def run(tools):
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = agents.OpenAIResponsesModel(model=NAME, openai_client=client)  # what the default provider builds
        agent = agents.Agent(name="adder", instructions="Add with the tool.", tools=tools, model=model,
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=16))
        result = agents.Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
        raw = [e.data async for e in result.stream_events() if e.type == "raw_response_event"]
        await client.close()
        return result, raw

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    with_tool, raw = asyncio.run(run([add]))
    without, _ = asyncio.run(run([]))
    completed = [e for e in raw if isinstance(e, ResponseCompletedEvent)]
    assert completed and completed[-1].response.model == NAME
    assert [e.sequence_number for e in raw] == sorted(e.sequence_number for e in raw)
    assert isinstance(with_tool.final_output, str) or calls  # an answer, or a call the SDK ran
    usage = with_tool.raw_responses[0].usage
    assert usage.input_tokens > without.raw_responses[0].usage.input_tokens  # the tool reached the template
    assert usage.output_tokens <= 16


# -- inspect-ai: its default openai/ provider ---------------------------------------------------------------------


def test_inspect_ai_default_openai_provider_runs_an_eval(request, tmp_path):
    inspect_ai = require("inspect_ai")
    url = request.getfixturevalue("url")
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import match
    from inspect_ai.solver import generate

    task = inspect_ai.Task(dataset=[Sample(input="What is 2 + 3?", target="5"),
                                    Sample(input="reverse abc:", target="cba")],
                           solver=generate(), scorer=match())
    (log,) = inspect_ai.eval(task, model=f"openai/{NAME}", model_base_url=url + "/v1", max_tokens=8,
                             temperature=0, log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    assert len(log.samples) == 2 and all(s.output.completion is not None for s in log.samples)
    assert log.stats.model_usage[f"openai/{NAME}"].output_tokens > 0


# -- lm-eval: local-completions with its default tokenized requests -----------------------------------------------

GENERATION = [{"prompt": f"reverse {w}:", "target": w[::-1]} for w in ("abc", "bead", "cafe", "dab")]
CHOICES = [{"question": f"What is {a} + {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b)], "answer": 0}
           for a, b in ((2, 3), (4, 1), (7, 6), (3, 3))]


def lm_eval_tasks(directory: Path) -> Path:
    """A generation task and a multiple-choice task over local JSONL files (no dataset download)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (("gen", GENERATION), ("mc", CHOICES)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / name}.jsonl\n"  # noqa: E731
    (directory / "i3core_gen.yaml").write_text(
        "task: i3core_gen\n" + data("gen") + "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    (directory / "i3core_mc.yaml").write_text(
        "task: i3core_mc\n" + data("mc") + "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return directory


def run_lm_eval(base_url: str, tokenizer: Path, tasks: Path, out: Path) -> dict:
    """``lm_eval --model local-completions`` (default ``tokenized_requests``) on both tasks; the results JSON
    and the logged samples."""
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model={NAME},base_url={base_url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
               f"num_concurrent=1,max_retries=1,max_length={MAX_LEN}",
               "--tasks", "i3core_gen,i3core_mc", "--include_path", str(tasks), "--output_path", str(out),
               "--log_samples", "--seed", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, result.stderr[-4000:]
    (found,) = out.rglob("results_*.json")
    samples = {path.name.split("_")[1] + "_" + path.name.split("_")[2]: [json.loads(line) for line in
                                                                        path.read_text().splitlines()]
               for path in out.rglob("samples_*.jsonl")}
    return {"results": json.loads(found.read_text())["results"], "samples": samples}


def test_lm_eval_local_completions_scores_what_the_weights_say(request, tmp_path):
    require("lm_eval")
    url, qwen3 = request.getfixturevalue("url"), request.getfixturevalue("qwen3")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = run_lm_eval(url, qwen3, lm_eval_tasks(tmp_path / "tasks"), tmp_path / "out")
    assert set(run["results"]) == {"i3core_gen", "i3core_mc"}
    assert "exact_match,none" in run["results"]["i3core_gen"] and "acc,none" in run["results"]["i3core_mc"]
    tokenizer = AutoTokenizer.from_pretrained(qwen3)
    model = AutoModelForCausalLM.from_pretrained(qwen3).eval()
    (mc,) = [rows for name, rows in run["samples"].items() if name.startswith("i3core_mc")]
    for sample in mc:  # each choice's loglikelihood, as lm-eval read it from echo + logprobs
        # lm-eval logs each request's arguments as {"gen_args_i": {"arg_0", "arg_1"}} and its responses as strings
        for arguments, responses in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            loglikelihood = responses[0][0]
            whole = tokenizer(context + continuation).input_ids
            ctx = len(tokenizer(context).input_ids)
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([whole])).logits.float(), -1)[0]
            expected = sum(logprobs[i - 1, whole[i]].item() for i in range(ctx, len(whole)))
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3)


# -- mini-swe-agent (litellm): a context overflow is a ContextWindowExceededError --------------------------------


def test_mini_swe_agent_runs_and_recognises_a_context_overflow(request, tmp_path):
    require("minisweagent")
    url = request.getfixturevalue("url")
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    def agent():
        model = LitellmModel(model_name=f"openai/{NAME}", cost_tracking="ignore_errors", model_kwargs={
            "api_base": url + "/v1", "api_key": "none", "temperature": 0, "max_tokens": 16})
        return DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), system_template="You run shell commands.",
                            instance_template="{{task}}", step_limit=2)  # the default prompts alone fill 512 tokens

    tiny = agent()
    outcome = tiny.run("List the files here.")  # random weights: no valid action, the loop ends on its limits
    assert tiny.n_calls >= 1 and outcome["exit_status"] in ("LimitsExceeded", "RepeatedFormatError"), outcome
    overflow = agent()
    with pytest.raises(litellm.ContextWindowExceededError, match="maximum context length is 512 tokens"):
        overflow.run("word " * 600)
    assert overflow.messages[-1]["extra"]["exit_status"] == "ContextWindowExceededError"


# -- aiperf: a short fixed-length profile -------------------------------------------------------------------------


def test_aiperf_fixed_length_profile_with_ignore_eos(request, tmp_path):
    aiperf = os.environ.get("I3CORE_AIPERF") or shutil.which("aiperf")
    if aiperf is None:
        if os.environ.get("I3CORE_REQUIRE_CLIENTS"):
            pytest.fail("aiperf is not installed: set I3CORE_AIPERF to its executable (.ci/venv-aiperf/bin/aiperf)")
        pytest.skip("aiperf is not installed (.ci/run installs it in .ci/venv-aiperf)")
    url, qwen3 = request.getfixturevalue("url"), request.getfixturevalue("qwen3")
    out = tmp_path / "aiperf"
    command = [aiperf, "profile", "--model", NAME, "--url", url, "--endpoint-type", "completions",
               "--tokenizer", str(qwen3), "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev",
               "0", "--output-tokens-mean", "8", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--extra-inputs", "min_tokens:8", "--request-count", "8", "--concurrency", "2",
               "--use-server-token-count", "--artifact-dir", str(out), "--ui-type", "none"]
    # aiperf 0.13 in HF offline mode looks a local tokenizer directory up in the hub's cache and fails: it runs
    # "online" against a closed local port instead, so any hub call fails at once and nothing is downloaded
    env = {k: v for k, v in {**os.environ, **OFFLINE}.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    (export,) = out.rglob("profile_export_aiperf.json")
    metrics = json.loads(export.read_text())
    lengths = metrics["output_sequence_length"]
    assert lengths["min"] == lengths["max"] == 8  # fixed length (the server's usage): ignore_eos, min_tokens held
    assert metrics["request_count"]["avg"] == 8
