"""The broadcast weight sync with real processes: a builtin server receiving in flight, an FSDP2 trainer sending,
and a whole run on it."""

import asyncio
import gc
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from i3core.config import validate
from i3core.errors import ServerError
from i3core.plugins.models.tiny_moe.hf import iter_hf_tensors
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.plugins.weight_sync.broadcast import Receiver, Sender
from i3core.testing import make_component, plugin_manager

from .conftest import (
    QUICKSTART_FILESYSTEM_SYNC,
    SERVERS,
    abs_logprob_diffs,
    quickstart_run,
    torchrun_trainer,
    wait_until_running,
)
from .test_trainer_distributed import MODEL, make_batches

pytestmark = pytest.mark.slow

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


def test_a_server_takes_a_broadcast_in_flight_and_refuses_a_bad_one(tmp_path):
    component = make_component("model", "tiny-moe", **SMALL)
    v0, v1 = component.build(seed=0), component.build(seed=1)
    sync = make_component("weight_sync", "broadcast", backend="gloo", timeout_s=60)
    component.save_hf(v0, tmp_path / "step_0")
    rendezvous = sync.host(tmp_path, receivers=1)
    source = make_component("rollout_source", "builtin", servers=1, max_slots=8, max_len=512)
    (url,) = source.start(tmp_path / "step_0", tmp_path / "logs", receiver=sync.receiver(tmp_path))
    sender = Sender(rendezvous.path, "gloo", timeout_s=60)
    tokenizer = build_tokenizer()

    async def scenario():
        client = source.client(url, tokenizer, [])
        try:
            long = asyncio.create_task(client.complete("abc", max_tokens=400, temperature=1.0, seed=1))
            await wait_until_running(client, task=long)
            await asyncio.to_thread(sender.send, 1, iter_hf_tensors(v1))
            assert (await client.update_weights(None, 1))["version"] == 1
            in_flight = await long
            after = await client.complete("abc", max_tokens=12, temperature=1.0, seed=2)
            wrong = {**dict(iter_hf_tensors(v1)), "model.norm.weight": torch.ones(3)}
            await asyncio.to_thread(sender.send, 2, wrong.items())
            with pytest.raises(ServerError, match="rejected"):
                await client.update_weights(None, 2)
            health = await client.health()
            still = await client.complete("abc", max_tokens=4, temperature=1.0)
            metrics = await client._request("GET", "/i3/metrics")
            rendezvous.close()  # the store goes away: the group is gone for good
            del rendezvous.store
            gc.collect()
            broken = None
            for _ in range(100):  # bounded: until the server has noticed
                broken = await client.health()
                if "weights_error" in broken:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(ServerError, match="receiver stopped"):
                await client.update_weights(None, 3)
            return in_flight, after, health, still, metrics, broken
        finally:
            await client.close()

    try:
        in_flight, after, health, still, metrics, broken = asyncio.run(scenario())
    finally:
        source.close()
        rendezvous.close()
    versions = in_flight.versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)  # one sequence, two versions
    assert float(abs_logprob_diffs(v0, in_flight)[: versions.count(0)].max()) < 1e-4  # old tokens: old weights
    assert float(abs_logprob_diffs(v1, after).mean()) < 1e-4
    assert after.versions == [1] * len(after.token_ids)
    assert health["version"] == 1 and still.versions == [1] * 4  # the bad version never went live
    assert metrics["updates"] == 1 and 0 < metrics["update_pause_s"] < 5
    assert "weight receiver stopped" in broken["weights_error"] and broken["version"] == 1


def test_an_fsdp2_trainer_streams_the_same_weights_it_would_write(tmp_path):
    """2 sharded gloo ranks gather layer by layer; rank 0 broadcasts to a receiver here. The weights
    that arrive are the HF tensors the 1-process trainer writes with the filesystem sync."""
    steps = 2
    results = {}
    for use, nproc in (("filesystem", 1), ("broadcast", 2)):
        out = tmp_path / use
        make_batches(out, steps)
        sync_options = {"use": use} if use == "filesystem" else {"use": use, "backend": "gloo", "timeout_s": 120}
        data = {"run": {"output_dir": str(out), "max_steps": steps}, "model": MODEL,
                "env": {"use": "reverse-text"}, "loss": {"use": "icepop"},
                "optimizer": {"use": "adamw", "lr": 1e-2}, "weight_sync": sync_options,
                "trainer": {"seq_len": 16, "micro_batch_rows": 3, "nproc": nproc}}
        config = validate(data, plugin_manager(installed=False))
        path = tmp_path / f"{use}.json"
        path.write_text(json.dumps(config.to_dict()))
        received, rendezvous = [], None
        if use == "broadcast":
            rendezvous = config.get("weight_sync").build().host(out / "broadcasts", receivers=1)

            def receive():
                receiver = Receiver(rendezvous.path, 1, "gloo", timeout_s=120)
                for _ in range(steps):
                    received.append(receiver.receive())

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
        torchrun_trainer(path, nproc)
        if rendezvous is not None:
            thread.join(timeout=60)
            rendezvous.close()
            assert [v for v, _ in received] == [1, 2]
            assert (out / "broadcasts" / "step_0" / "STABLE").exists()  # what servers start from
            assert (out / "broadcasts" / "step_2.sent").exists()
            results[use] = received[-1][1]
        else:
            results[use] = load_file(str(out / "broadcasts" / f"step_{steps}" / "model.safetensors"))
    written, streamed = results["filesystem"], results["broadcast"]
    assert written.keys() == streamed.keys()
    worst = max((written[k] - streamed[k]).abs().max().item() for k in written)
    assert worst < 1e-5, worst


def test_a_run_on_the_broadcast_sync(tmp_path):
    proc, out, rows = quickstart_run(tmp_path, "run.max_steps=5", "sft.steps=5", *SERVERS,
                                     replace={QUICKSTART_FILESYSTEM_SYNC: 'use = "broadcast"'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["weights/served_version"] == 5 and rows[-1]["servers/live"] == 2
    assert not (out / "broadcasts" / "step_3").exists()  # nothing but version 0 went to disk
    assert "Traceback" not in proc.stderr
