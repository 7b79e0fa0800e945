"""GSPO: a sequence-level importance ratio with PPO clipping at the sequence level.

Per sample i with loss tokens ``T_i`` (tensors ``[T]``, reduced per sample)::

    s_i  = exp(mean_{t in T_i} (trainer_logprob_t - inference_logprob_t))
    l_i  = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss = sum_i |T_i| * l_i / num_loss_tokens

The reduction weights each sample by its loss-token count so the loss stays
additive over micro-batches and ranks with one global normaliser (the GSPO
paper averages over sequences instead). The defaults are the paper's
(3e-4, 4e-4): sequence ratios stay much closer to 1 than token ratios.
"""

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core.plugins.losses.common import per_sample_mean, prepare, ratio_metrics
from i3core.types import LossInputs, LossOutput


class Gspo:
    """Group sequence policy optimisation."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        eps_low: float = Field(3e-4, ge=0, le=1, description="Lower clip of the sequence ratio at 1 - eps_low.")
        eps_high: float = Field(4e-4, ge=0, description="Upper clip of the sequence ratio at 1 + eps_high.")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        p = prepare(inputs)
        keep = p.loss_tokens
        ids = inputs.sequence_ids
        log_s = per_sample_mean(p.log_ratio, keep, ids)
        s = torch.exp(log_s)
        counts = torch.zeros_like(log_s).index_add(0, ids, keep.to(log_s.dtype))
        advantage = per_sample_mean(inputs.advantages, keep, ids)
        clipped_s = s.clamp(1 - self.config.eps_low, 1 + self.config.eps_high)
        objective = torch.minimum(s * advantage, clipped_s * advantage)
        present = counts > 0
        loss = -torch.where(present, counts * objective, torch.zeros_like(objective)).sum() / p.normaliser
        clipped = present & ((s * advantage) > (clipped_s * advantage)).detach()
        metrics = {
            "loss/clipped_sample_frac": float(clipped.sum()) / max(int(present.sum()), 1),
            "loss/sequence_ratio_mean": float(s.detach()[present].mean()) if present.any() else 1.0,
            **ratio_metrics(p),
        }
        return LossOutput(loss, metrics)
