"""Single-turn environments: a seeded synthetic dataset, one completion per prompt, a reward.

Subclasses define ``Config`` (extending :class:`SingleTurnConfig`),
``make_example(rng, index)``, ``demonstration(example)`` (the SFT target) and
``score(completion, example)``.
"""

import random
from abc import ABC, abstractmethod

from pydantic import BaseModel, ConfigDict, Field

from i3core.protocols import InferenceClient
from i3core.types import Example, Rollout


class SingleTurnConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_examples: int = Field(1000, ge=1, description="Size of the generated dataset.")
    seed: int = Field(0, description="Seed of the generated dataset.")
    max_tokens: int = Field(32, ge=1, description="Completion length limit.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")


class SingleTurnEnv(ABC):
    """One prompt in, one completion out, scored by :meth:`score`."""

    Config = SingleTurnConfig
    stop_text = "\n"
    """Generation stops at this text; every demonstration ends with it."""

    def __init__(self, config: SingleTurnConfig):
        self.config = config
        self._examples: list[Example] | None = None

    def examples(self) -> list[Example]:
        if self._examples is None:
            rng = random.Random(self.config.seed)
            self._examples = [self.make_example(rng, i) for i in range(self.config.num_examples)]
        return self._examples

    @abstractmethod
    def make_example(self, rng: random.Random, index: int) -> Example:
        """The example at ``index`` of the dataset, drawn from ``rng``."""

    @abstractmethod
    def demonstration(self, example: Example) -> str:
        """The reference completion, the SFT target."""

    @abstractmethod
    def score(self, completion: str, example: Example) -> float:
        """The reward of ``completion`` for ``example``, in [0, 1]."""

    async def rollout(self, client: InferenceClient, example: Example) -> Rollout:
        completion = await client.complete(
            example.prompt, max_tokens=self.config.max_tokens, temperature=self.config.temperature
        )
        n = len(completion.token_ids)
        return Rollout(
            example=example,
            prompt_ids=completion.prompt_ids,
            completion_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            completion_versions=completion.versions,
            completion_mask=[True] * n,
            completion_text=completion.text,
            reward=self.score(completion.text, example),
        )
