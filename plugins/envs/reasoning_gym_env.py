"""``reasoning-gym``: any of reasoning-gym's procedural task generators, mixed like an env group.

```toml
[env]
use = "reasoning-gym"
datasets = ["spell_backward", "letter_counting"]
weights = [2.0, 1.0]                        # optional, one per dataset
mixing = "adaptive"                         # the env group's mixing: "fixed" (default) or "adaptive"
args = { spell_backward = { max_word_len = 6 } }   # each dataset's own config keys
size = 1000                                 # rows generated per dataset
answer_format = "tag"                       # "tag" (default): <answer>...</answer>; "line": the last line
```

Each dataset is a member of an :class:`~i3core.plugins.envs.group.EnvGroup` (task id: the dataset's name), so
every step logs ``env/<dataset>/reward/mean`` and the group's mixing weights, and adaptive mixing favours the
datasets whose groups still teach something. A row is one text completion of the question. With
``answer_format = "tag"`` (the default, reasoning-gym's own convention) the prompt asks for the final answer
between ``<answer>`` and ``</answer>``, the completion stops at ``</answer>`` (the env's ``stop_text``, matched
as text by the servers), and the answer is what follows the last ``<answer>``: it may span lines (matrices,
grids, lists: ``rotate_matrix``). With ``"line"`` the completion stops at a newline and the answer is the text
after the last ``answer_marker`` or, without one, the completion's last non-empty line (one-line answers only).
reasoning-gym's ``score_answer`` scores the answer. A scorer that raises or returns a non-number scores 0 and
counts ``rubric_error/reward`` (the rubric's rule). SFT demonstrations are the reference answers, rendered as
a completion is (``<answer>X</answer>``).

Datasets whose scorer cannot serve as a reward are refused when the config is read, with the reason, found by
probing a few generated rows through the path a rollout takes (the reference answer rendered as a completion
and scored by :meth:`Task.score`): no reference answer (``boxnet``, ``graph_color``, ``propositional_logic``,
``rubiks_cube``, ``rush_hour``), a wrong answer scored 1 (``game_of_life_halting``), or the reference answer
scored below 1 (a multi-line answer with ``answer_format = "line"``). ``composite`` (reasoning-gym's own mixer, which needs ``DatasetSpec`` objects) is refused in
favour of ``datasets`` and ``weights``. reasoning-gym is the extra ``reasoning-gym``, imported only here.
"""

import dataclasses
import random
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from i3core.errors import I3Error, did_you_mean
from i3core.plugins.envs.base import EnvConfig, SingleTurnConfig, SingleTurnEnv
from i3core.plugins.envs.group import EnvGroup
from i3core.types import Example

INSTALL_HINT = "pip install 'i3core[reasoning-gym]'"
PROBE_ROWS = 4
"""Generated rows each dataset's scorer is probed on when the config is read."""
WRONG_ANSWERS = ("", "zzzz not the answer zzzz")
"""Answers no task has as its reference: a scorer that gives one of them 1.0 cannot tell right from wrong."""
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
"""Where a ``tag``-format completion puts its final answer (reasoning-gym's own system prompt asks for these)."""
ANSWER_INSTRUCTION = f"Give only the final answer between {ANSWER_OPEN} and {ANSWER_CLOSE}."
"""The line a ``tag``-format prompt ends with."""
REFUSED = {"composite": "it mixes datasets itself from DatasetSpec objects: list them in `datasets` (with "
                        "`weights`) instead"}


def reasoning_gym():
    """The ``reasoning_gym`` package, or a one-line :class:`I3Error` saying how to install it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError:
        raise I3Error(f"env reasoning-gym needs the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


def create(name: str, size: int, seed: int, args: dict[str, Any]):
    """reasoning-gym's dataset ``name``; a bad argument is a ValueError naming it."""
    try:
        return reasoning_gym().create_dataset(name, size=size, seed=seed, **args)
    except I3Error:
        raise
    except Exception as exc:  # reasoning-gym raises TypeError/ValueError/AssertionError on a bad config
        raise ValueError(f"dataset {name!r} with args {args}: {type(exc).__name__}: {exc}") from None


def unusable(task: "Task") -> str | None:
    """Why ``task``'s scorer cannot serve as a reward, from its first rows, each scored as a rollout's completion
    is (:meth:`Task.demonstration` rendered, :meth:`Task.score`); None when it can."""
    for index, example in enumerate(task.examples()[:PROBE_ROWS]):
        if not isinstance(example.answer, str) or not example.answer.strip():
            return "its rows have no reference answer to check the scorer against or to demonstrate"
        try:
            if float(task.score(task.demonstration(example), example)) < 1.0:
                why = " (it spans lines: use answer_format = \"tag\")" if "\n" in example.answer.strip() else ""
                return f"its scorer gives the reference answer of row {index} less than 1{why}"
        except Exception as exc:
            return f"its scorer fails on the reference answer of row {index}: {type(exc).__name__}: {exc}"
        for wrong in WRONG_ANSWERS:
            try:
                score = float(task.score(task.demonstration(dataclasses.replace(example, answer=wrong)), example))
            except Exception:  # raising on a wrong answer is fine: the rubric scores it 0
                continue
            if score >= 1.0:
                return "its scorer gives a wrong answer 1.0"
    return None


