"""An example i3core plugin: one loss and one environment, registered through hooks."""

import random

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core import hookimpl
from i3core.plugins.envs.base import SingleTurnConfig, SingleTurnEnv
from i3core.types import Example, LossInputs, LossOutput


class Reinforce:
    """REINFORCE without importance correction: ``-sum_t mask_t * A_t * logp_t / N`` over ``[T]`` tokens."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        scale: float = Field(1.0, gt=0, description="Multiplies the loss.")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.loss_mask.bool()
        per_token = torch.where(mask, inputs.advantages * inputs.trainer_logprobs, 0.0)
        loss = -self.config.scale * per_token.sum() / inputs.normaliser()
        return LossOutput(loss=loss, metrics={"reinforce/loss_tokens": float(mask.sum())})


class CountLetters(SingleTurnEnv):
    """Count how often a letter occurs in a short string; reward 1 for the exact count."""

    class Config(SingleTurnConfig):
        alphabet: str = Field("abc", min_length=1, description="Letters the strings are made of.")
        max_len: int = Field(8, ge=1, description="Longest string.")

    def make_example(self, rng: random.Random, index: int) -> Example:
        text = "".join(rng.choice(self.config.alphabet) for _ in range(rng.randint(1, self.config.max_len)))
        letter = rng.choice(self.config.alphabet)
        return Example(id=f"count-{index}", prompt=f"how many {letter} in {text}?", answer=str(text.count(letter)))

    def demonstration(self, example: Example) -> str:
        return example.answer + "\n"

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip().split("\n", 1)[0] == example.answer else 0.0


@hookimpl
def i3_register_losses(register):
    register("reinforce", Reinforce)


@hookimpl
def i3_register_envs(register):
    register("count-letters", CountLetters)
