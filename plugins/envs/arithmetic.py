"""``arithmetic``: small sums such as ``17+5=``; reward 1 for the exact answer, else 0."""

import random

from pydantic import Field

from i3core.plugins.envs.base import SingleTurnConfig, SingleTurnEnv
from i3core.types import Example

ANSWER_END = "\n"
"""Completions end their answer with a newline (also the SFT demonstrations)."""


class Arithmetic(SingleTurnEnv):
    """Add small non-negative integers."""

    class Config(SingleTurnConfig):
        max_operand: int = Field(20, ge=1, description="Operands are drawn from 0..max_operand.")
        terms: int = Field(2, ge=2, le=6, description="How many numbers are added.")
        max_tokens: int = Field(8, ge=1, description="Completion length limit.")

    def make_example(self, rng: random.Random, index: int) -> Example:
        numbers = [rng.randint(0, self.config.max_operand) for _ in range(self.config.terms)]
        return Example(id=f"arithmetic-{index}", prompt="+".join(map(str, numbers)) + "=", answer=str(sum(numbers)))

    def demonstration(self, example: Example) -> str:
        return example.answer + ANSWER_END

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if completion.split(ANSWER_END, 1)[0].strip() == example.answer else 0.0
