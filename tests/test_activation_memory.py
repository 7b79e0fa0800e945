"""Activation checkpointing and offloading are exact; the FLOPs model counts what the model computes."""

import pytest
import torch

from i3core.loop.perf import SavedActivations, matmul_peak_flops
from i3core.testing import make_component
from i3core.loop.trainer import token_logprobs

SMALL = {"hidden_size": 64, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the trainer runs by default: with two, a CPU reduction may add in either
    order now and then (seen: 1 plain run in 10 differing from another plain run in its last bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step(mode: str):
    model = make_component("model", "tiny-moe", **SMALL).build(seed=0)
    model.activation_checkpointing = mode == "checkpoint"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (3, 40), generator=generator)
    positions = torch.cat([torch.arange(25), torch.arange(15)]).expand(3, -1)  # two packed samples a row
    with SavedActivations(model, offload=mode == "offload") as saved:
        logprobs = token_logprobs(model, ids, positions, chunk=32)
    loss = -logprobs.sum() / logprobs.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved.bytes


@pytest.mark.parametrize("mode", ["checkpoint", "offload"])
def test_the_memory_levers_are_bit_identical_to_keeping_activations(mode):
    loss, grads, kept = step("keep")
    other_loss, other_grads, other_bytes = step(mode)
    assert torch.equal(loss, other_loss)
    assert grads.keys() == other_grads.keys()
    assert all(torch.equal(grads[n], other_grads[n]) for n in grads), [n for n in grads if not torch.equal(grads[n], other_grads[n])]
    if mode == "checkpoint":
        assert other_bytes < kept / 2, (other_bytes, kept)  # only each block's input is kept
    else:
        assert other_bytes == kept  # the same activations, kept in host memory (already there on a CPU)


def test_the_trainer_turns_checkpointing_on(builtins, tmp_path):
    from i3core.config import validate
    from i3core.loop.trainer import Trainer

    config = validate({"run": {"output_dir": str(tmp_path)}, "model": {"use": "tiny-moe", **SMALL},
                       "env": {"use": "reverse-text"}, "weight_sync": {"use": "filesystem"},
                       "trainer": {"activation_memory": "checkpoint"}}, builtins)
    assert Trainer(config).model.activation_checkpointing is True


def test_train_flops_by_hand():
    component = make_component("model", "tiny-moe", **SMALL)
    model = component.build(seed=0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    real = torch.tensor([[True, True, True, True, True, False]])  # the last token is padding
    h, q, kv, inter, experts, top, layers, vocab = 64, 2 * 64, 64, 32, 4, 2, 3, model.vocab_size
    per_layer = h * q + 2 * h * kv + q * h + h * experts + top * 3 * h * inter
    matrices = layers * per_layer + h * vocab
    context = (1 + 2 + 3) + (1 + 2)
    expected = 3 * (2 * matrices * 5 + 4 * layers * q * context)
    assert component.train_flops(model, positions, real) == expected


def test_matmul_peak_is_a_measured_positive_rate():
    peak = matmul_peak_flops(torch.device("cpu"), size=256, seconds=0.05)
    assert 1e6 < peak < 1e14
