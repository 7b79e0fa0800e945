"""The trainer under torchrun: 2 FSDP2-sharded gloo ranks train exactly like 1 process."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from i3core.config import validate
from i3core.loop.packing import Sample, concat, pack
from i3core.testing import plugin_manager

from .conftest import torchrun_trainer

pytestmark = pytest.mark.slow

MODEL = {"use": "tiny-moe", "hidden_size": 64, "num_experts": 4, "moe_intermediate_size": 32}


def make_batches(out, steps, vocab: int = 256, parts: bool = False):
    """``steps`` packed batches of 13 random samples (token ids below ``vocab``) under ``out/batches``; with
    ``parts``, each batch's first 6 samples also as an early part (``batch_parts/step_N_0.pt``), as the orchestrator
    writes them with ``[trainer] stream_groups``, but with one row fewer in the batch's ``streamed_rows``: a
    trainer that takes the part says so on stderr and trains the batch whole again."""
    rng = random.Random(0)
    (out / "batches").mkdir(parents=True)
    (out / "batch_parts").mkdir()
    for step in range(1, steps + 1):
        samples = []
        for _ in range(13):  # an odd number of rows, so one rank gets a padding row
            n_prompt, n_completion = rng.randint(2, 6), rng.randint(2, 8)
            ids = [rng.randrange(vocab) for _ in range(n_prompt + n_completion)]
            logprobs = [0.0] * n_prompt + [-rng.uniform(0.5, 3.0) for _ in range(n_completion)]
            samples.append(Sample(ids, [False] * n_prompt + [True] * n_completion, logprobs,
                                  [-1] * n_prompt + [0] * n_completion, rng.uniform(-1, 1)))
        if not parts:
            torch.save(pack(samples, seq_len=16), out / "batches" / f"step_{step}.pt")
            continue
        early, rest = pack(samples[:6], seq_len=16), pack(samples[6:], seq_len=16)
        torch.save(early, out / "batch_parts" / f"step_{step}_0.pt")
        batch = concat([early, rest])
        batch.streamed_rows = early.input_ids.shape[0] - 1
        torch.save(batch, out / "batches" / f"step_{step}.pt")


def trainer_config(tmp_path, out, nproc, steps, optimizer, **trainer):
    """A trainer-only config (the trainer role on prepared batches) written next to ``out``; its path."""
    data = {"run": {"output_dir": str(out), "max_steps": steps}, "model": MODEL,
            "env": {"use": "reverse-text"}, "loss": {"use": "icepop"}, "optimizer": optimizer,
            "weight_sync": {"use": "filesystem"},
            "trainer": {"seq_len": 16, "micro_batch_rows": 3, "nproc": nproc, **trainer}}
    config = validate(data, plugin_manager(installed=False))
    path = tmp_path / f"config-{out.name}.json"
    path.write_text(json.dumps(config.to_dict()))
    return path


def train(tmp_path, nproc, steps=2, optimizer=None, ranks=None, **trainer):
    """``nproc`` in the config, ``ranks`` under torchrun (default: ``nproc``; ``i3core launch`` starts the ranks by
    node count whatever ``nproc`` says); with ``stream_groups``, each batch comes with an early part."""
    optimizer = optimizer or {"use": "adamw", "lr": 1e-2}
    out = tmp_path / f"nproc{nproc}-ranks{ranks}-{optimizer['use']}-{len(trainer)}"
    make_batches(out, steps, parts=trainer.get("stream_groups", False))
    path = trainer_config(tmp_path, out, nproc, steps, optimizer, **trainer)
    result = torchrun_trainer(path, ranks or nproc)
    weights = load_file(str(out / "broadcasts" / f"step_{steps}" / "model.safetensors"))
    metrics = json.loads((out / "trainer" / f"step_{steps}.json").read_text())
    return weights, metrics, out, result.stderr


def test_two_sharded_ranks_match_one_process(tmp_path):
    one, metrics_one, _, _ = train(tmp_path, 1)
    two, metrics_two, out, _ = train(tmp_path, 2)
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst
    assert metrics_one["loss"] == pytest.approx(metrics_two["loss"], abs=1e-5)
    assert metrics_one["train/loss_tokens"] == metrics_two["train/loss_tokens"]
    assert {p.name for p in (out / "checkpoints" / "step_2").iterdir()} == {
        "model.pt", "trainer.pt", "optimizer-rank0.pt", "optimizer-rank1.pt"}


def test_two_launched_ranks_train_streamed_batches_whole(tmp_path):
    """A launched job: the config says one rank (``nproc = 1``, so the orchestrator writes early parts) but torchrun
    starts two. They must not take the parts (a rank stopping while another runs a part's collectives would hang):
    each batch is trained whole, the same step as one process's."""
    one, metrics_one, _, err_one = train(tmp_path, 1, stream_groups=True)
    two, metrics_two, _, err_two = train(tmp_path, 1, ranks=2, stream_groups=True)
    assert "came early" in err_one  # one process takes the parts (and, told otherwise by the batch, trains it whole)
    assert "came early" not in err_two
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst
    assert metrics_one["loss"] == pytest.approx(metrics_two["loss"], abs=1e-5)


def test_muon_on_two_sharded_ranks_matches_one_process(tmp_path):
    """The real trainer with distributed Newton–Schulz (FSDP2 DTensor parameters, clipping, publishing)."""
    muon = {"use": "muon", "lr": 1e-2, "ns_dtype": "float32", "strategy": "all_to_all"}
    one, _, _, _ = train(tmp_path, 1, optimizer=muon)
    two, _, _, _ = train(tmp_path, 2, optimizer=muon)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst
