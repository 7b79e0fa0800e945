"""``pg``: the plain policy gradient with no off-policy correction (the ablation's baseline).

Per token t (tensors ``[T]``)::

    loss = -sum_t mask_t * A_t * trainer_logprob_t / num_loss_tokens

It treats every sample as on-policy, however old the weights that sampled it.
"""

from pydantic import BaseModel, ConfigDict

from i3core.plugins.losses.common import masked_sum, prepare, ratio_metrics
from i3core.types import LossInputs, LossOutput


class PolicyGradient:
    """REINFORCE with group-relative advantages, no importance ratio."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        p = prepare(inputs)
        loss = masked_sum(-inputs.advantages * inputs.trainer_logprobs, p.loss_tokens) / p.normaliser
        return LossOutput(loss, ratio_metrics(p))
