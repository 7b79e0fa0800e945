"""From scored rollouts to a packed :class:`TrainBatch`: advantages, then first-fit packing.

Advantages are group-relative without a std normaliser (INTELLECT-3's
choice): ``A_i = R_i - mean(R_group)``, the same on every token of a rollout
(episode-level credit). Turn-level credit (a rollout with ``credit = "turn"``)
gives the tokens of turn ``t`` the return from that turn on, ``G_t = sum of
turn_rewards[t:]`` (undiscounted), minus the mean ``G_t`` of the group's
rollouts that reached turn ``t``; a one-turn rollout gets the episode advantage.
Packing places whole samples into rows
of ``seq_len`` tokens, longest first, never truncating; positions restart at
0 for each sample so packed samples never attend to each other.
"""

from dataclasses import dataclass

import torch

from i3core.errors import I3Error
from i3core.types import Rollout, TrainBatch

PAD_ID = 0
"""Padding token id; padding is never a loss token, so its value does not matter."""


@dataclass
class Sample:
    """One sequence to train on, every list one entry per token."""

    token_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    versions: list[int]
    advantage: float
    token_advantages: list[float] | None = None
    """Per-token advantages (turn-level credit); None: ``advantage`` on every token."""


def group_advantages(rewards: list[float]) -> list[float]:
    """``R_i - mean(R)``, no division by the std."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def turn_returns(rollout: Rollout) -> list[float]:
    """``G_t``: the reward of turn ``t`` and every later turn; one turn holding all of ``reward`` if none are given.

    ``reward`` is the truth: whatever it holds beyond the turn rewards (a rubric's final score, a plugin's
    reshaping in ``i3_on_group_scored``) counts on the last turn, so ``G_0 == reward`` always.
    """
    rewards = list(rollout.turn_rewards) or [rollout.reward]
    rewards[-1] += rollout.reward - sum(rewards)
    return [sum(rewards[t:]) for t in range(len(rewards))]


def assign_advantages(rollouts: list[Rollout]) -> None:
    """Set ``advantage`` (episode level) on every rollout of one group, and
    ``completion_advantages`` (turn level) on those with ``credit = "turn"``."""
    for rollout, advantage in zip(rollouts, group_advantages([r.reward for r in rollouts])):
        rollout.advantage = advantage
    returns = [turn_returns(r) for r in rollouts]
    baseline: dict[int, list[float]] = {}
    for g in returns:
        for t, value in enumerate(g):
            baseline.setdefault(t, []).append(value)
    mean = {t: sum(values) / len(values) for t, values in baseline.items()}
    for rollout, g in zip(rollouts, returns):
        if rollout.credit != "turn":
            continue
        per_turn = [value - mean[t] for t, value in enumerate(g)]
        turns = rollout.completion_turns or [0] * len(rollout.completion_ids)
        last = len(per_turn) - 1
        rollout.completion_advantages = [per_turn[min(t, last)] for t in turns]


def sample_from_rollout(rollout: Rollout) -> Sample:
    n_prompt = len(rollout.prompt_ids)
    token_advantages = None
    if rollout.completion_advantages is not None:
        token_advantages = [0.0] * n_prompt + list(rollout.completion_advantages)
    return Sample(
        token_ids=rollout.prompt_ids + rollout.completion_ids,
        loss_mask=[False] * n_prompt + list(rollout.completion_mask),
        inference_logprobs=[0.0] * n_prompt + list(rollout.completion_logprobs),
        versions=[-1] * n_prompt + list(rollout.completion_versions),
        advantage=rollout.advantage,
        token_advantages=token_advantages,
    )


def pack(samples: list[Sample], seq_len: int) -> TrainBatch:
    """First-fit-decreasing packing of whole samples into rows of ``seq_len`` tokens.

    :raises I3Error: a sample longer than ``seq_len`` (never truncated).
    """
    too_long = [len(s.token_ids) for s in samples if len(s.token_ids) > seq_len]
    if too_long:
        raise I3Error(f"a sample of {max(too_long)} tokens does not fit trainer.seq_len = {seq_len}")
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids)):
        n = len(samples[index].token_ids)
        for r, space in enumerate(free):
            if space >= n:
                rows[r].append(index)
                free[r] -= n
                break
        else:
            rows.append([index])
            free.append(seq_len - n)
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, PAD_ID, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    advantages = torch.zeros(shape)
    inference_logprobs = torch.zeros(shape)
    sequence_ids = torch.full(shape, len(samples), dtype=torch.long)  # padding: one extra, empty sample
    versions = torch.full(shape, -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for index in members:
            s = samples[index]
            n = len(s.token_ids)
            span = slice(at, at + n)
            input_ids[r, span] = torch.tensor(s.token_ids)
            position_ids[r, span] = torch.arange(n)
            loss_mask[r, span] = torch.tensor(s.loss_mask)
            advantages[r, span] = s.advantage if s.token_advantages is None else torch.tensor(s.token_advantages)
            inference_logprobs[r, span] = torch.tensor(s.inference_logprobs)
            sequence_ids[r, span] = index
            versions[r, span] = torch.tensor(s.versions)
            at += n
        position_ids[r, at:] = torch.arange(seq_len - at)
    return TrainBatch(input_ids, position_ids, loss_mask, advantages, inference_logprobs, sequence_ids, versions,
                      num_samples=len(samples))
