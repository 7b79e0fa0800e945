"""IcePop: masked token-level importance sampling (INTELLECT-3's loss).

How it differs from PPO/GRPO: the importance ratio is *masked*, never clipped
(a token outside ``[mask_low, mask_high]`` contributes nothing), there is no KL
term, and a sample with any loss token whose ratio is below
``rollout_min_ratio`` is dropped whole.

Per token t (all tensors ``[T]``)::

    r_t  = exp(trainer_logprob_t - inference_logprob_t)
    keep = loss_mask_t & mask_low <= r_t <= mask_high & sample not killed
    loss = -sum_t keep_t * r_t * A_t / num_loss_tokens

so the gradient on a kept token's trainer logprob is ``-r_t * A_t / N`` and
zero elsewhere. Tokens with a non-finite inference logprob are dropped from
the loss (and from the default normaliser) and counted.
"""

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from i3core.plugins.losses.common import masked_sum, prepare, ratio_metrics
from i3core.types import LossInputs, LossOutput


class IcePop:
    """IcePop masked importance sampling."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        mask_low: float = Field(0.5, gt=0, description="Tokens with ratio below this are masked.")
        mask_high: float = Field(5.0, gt=0, description="Tokens with ratio above this are masked.")
        rollout_min_ratio: float = Field(
            1e-5, ge=0, description="A sample with any loss token below this ratio is masked whole."
        )

        @model_validator(mode="after")
        def _bounds(self):
            if self.mask_low > self.mask_high:
                raise ValueError(f"mask_low ({self.mask_low}) must not exceed mask_high ({self.mask_high})")
            return self

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        cfg = self.config
        p = prepare(inputs)
        ratio = p.ratio
        low = p.loss_tokens & (ratio < cfg.mask_low)
        high = p.loss_tokens & (ratio > cfg.mask_high)
        killed = _killed_samples(p.loss_tokens & (ratio < cfg.rollout_min_ratio), inputs.sequence_ids)
        keep = p.loss_tokens & ~low & ~high & ~killed[inputs.sequence_ids]

        # exp of 0 outside `keep`, so masked tokens (whose ratio may be inf) give neither NaN nor gradient.
        kept_ratio = torch.exp(torch.where(keep, p.log_ratio, torch.zeros_like(p.log_ratio)))
        loss = masked_sum(-kept_ratio * inputs.advantages, keep) / p.normaliser

        n_loss = max(int(p.loss_tokens.sum()), 1)
        present = torch.unique(inputs.sequence_ids[inputs.loss_mask.bool()])
        metrics = {
            "loss/masked_low_frac": float(low.sum()) / n_loss,
            "loss/masked_high_frac": float(high.sum()) / n_loss,
            "loss/masked_sample_frac": float(killed[present].float().mean()) if len(present) else 0.0,
            **ratio_metrics(p),
        }
        return LossOutput(loss=loss, metrics=metrics)


def _killed_samples(bad_tokens: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """``[num_samples]`` bool: samples holding at least one bad token."""
    num_samples = int(sequence_ids.max()) + 1 if len(sequence_ids) else 0
    counts = torch.zeros(num_samples, dtype=torch.long, device=sequence_ids.device)
    counts.index_add_(0, sequence_ids[bad_tokens], torch.ones_like(sequence_ids[bad_tokens]))
    return counts > 0
