"""The packed-row layout: which tokens of a training row see which, read from ``position_ids`` alone.

A trainer batch is ``[R, S]`` rows of samples packed side by side; each sample's positions count up from 0, so a
position of 0 starts a sample and samples never see each other. A sample may also be a **prefix tree**: the
completions of one prompt share a single copy of it (the trunk: the prompt, then the first completion), and every
further completion (a branch) follows with its positions starting again where the prompt ended::

    tokens     p0 p1 p2 a0 a1 b0 b1 b2 c0
    positions   0  1  2  3  4  3  4  5  3

A branch token sees the trunk's tokens before its branch's first position (the prompt, not the first completion)
and the earlier tokens of its own branch; it is predicted by the token before it in its branch, the first one by
the prompt's last token. Rows without branches are plain causal packing, so a model that builds its mask here
trains either layout; logprobs are the same numbers in both (``tests/test_packing.py``).
"""

import torch


def _segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: its segment id (a run of consecutive positions), the position its segment starts at, and
    its sample id (a run that starts at position 0)."""
    pos = position_ids
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    segment = new.long().cumsum(-1)
    index = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    start = torch.where(new, index, torch.zeros_like(index)).cummax(-1).values
    return segment, pos.gather(-1, start), (pos == 0).long().cumsum(-1)


def has_branches(position_ids: torch.Tensor) -> bool:
    """Whether any row holds a prefix tree (a run of positions that starts above 0)."""
    return bool((_segments(position_ids)[1] > 0).any())


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[R, 1, S, S]`` bool: token i sees token j (see the module docstring); every token sees itself."""
    segment, start, sample = _segments(position_ids)
    pos = position_ids
    seq = pos.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=pos.device).tril()
    same_sample = sample[:, :, None] == sample[:, None, :]
    same_segment = segment[:, :, None] == segment[:, None, :]
    trunk_before = (start[:, None, :] == 0) & (pos[:, None, :] < start[:, :, None])
    return (causal & same_sample & (same_segment | trunk_before))[:, None]


def predecessors(position_ids: torch.Tensor) -> torch.Tensor:
    """``[R, S]`` long: the index in its row of the token whose hidden state predicts each token; -1 where
    nothing does (a sample's first token)."""
    _, start, _ = _segments(position_ids)
    pos = position_ids
    index = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    before = torch.where(pos == 0, -1, index - 1)
    branch = (start > 0) & (pos == start)
    if not branch.any():
        return before
    # A branch's first token at position P is predicted by the trunk's token at position P - 1: the trunk starts
    # its sample at position 0 and counts up, so that token stands P - 1 places after the sample's first.
    first = torch.where(pos == 0, index, torch.zeros_like(index)).cummax(-1).values
    parent = (first + pos - 1).clamp(0, pos.shape[-1] - 1)
    found = (parent < index) & (pos.gather(-1, parent) == pos - 1) & (first.gather(-1, parent) == first)
    return torch.where(branch, torch.where(found, parent, -1), before)
