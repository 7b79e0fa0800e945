"""GRPO's token-level PPO clip (no KL term; advantages are group-relative, computed upstream).

Per token t (tensors ``[T]``)::

    loss = -sum_t mask_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t) / num_loss_tokens

A token whose ratio is clipped on the side that the advantage pushes gets no
gradient; elsewhere the gradient on its logprob is ``-r_t * A_t / N``.
"""

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core.plugins.losses.common import masked_sum, prepare, ratio_metrics
from i3core.types import LossInputs, LossOutput


class Grpo:
    """Token-level PPO clipping."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip at 1 - eps_low.")
        eps_high: float = Field(0.2, ge=0, description="Upper clip at 1 + eps_high (0.28 is DAPO's clip-higher).")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        p = prepare(inputs)
        keep = p.loss_tokens
        ratio = torch.exp(torch.where(keep, p.log_ratio, torch.zeros_like(p.log_ratio)))
        clipped_ratio = ratio.clamp(1 - self.config.eps_low, 1 + self.config.eps_high)
        advantages = inputs.advantages
        objective = torch.minimum(ratio * advantages, clipped_ratio * advantages)
        loss = -masked_sum(objective, keep) / p.normaliser
        clipped = keep & ((ratio * advantages) > (clipped_ratio * advantages)).detach()
        n = max(int(keep.sum()), 1)
        return LossOutput(loss, {"loss/clipped_frac": float(clipped.sum()) / n, **ratio_metrics(p)})
