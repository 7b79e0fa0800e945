"""CISPO: a clipped importance weight with stop-gradient on every token; no token is dropped.

Per token t (tensors ``[T]``)::

    w_t  = sg(clip(r_t, 1 - eps_low, 1 + eps_high))
    loss = -sum_t mask_t * w_t * A_t * trainer_logprob_t / num_loss_tokens

Unlike PPO/GRPO, clipping changes the token's weight but never zeroes its
gradient: the gradient on a loss token's logprob is ``-w_t * A_t / N``.
"""

from pydantic import BaseModel, ConfigDict, Field

from i3core.plugins.losses.common import masked_sum, prepare, ratio_metrics
from i3core.types import LossInputs, LossOutput


class Cispo:
    """Clipped IS-weight policy optimisation."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        eps_low: float = Field(0.2, ge=0, le=1, description="Weights are clipped below at 1 - eps_low.")
        eps_high: float = Field(0.28, ge=0, description="Weights are clipped above at 1 + eps_high.")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        p = prepare(inputs)
        weight = p.ratio.clamp(1 - self.config.eps_low, 1 + self.config.eps_high)
        loss = masked_sum(-weight * inputs.advantages * inputs.trainer_logprobs, p.loss_tokens) / p.normaliser
        clipped = p.loss_tokens & (weight != p.ratio)
        n = max(int(p.loss_tokens.sum()), 1)
        return LossOutput(loss, {"loss/clipped_frac": float(clipped.sum()) / n, **ratio_metrics(p)})
