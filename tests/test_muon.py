"""Muon: Newton–Schulz, parameter routing, the exact first step, and distributed Muon under torchrun."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from i3core.plugins.optimizers.muon import NS_COEFFICIENTS, newton_schulz, update_scale
from i3core.testing import make_component

from .muon_ranks import SMALL, optimizer_for, train

HERE = Path(__file__).resolve().parent


def test_newton_schulz_orthogonalises_and_batches():
    torch.manual_seed(0)
    for shape in ((32, 16), (16, 32), (24, 24)):
        g = torch.randn(shape)
        x = newton_schulz(g, dtype=torch.float32)
        singular = torch.linalg.svdvals(x)
        assert singular.min() > 0.6 and singular.max() < 1.25, singular  # NS5 quintic lands near 1, not on it
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        assert torch.nn.functional.cosine_similarity(x.flatten(), (u @ vh).flatten(), dim=0) > 0.98
    stack = torch.randn(5, 12, 20)
    batched = newton_schulz(stack, dtype=torch.float32)
    assert torch.allclose(batched, torch.stack([newton_schulz(m, dtype=torch.float32) for m in stack]), atol=1e-6)
    assert newton_schulz(stack).dtype == torch.float32  # computed in bf16, returned in the input dtype
    assert NS_COEFFICIENTS == (3.4445, -4.7750, 2.0315)


def test_parameters_go_to_muon_or_adamw():
    model = make_component("model", "tiny-moe", **SMALL).build(seed=0)
    optimizer = make_component("optimizer", "muon").build(model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            kinds[names[id(p)]] = (group["kind"], bool(group.get("halves")))
    assert kinds["embed.weight"][0] == kinds["lm_head.weight"][0] == "adamw"
    assert all(kinds[n][0] == "adamw" for n in kinds if "norm" in n)
    assert kinds["blocks.0.attn.q_proj.weight"] == ("muon", False)
    assert kinds["blocks.0.moe.router.weight"] == ("muon", False)
    assert kinds["blocks.0.moe.gate_up"] == ("muon", True) and kinds["blocks.0.moe.down"] == ("muon", False)
    assert len(kinds) == len(names)


def test_first_step_is_the_scaled_orthogonal_nesterov_update():
    weight = torch.nn.Parameter(torch.randn(16, 8))
    stack = torch.nn.Parameter(torch.randn(3, 8, 12))
    before_w, before_s = weight.detach().clone(), stack.detach().clone()
    optimizer = make_component("optimizer", "muon", lr=0.1, weight_decay=0.0, ns_dtype="float32").build(
        [("blocks.0.attn.o_proj.weight", weight), ("blocks.0.moe.down", stack)])
    g_w, g_s = torch.randn(16, 8), torch.randn(3, 8, 12)
    weight.grad, stack.grad = g_w.clone(), g_s.clone()
    optimizer.step()
    mu = 0.95  # first step: buffer = g, Nesterov mixes g + mu * buffer
    expect_w = before_w - 0.1 * update_scale(16, 8, "rms") * newton_schulz((1 + mu) * g_w, dtype=torch.float32)
    expect_s = before_s - 0.1 * update_scale(8, 12, "rms") * newton_schulz((1 + mu) * g_s, dtype=torch.float32)
    assert torch.allclose(weight.detach(), expect_w, atol=1e-6)
    assert torch.allclose(stack.detach(), expect_s, atol=1e-6)


def test_gate_up_is_orthogonalised_as_its_two_halves():
    gate_up = torch.nn.Parameter(torch.zeros(2, 8, 12))
    optimizer = make_component("optimizer", "muon", lr=1.0, weight_decay=0.0, ns_dtype="float32",
                               nesterov=False, momentum=0.0).build([("blocks.0.moe.gate_up", gate_up)])
    g = torch.randn(2, 8, 12)
    gate_up.grad = g.clone()
    optimizer.step()
    scale = update_scale(8, 6, "rms")
    halves = torch.cat([newton_schulz(g[..., :6], dtype=torch.float32), newton_schulz(g[..., 6:], dtype=torch.float32)],
                       dim=-1)
    assert torch.allclose(-gate_up.detach(), scale * halves, atol=1e-6)


def test_muon_trains_the_model():
    model = make_component("model", "tiny-moe", **SMALL).build(seed=0)
    from .muon_ranks import batch, loss_of

    ids = batch(model.vocab_size)
    before = loss_of(model, ids).item()
    train(model, optimizer_for(model, "muon", "all_to_all"), steps=10)
    assert loss_of(model, ids).item() < before - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["all_to_all", "round_robin"])
def test_distributed_muon_matches_one_process(tmp_path, world, strategy):
    # One thread, like every rank: with two, a CPU reduction may add in another order now and then,
    # and a last-bit difference can flip a near-tied top-k routing decision within three steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = make_component("model", "tiny-moe", **SMALL).build(seed=0)
        train(reference, optimizer_for(reference, "muon", strategy), steps=3)
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "ranks.pt"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
         str(HERE / "muon_ranks.py"), str(out), strategy, "3"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    expected = reference.state_dict()
    assert saved["state"].keys() == expected.keys()
    worst = max((saved["state"][k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-5, worst
    # Gathered: per block q, k, v, o and the router (10 matrices); expert stacks are sharded along their
    # experts and never leave their rank. all_to_all: two collectives a step; round_robin: two per matrix.
    per_step = 2 if strategy == "all_to_all" else 2 * 10
    assert saved["collectives"] == 3 * per_step
