"""Advantages and packing: A = R - mean, whole samples, positions reset, nothing truncated."""

import pytest
import torch

from i3core.errors import I3Error
from i3core.loop.packing import Sample, group_advantages, pack


def sample(n_prompt, n_completion, advantage=1.0, start=1):
    ids = list(range(start, start + n_prompt + n_completion))
    return Sample(ids, [False] * n_prompt + [True] * n_completion, [0.0] * n_prompt + [-0.5] * n_completion,
                  [-1] * n_prompt + [3] * n_completion, advantage)


def test_group_advantages_subtract_the_mean_without_std():
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]


def test_pack_places_whole_samples_and_resets_positions():
    samples = [sample(2, 3, 1.0, 10), sample(1, 2, -1.0, 20), sample(3, 4, 0.5, 30)]
    batch = pack(samples, seq_len=10)
    assert batch.input_ids.shape == (2, 10) and batch.num_samples == 3
    # every token of every sample appears once, in order, with its own positions
    for index, s in enumerate(samples):
        where = batch.sequence_ids == index
        assert where.sum() == len(s.token_ids)
        assert batch.input_ids[where].tolist() == s.token_ids
        assert batch.position_ids[where].tolist() == list(range(len(s.token_ids)))
        assert batch.loss_mask[where].tolist() == s.loss_mask
        assert torch.all(batch.advantages[where] == s.advantage)
    assert batch.num_loss_tokens == 9
    assert not batch.loss_mask[batch.sequence_ids == 3].any()  # padding


def test_a_sample_longer_than_a_row_is_an_error_not_a_truncation():
    with pytest.raises(I3Error, match="does not fit trainer.seq_len = 4"):
        pack([sample(2, 3)], seq_len=4)


def test_logprobs_of_the_loss_tokens_alone_equal_those_of_every_token(builtins):
    """The trainer runs the LM head on the loss tokens only (``where``): their logprobs and gradients are the ones of
    the whole-row computation, every other entry is 0."""
    import random

    from i3core.loop.trainer import token_logprobs
    from i3core.testing import make_component

    model = make_component("model", "tiny-moe", plugins=builtins).build(0)
    rng = random.Random(0)
    samples = []
    for _ in range(12):
        n_prompt, n_completion = rng.randint(3, 9), rng.randint(1, 6)
        samples.append(sample(n_prompt, n_completion, start=rng.randint(1, 200)))
    batch = pack(samples, seq_len=48)
    mask = batch.loss_mask
    every = token_logprobs(model, batch.input_ids, batch.position_ids, chunk=7)
    alone = token_logprobs(model, batch.input_ids, batch.position_ids, chunk=7, where=mask)
    assert torch.equal(every[mask], alone[mask]) and not alone[~mask].any()
    params = list(model.parameters())
    for got, want in zip(torch.autograd.grad(alone[mask].sum(), params), torch.autograd.grad(every[mask].sum(), params)):
        assert torch.allclose(got, want, atol=1e-5)
    nothing = token_logprobs(model, batch.input_ids, batch.position_ids, chunk=7, where=torch.zeros_like(mask))
    assert not nothing.any() and nothing.requires_grad  # the head stays in the graph (FSDP2 ranks reduce its grads)