def extract_answer(completion: str, marker: str | None) -> str:
    """The text after the last ``marker``, or (no marker) the last non-empty line; stripped."""
    if marker is not None:
        if marker not in completion:
            return ""
        return completion.rsplit(marker, 1)[1].strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class AnswerConfig(BaseModel):
    """How a completion carries its answer (shared by the env group and each dataset)."""

    answer_format: Literal["tag", "line"] = Field(
        "tag", description="tag: the prompt asks for the answer between <answer> and </answer> and the completion "
                           "stops at </answer> (answers may span lines); line: the answer is the last line.")
    answer_marker: str | None = Field(None, description="line format: the answer follows the last such marker "
                                                        "(default: the completion's last line).")
    stop_text: str | None = Field(None, min_length=1, description="Where a completion stops (default: </answer>, "
                                                                  "or a newline with answer_format = \"line\").")

    @model_validator(mode="after")
    def _marker_is_for_lines(self):
        if self.answer_marker is not None and self.answer_format != "line":
            raise ValueError('answer_marker reads a one-line answer: set answer_format = "line" with it')
        return self

    def stop(self) -> str:
        """The text a completion stops at."""
        if self.stop_text is not None:
            return self.stop_text
        return ANSWER_CLOSE if self.answer_format == "tag" else "\n"


class Task(SingleTurnEnv):
    """One reasoning-gym dataset as a single-turn env: its rows, its scorer, its reference answers."""

    class Config(SingleTurnConfig, AnswerConfig):
        dataset: str = Field(description="reasoning-gym dataset name.")
        args: dict[str, Any] = Field(default_factory=dict, description="The dataset's own config keys.")

    def __init__(self, config: Config):
        self.stop_text = config.stop()
        super().__init__(config)
        self.dataset = create(config.dataset, config.num_examples, config.seed, config.args)

    def make_example(self, rng: random.Random, index: int) -> Example:
        entry = self.dataset[index]
        prompt = f"{entry['question']}\n"
        if self.config.answer_format == "tag":
            prompt += f"{ANSWER_INSTRUCTION}\n"
        return Example(id=f"{self.config.dataset}-{index}", prompt=prompt, answer=entry["answer"],
                       info={"index": index})

    def demonstration(self, example: Example) -> str:
        """The reference answer as a completion writes it, up to the stop text."""
        if self.config.answer_format == "tag":
            return f"{ANSWER_OPEN}{example.answer}{ANSWER_CLOSE}" + ("" if self.stop_text == ANSWER_CLOSE
                                                                     else self.stop_text)
        marker = self.config.answer_marker
        answer = f"{marker} {example.answer}" if marker else example.answer
        return answer + self.stop_text

    def answer(self, completion: str) -> str:
        """The answer ``completion`` gives: up to the stop text (whether the text a server returns ends with it or
        not), then inside the last answer tag, or on the last line (or after the marker)."""
        text = completion.split(self.stop_text, 1)[0]
        if self.config.answer_format == "tag":
            if ANSWER_OPEN not in text:
                return ""
            return text.rsplit(ANSWER_OPEN, 1)[1].split(ANSWER_CLOSE, 1)[0].strip()
        return extract_answer(text, self.config.answer_marker)

    def score(self, completion: str, example: Example) -> float:
        return self.dataset.score_answer(self.answer(completion), self.dataset[example.info["index"]])


class ReasoningGym(EnvGroup):
    """reasoning-gym datasets mixed by weight (fixed or adaptive); see the module docstring."""

    class Config(EnvConfig, AnswerConfig):
        datasets: list[str] = Field(min_length=1, description="reasoning-gym dataset names.")
        weights: list[float] | None = Field(None, description="Relative draw probability per dataset (default equal).")
        args: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                description="Per dataset, its own config keys.")
        size: int = Field(1000, ge=1, description="Rows generated per dataset.")
        mixing: Literal["fixed", "adaptive"] = Field("fixed", description="The env group's mixing.")
        adaptive_window: int = Field(32, ge=1, description="Recent groups per dataset that adaptive mixing counts.")
        adaptive_floor: float = Field(0.05, gt=0, le=1, description="Lowest share adaptive mixing gives a dataset.")

        @model_validator(mode="after")
        def _datasets(self):
            known = sorted(reasoning_gym().factory.DATASETS)
            problems = []
            if len(set(self.datasets)) != len(self.datasets):
                problems.append("datasets are repeated")
            if self.weights is not None and (len(self.weights) != len(self.datasets)
                                             or any(w <= 0 for w in self.weights)):
                problems.append(f"weights must hold one positive number per dataset ({len(self.datasets)})")
            if extra := sorted(set(self.args) - set(self.datasets)):
                problems.append(f"args name datasets not in `datasets`: {', '.join(extra)}")
            for name in self.datasets:
                if name in REFUSED:
                    problems.append(f"dataset {name!r} is refused: {REFUSED[name]}")
                elif name not in known:
                    problems.append(f"unknown reasoning-gym dataset {name!r}{did_you_mean(name, known)}")
                else:
                    why = unusable(Task(self.task_config(name, num_examples=PROBE_ROWS)))
                    if why:
                        problems.append(f"dataset {name!r} cannot serve as a reward: {why}")
            if problems:
                raise ValueError("; ".join(problems))
            return self

        def task_config(self, name: str, **overrides) -> "Task.Config":
            """The config of dataset ``name``'s member."""
            return Task.Config(**{
                "dataset": name, "args": self.args.get(name, {}), "num_examples": self.size, "seed": self.seed,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "credit": self.credit,
                "answer_format": self.answer_format, "answer_marker": self.answer_marker,
                "stop_text": self.stop_text, **overrides})  # fmt: skip

    def __init__(self, config: Config):
        self.config = config
        members, weights = {}, {}
        for i, name in enumerate(config.datasets):
            members[name] = Task(config.task_config(name))
            weights[name] = 1.0 if config.weights is None else config.weights[i]
        self.init_members(members, weights)
