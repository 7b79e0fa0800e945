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


# -- prefix trees (share_prompts) ------------------------------------------------------------------------------------


def test_the_layout_reads_trees_from_positions():
    """The module docstring's row: a prompt p, then completions a, b and c, then a second sample."""
    from i3core.packed import attention_mask, has_branches, predecessors

    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 3, 0, 1]])
    sees = attention_mask(positions)[0, 0]
    assert [torch.nonzero(sees[i]).flatten().tolist() for i in range(11)] == [
        [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4],  # the trunk: prompt and first completion
        [0, 1, 2, 5], [0, 1, 2, 5, 6], [0, 1, 2, 5, 6, 7],  # b: the prompt and itself, not a
        [0, 1, 2, 8],  # c
        [9], [9, 10]]  # the next sample sees nothing before it
    assert predecessors(positions)[0].tolist() == [-1, 0, 1, 2, 3, 2, 5, 6, 2, -1, 9]
    assert has_branches(positions) and not has_branches(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    plain = torch.tensor([[0, 1, 2, 0, 1, 0]])  # without branches: plain packed causal masking
    assert torch.equal(attention_mask(plain)[0, 0], torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0],
         [0, 0, 0, 0, 0, 1]], dtype=torch.bool))


def groups_of(prompts: int, size: int, seed: int = 0, vocab: int = 250) -> list[Sample]:
    """``prompts`` groups of ``size`` samples, one prompt each (5-19 tokens), completions of 1-11 tokens, token
    ids under ``vocab``."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(5, 20, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(size):
            n = int(torch.randint(1, 12, (1,), generator=gen))
            completion = torch.randint(1, vocab, (n,), generator=gen).tolist()
            samples.append(Sample(prompt + completion, [False] * len(prompt) + [True] * n,
                                  [0.0] * len(prompt) + torch.rand(n, generator=gen).neg().tolist(),
                                  [-1] * len(prompt) + [2] * n, float(torch.rand(1, generator=gen))))
    return samples


def test_prompt_trees_hold_every_loss_token_once_with_its_own_values():
    samples = groups_of(8, 8)
    flat, tree = pack(samples, seq_len=256), pack(samples, seq_len=256, share_prompts=True)
    prompts = [len(samples[g * 8].token_ids) - sum(samples[g * 8].loss_mask) for g in range(8)]
    real = int((tree.sequence_ids < len(samples)).sum())
    assert real == sum(len(s.token_ids) for s in samples) - 7 * sum(prompts)  # one prompt copy per group, not 8
    assert tree.input_ids.shape[0] < flat.input_ids.shape[0]
    for index, s in enumerate(samples):
        for batch in (flat, tree):
            where = (batch.sequence_ids == index) & batch.loss_mask
            completion = [t for t, loss in zip(s.token_ids, s.loss_mask) if loss]
            assert batch.input_ids[where].tolist() == completion
            assert batch.inference_logprobs[where].tolist() == [x for x, loss in zip(s.inference_logprobs, s.loss_mask)
                                                                if loss]
            assert batch.versions[where].tolist() == [2] * len(completion)
            assert torch.all(batch.advantages[where] == s.advantage)
            # a completion's positions continue from its prompt in both layouts
            assert batch.position_ids[where].tolist() == list(range(len(s.token_ids) - len(completion),
                                                                    len(s.token_ids)))
    assert tree.num_loss_tokens == flat.num_loss_tokens


def test_a_group_too_long_for_one_row_becomes_several_trees_each_with_its_prompt():
    samples = groups_of(1, 8)
    prompt = len(samples[0].token_ids) - sum(samples[0].loss_mask)
    longest = max(len(s.token_ids) for s in samples)
    batch = pack(samples, seq_len=longest + 10, share_prompts=True)
    trees = int((batch.position_ids == 0).logical_and(batch.sequence_ids < 8).sum())
    assert trees > 1
    assert int((batch.sequence_ids < 8).sum()) == sum(len(s.token_ids) - prompt for s in samples) + trees * prompt


def tree_and_flat_logprobs(model, samples: list[Sample], seq_len: int = 256) -> float:
    """The largest |difference| between a loss token's logprob packed as prefix trees and packed side by side."""
    from i3core.loop.trainer import token_logprobs

    flat, tree = pack(samples, seq_len), pack(samples, seq_len, share_prompts=True)
    with torch.no_grad():
        a = token_logprobs(model, flat.input_ids, flat.position_ids, 32, where=flat.loss_mask)
        b = token_logprobs(model, tree.input_ids, tree.position_ids, 32, where=tree.loss_mask)
    worst = 0.0
    for index in range(len(samples)):
        x, y = a[(flat.sequence_ids == index) & flat.loss_mask], b[(tree.sequence_ids == index) & tree.loss_mask]
        assert len(x) == len(y) == sum(samples[index].loss_mask)
        worst = max(worst, float((x - y).abs().max()))
    return worst


def test_prefix_trees_give_tiny_moe_the_logprobs_of_samples_packed_apart():
    from i3core.testing import make_component

    model = make_component("model", "tiny-moe").build(seed=0).eval()
    assert tree_and_flat_logprobs(model, groups_of(8, 8)) < 1e-5
