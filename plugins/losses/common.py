"""What every importance-sampling loss shares: loss tokens, safe log-ratios, the normaliser, metrics."""

from dataclasses import dataclass

import torch

from i3core.types import LossInputs


@dataclass
class Prepared:
    """Per-token views of one :class:`LossInputs`, all ``[T]``.

    :ivar loss_tokens: model tokens with a finite inference logprob.
    :ivar log_ratio: ``trainer - inference`` with gradient through the trainer
        side; 0 on non-finite tokens, so no NaN reaches the graph.
    :ivar ratio: ``exp(log_ratio)``, detached.
    :ivar normaliser: ``num_loss_tokens`` when given, else the count of loss tokens (at least 1).
    """

    loss_tokens: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    normaliser: torch.Tensor
    nonfinite: int


def prepare(inputs: LossInputs) -> Prepared:
    trainer_lp = inputs.trainer_logprobs
    finite = torch.isfinite(inputs.inference_logprobs)
    model_tokens = inputs.loss_mask.bool()
    loss_tokens = model_tokens & finite
    inference_lp = torch.where(finite, inputs.inference_logprobs, trainer_lp.detach())
    log_ratio = trainer_lp - inference_lp
    normaliser = (
        loss_tokens.sum().clamp_min(1).to(trainer_lp.dtype) if inputs.num_loss_tokens is None else inputs.normaliser()
    )
    return Prepared(loss_tokens, log_ratio, log_ratio.detach().exp(), normaliser, int((model_tokens & ~finite).sum()))


def ratio_metrics(p: Prepared) -> dict[str, float]:
    """Mean/max ratio and the k3 estimate of KL(inference || trainer) over loss tokens."""
    r = p.ratio[p.loss_tokens]
    if not len(r):
        return {"loss/ratio_mean": 1.0, "loss/ratio_max": 1.0, "mismatch/kl": 0.0,
                "loss/nonfinite_tokens": float(p.nonfinite)}
    log_r = p.log_ratio.detach()[p.loss_tokens]
    return {
        "loss/ratio_mean": float(r.mean()),
        "loss/ratio_max": float(r.max()),
        "mismatch/kl": float((r - 1 - log_r).mean()),
        "loss/nonfinite_tokens": float(p.nonfinite),
    }


def masked_sum(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``sum(values[keep])`` that passes no gradient (and no NaN) through the dropped entries."""
    return torch.where(keep, values, torch.zeros_like(values)).sum()


def per_sample_mean(values: torch.Tensor, keep: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """``[num_samples]``: the mean of ``values`` over each sample's ``keep`` tokens (0 for none)."""
    num = int(sequence_ids.max()) + 1 if len(sequence_ids) else 0
    kept = torch.where(keep, values, torch.zeros_like(values))
    sums = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, kept)
    counts = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, keep.to(values.dtype))
    return sums / counts.clamp_min(1)
