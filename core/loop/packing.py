"""From scored rollouts to a packed :class:`TrainBatch`: advantages, then first-fit packing.

Advantages are group-relative without a std normaliser (INTELLECT-3's
choice): ``A_i = R_i - mean(R_group)``, the same on every token of a rollout
(episode-level credit). Turn-level credit (a rollout with ``credit = "turn"``)
gives the tokens of turn ``t`` the return from that turn on, ``G_t = sum of
turn_rewards[t:]`` (undiscounted), minus the mean ``G_t`` of the group's
rollouts that reached turn ``t``; a one-turn rollout gets the episode advantage.
Packing places whole samples into rows
of ``seq_len`` tokens, longest first, never truncating; positions restart at
0 for each sample so packed samples never attend to each other; with
``share_prompts`` the completions of one prompt share one copy of it (prefix
trees, :mod:`i3core.packed`).
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


def prompt_trees(samples: list[Sample], seq_len: int) -> list[tuple[int, list[int]]]:
    """The samples as prefix trees ``(shared, members)``: the samples of one prompt (the same tokens before their
    first loss token; ``shared`` of them) share one copy of it, as many to a tree as fit ``seq_len`` tokens."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        first = next((t for t, loss in enumerate(sample.loss_mask) if loss), len(sample.loss_mask))
        by_prompt.setdefault(tuple(sample.token_ids[:first]), []).append(index)
    trees = []
    for prompt, members in by_prompt.items():
        shared, tree, size = len(prompt), [], len(prompt)
        for index in members:
            extra = len(samples[index].token_ids) - shared
            if tree and size + extra > seq_len:
                trees.append((shared, tree))
                tree, size = [], shared
            tree.append(index)
            size += extra
        trees.append((shared, tree))
    return trees


def pack(samples: list[Sample], seq_len: int, share_prompts: bool = False) -> TrainBatch:
    """First-fit-decreasing packing of whole samples into rows of ``seq_len`` tokens.

    ``share_prompts``: the samples of one prompt are packed as prefix trees (:func:`prompt_trees`, the layout of
    :mod:`i3core.packed`): the prompt once, the first completion after it, every other completion after that
    with its positions continuing from the prompt's. A group of 8 short completions of one prompt then costs the
    trainer one prompt instead of 8; the logprobs are the same numbers.

    :raises I3Error: a sample longer than ``seq_len`` (never truncated).
    """
    too_long = [len(s.token_ids) for s in samples if len(s.token_ids) > seq_len]
    if too_long:
        raise I3Error(f"a sample of {max(too_long)} tokens does not fit trainer.seq_len = {seq_len}")
    units = prompt_trees(samples, seq_len) if share_prompts else [(0, [i]) for i in range(len(samples))]

    def length(unit: tuple[int, list[int]]) -> int:
        shared, members = unit
        return shared + sum(len(samples[i].token_ids) - shared for i in members)

    rows: list[list[tuple[int, list[int]]]] = []
    free: list[int] = []
    for unit in sorted(units, key=lambda u: -length(u)):
        n = length(unit)
        for r, space in enumerate(free):
            if space >= n:
                rows[r].append(unit)
                free[r] -= n
                break
        else:
            rows.append([unit])
            free.append(seq_len - n)
    # Each field's rows are built as Python lists and become one tensor each: a tensor per sample and field cost
    # the orchestrator several ms a quickstart step, on the event loop the engine's thread shares the GIL with.
    fields = {"input_ids": [], "position_ids": [], "loss_mask": [], "advantages": [], "inference_logprobs": [],
              "sequence_ids": [], "versions": []}
    for units_in_row in rows:
        row = {name: [] for name in fields}
        for shared, members in units_in_row:
            for k, index in enumerate(members):
                s = samples[index]
                skip = 0 if k == 0 else shared  # the first member carries the shared prompt, the others follow it
                n = len(s.token_ids) - skip
                row["input_ids"] += s.token_ids[skip:]
                row["position_ids"] += range(skip, skip + n)
                row["loss_mask"] += s.loss_mask[skip:]
                row["advantages"] += ([float(s.advantage)] * n if s.token_advantages is None
                                      else s.token_advantages[skip:])
                row["inference_logprobs"] += s.inference_logprobs[skip:]
                row["sequence_ids"] += [index] * n
                row["versions"] += s.versions[skip:]
        pad = seq_len - len(row["input_ids"])
        for name, value in (("input_ids", PAD_ID), ("loss_mask", False), ("advantages", 0.0),
                            ("inference_logprobs", 0.0), ("sequence_ids", len(samples)), ("versions", -1)):
            row[name] += [value] * pad  # padding: one extra, empty sample; positions restart at 0
        row["position_ids"] += range(pad)
        for name in fields:
            fields[name].append(row[name])
    dtypes = {"input_ids": torch.long, "position_ids": torch.long, "loss_mask": torch.bool,
              "advantages": torch.float32, "inference_logprobs": torch.float32, "sequence_ids": torch.long,
              "versions": torch.long}
    input_ids, position_ids, loss_mask, advantages, inference_logprobs, sequence_ids, versions = (
        torch.tensor(fields[name], dtype=dtypes[name]).reshape(len(rows), seq_len) for name in fields)
    return TrainBatch(input_ids, position_ids, loss_mask, advantages, inference_logprobs, sequence_ids, versions,
                      num_samples=len(samples))


def concat(batches: list[TrainBatch]) -> TrainBatch:
    """The rows of ``batches`` in order as one batch: samples numbered on, padding still one extra sample."""
    total = sum(b.num_samples for b in batches)
    sequence_ids, offset = [], 0
    for b in batches:
        sequence_ids.append(torch.where(b.sequence_ids == b.num_samples, total, b.sequence_ids + offset))
        offset += b.num_samples
    fields = {name: torch.cat([getattr(b, name) for b in batches]) for name in TrainBatch.ROWS}
    return TrainBatch(**{**fields, "sequence_ids": torch.cat(sequence_ids)}, num_samples=total)
