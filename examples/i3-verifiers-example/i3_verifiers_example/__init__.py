"""A verifiers 0.4 environment, as one publishes it on the Environments Hub: reverse a short lowercase string.

Install it (``pip install examples/i3-verifiers-example``) and train it with i3core:

    [env]
    use = "verifiers"
    id = "i3_verifiers_example"
    args = { num_tasks = 200 }

The reward is the similarity of the reply's first line to the reversal (difflib's ratio, in [0, 1]).
"""

import difflib
import random
import string

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    text: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        reply = (trace.messages[-1].content or "").strip().split("\n", 1)[0]
        return difflib.SequenceMatcher(None, reply, self.data.text[::-1]).ratio()

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.messages[-1].content or ""))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 100
    min_len: int = 3
    max_len: int = 5
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        texts = ["".join(rng.choice(string.ascii_lowercase[:6]) for _ in range(rng.randint(self.config.min_len,
                                                                                          self.config.max_len)))
                 for _ in range(self.config.num_tasks)]
        return [ReverseTask(ReverseData(prompt=f"reverse {text}", text=text), self.config.task) for text in texts]


__all__ = ["ReverseTaskset"]
