"""Rollout source ``local``: the builtin engine in the orchestrator's process, as a client and in a real run."""

import asyncio

import pytest
import torch

from i3core.errors import ServerError
from i3core.loop.trainer import token_logprobs
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import make_component

from .conftest import LEDGER, quickstart_run, run_cli
from .test_inference_server import SMALL, two_versions

@pytest.fixture
def weights(tmp_path):
    return tmp_path, two_versions(tmp_path)


def test_completions_logprobs_and_an_in_flight_update(weights):
    root, model = weights
    source = make_component("rollout_source", "local", max_slots=4, max_len=256)
    (url,) = source.start(root / "v0", root / "logs", model={"use": "tiny-moe", **SMALL})
    client = source.client(url, build_tokenizer(), stop_token_ids=[])

    async def scenario():
        try:
            first = await client.complete("abc", max_tokens=6, temperature=1.0, seed=3)
            long = asyncio.create_task(client.complete("abc", max_tokens=200, temperature=1.0, seed=1))
            while not client.server.engine.running:
                await asyncio.sleep(0.001)
            await client.update_weights(str(root / "v1"), version=1)  # swapped between two decode steps
            completion = await long
            with pytest.raises(ServerError, match="STABLE|missing|No such"):
                await client.update_weights(str(root / "missing"), version=2)
            with pytest.raises(ServerError, match="path only"):
                await client.update_weights(None, version=2)
            with pytest.raises(ServerError, match="prompt"):
                await client.complete_ids([], max_tokens=3, temperature=1.0)
            return first, completion, await client.health()
        finally:
            await client.close()

    first, completion, health = asyncio.run(scenario())
    books = {s.name: s.value for family in source.server.metrics.registry.collect() for s in family.samples}
    generated = source.server.tokens_generated
    source.close()
    assert health["version"] == 1
    # nothing scrapes this engine: no per-token books (the engine task's time is the rollouts'), updates counted
    assert books["vllm:generation_tokens_total"] == 0 and books["vllm:time_to_first_token_seconds_count"] == 0
    assert books["i3core:weight_updates_total"] == 1 and generated > 0
    assert completion.versions[0] == 0 and completion.versions[-1] == 1 and completion.versions == sorted(completion.versions)
    # Version 0's logprobs are the trainer's on the same tokens (the engine is the builtin server's).
    ids = torch.tensor([first.prompt_ids + first.token_ids])
    with torch.no_grad():
        lp = token_logprobs(model.eval(), ids, torch.arange(ids.shape[1])[None], chunk=64)[0, len(first.prompt_ids):]
    assert torch.allclose(lp, torch.tensor(first.logprobs), atol=1e-4)
    assert first.versions == [0] * len(first.token_ids)


def test_versions_handed_over_in_memory_are_swapped_in(weights):
    """``weight_sync memory``: the trainer's HF tensors put in the run's mailbox reach the local engine through its
    receiver (no directory), checked before the live weights are touched; the engine then samples with them."""
    from i3core.errors import I3Error
    from i3core.plugins.weight_sync.memory import Mailbox, mailbox

    root, model = weights
    component = make_component("model", "tiny-moe", **SMALL)
    sync = make_component("weight_sync", "memory")
    broadcasts = root / "broadcasts"
    source = make_component("rollout_source", "local", max_slots=4, max_len=256)
    (url,) = source.start(root / "v0", root / "logs", receiver=sync.receiver(broadcasts),
                          model={"use": "tiny-moe", **SMALL})
    client = source.client(url, build_tokenizer(), stop_token_ids=[])
    policy = component.build(seed=2)
    assert not sync.is_ready(broadcasts, 1)
    mailbox(broadcasts).put(1, {name: t.detach().clone() for name, t in component.hf_tensors(policy)})
    assert sync.is_ready(broadcasts, 1) and sync.location(broadcasts, 1) is None

    async def scenario():
        try:
            updated = await client.update_weights(None, version=1)
            again = await client.update_weights(None, version=1)  # live already: nothing to take
            completion = await client.complete("abc", max_tokens=6, temperature=1.0, seed=3)
            broken = {name: t.detach().clone() for name, t in component.hf_tensors(policy)}
            broken.pop(next(iter(broken)))
            mailbox(broadcasts).put(2, broken)
            with pytest.raises(ServerError, match="weight version 2"):
                await client.update_weights(None, version=2)
            return updated, again, completion, await client.health()
        finally:
            await client.close()

    updated, again, completion, health = asyncio.run(scenario())
    source.close()
    assert updated == again == {"status": "ok", "version": 1} and health["version"] == 1  # version 2 refused
    assert completion.versions == [1] * len(completion.token_ids)
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        lp = token_logprobs(policy.eval(), ids, torch.arange(ids.shape[1])[None], chunk=64)
    assert torch.allclose(lp[0, len(completion.prompt_ids):], torch.tensor(completion.logprobs), atol=1e-4)
    with pytest.raises(I3Error, match="no weight version arrived in memory in 0s"):
        Mailbox().take(timeout_s=0.01)


def test_broadcast_with_local_is_refused_in_one_line(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[model]\nuse = "tiny-moe"\n[inference]\nuse = "local"\n[env]\nuse = "reverse-text"\n'
                      '[weight_sync]\nuse = "broadcast"\n')
    result = run_cli("check", str(config))
    assert result.returncode == 2
    assert "broadcast needs a rollout source that starts its servers" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_real_run_on_the_local_engine(tmp_path):
    """The quickstart as it is: its [inference] is the local engine."""
    proc, out, rows = quickstart_run(tmp_path, "run.max_steps=8", "sft.steps=5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert row["rollouts/started"] == sum(row[k] for k in LEDGER)
        assert row["servers/live"] == 1
    assert rows[0]["mismatch/same_version_abs_diff"] < 1e-4
    assert rows[-1]["weights/served_version"] >= 6  # every version reached the engine in flight
    assert max(r["off_policy/max_steps"] for r in rows) >= 1  # rollouts spanned versions: updates in flight
    assert "Traceback" not in proc.stderr
