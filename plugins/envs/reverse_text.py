"""``reverse-text``: reverse a short lowercase string; reward = similarity to the reversal, in [0, 1]."""

import difflib
import random
import string

from pydantic import Field, model_validator

from i3core.plugins.envs.base import SingleTurnConfig, SingleTurnEnv
from i3core.types import Example

ANSWER_END = "\n"


class ReverseText(SingleTurnEnv):
    """Reverse a string of ``min_len..max_len`` letters."""

    class Config(SingleTurnConfig):
        min_len: int = Field(3, ge=1, description="Shortest string.")
        max_len: int = Field(8, ge=1, description="Longest string.")
        alphabet: str = Field(string.ascii_lowercase[:8], min_length=2, description="Letters drawn from.")
        max_tokens: int = Field(12, ge=1, description="Completion length limit.")

        @model_validator(mode="after")
        def _lengths(self):
            if self.min_len > self.max_len:
                raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
            return self

    def make_example(self, rng: random.Random, index: int) -> Example:
        n = rng.randint(self.config.min_len, self.config.max_len)
        text = "".join(rng.choice(self.config.alphabet) for _ in range(n))
        return Example(id=f"reverse-{index}", prompt=f"reverse {text}:", answer=text[::-1])

    def demonstration(self, example: Example) -> str:
        return example.answer + ANSWER_END

    def score(self, completion: str, example: Example) -> float:
        answer = completion.split(ANSWER_END, 1)[0].strip()
        return difflib.SequenceMatcher(None, answer, example.answer).ratio()
