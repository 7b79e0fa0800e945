"""``reasoning-gym``: any of reasoning-gym's procedural task generators, mixed like an env group.

```toml
[env]
use = "reasoning-gym"
datasets = ["spell_backward", "letter_counting"]
weights = [2.0, 1.0]                        # optional, one per dataset
mixing = "adaptive"                         # the env group's mixing: "fixed" (default) or "adaptive"
args = { spell_backward = { max_word_len = 6 } }   # each dataset's own config keys
size = 1000                                 # rows generated per dataset
answer_marker = "Answer:"                   # optional: the answer is the text after the last marker
```

Each dataset is a member of an :class:`~i3core.plugins.envs.group.EnvGroup` (task id: the dataset's name), so
every step logs ``env/<dataset>/reward/mean`` and the group's mixing weights, and adaptive mixing favours the
datasets whose groups still teach something. A row is one text completion: the question, then the answer on
a line of its own (the completion stops at ``stop_text``, a newline by default). The answer is the text after
the last ``answer_marker`` or, without one, the completion's last non-empty line; reasoning-gym's
``score_answer`` scores it. A scorer that raises or returns a non-number scores 0 and counts
``rubric_error/reward`` (the rubric's rule). SFT demonstrations are the reference answers.

Datasets whose scorer cannot serve as a reward are refused when the config is read, with the reason, found by
probing a few generated rows: no reference answer (``boxnet``, ``graph_color``, ``propositional_logic``,
``rubiks_cube``, ``rush_hour``), a wrong answer scored 1 (``game_of_life_halting``), or the reference answer
scored below 1. ``composite`` (reasoning-gym's own mixer, which needs ``DatasetSpec`` objects) is refused in
favour of ``datasets`` and ``weights``. reasoning-gym is the extra ``reasoning-gym``, imported only here.
"""

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from i3core.errors import I3Error, did_you_mean
from i3core.plugins.envs.base import EnvConfig, SingleTurnConfig, SingleTurnEnv
from i3core.plugins.envs.group import EnvGroup
from i3core.types import Example

INSTALL_HINT = "pip install 'i3core[reasoning-gym]'"
PROBE_ROWS = 4
"""Generated rows each dataset's scorer is probed on when the config is read."""
WRONG_ANSWERS = ("", "zzzz not the answer zzzz")
"""Answers no task has as its reference: a scorer that gives one of them 1.0 cannot tell right from wrong."""
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


def unusable(name: str, dataset) -> str | None:
    """Why ``dataset``'s scorer cannot serve as a reward, from its first rows; None when it can."""
    for index in range(min(PROBE_ROWS, len(dataset))):
        entry = dataset[index]
        answer = entry.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            return "its rows have no reference answer to check the scorer against or to demonstrate"
        try:
            if float(dataset.score_answer(answer, entry)) < 1.0:
                return f"its scorer gives the reference answer of row {index} less than 1"
        except Exception as exc:
            return f"its scorer fails on the reference answer of row {index}: {type(exc).__name__}: {exc}"
        for wrong in WRONG_ANSWERS:
            try:
                score = float(dataset.score_answer(wrong, entry))
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


class Task(SingleTurnEnv):
    """One reasoning-gym dataset as a single-turn env: its rows, its scorer, its reference answers."""

    class Config(SingleTurnConfig):
        dataset: str = Field(description="reasoning-gym dataset name.")
        args: dict[str, Any] = Field(default_factory=dict, description="The dataset's own config keys.")
        answer_marker: str | None = Field(None, description="The answer follows the last such marker.")
        stop_text: str = Field("\n", min_length=1, description="Where a completion stops.")

    def __init__(self, config: Config):
        self.stop_text = config.stop_text
        super().__init__(config)
        self.dataset = create(config.dataset, config.num_examples, config.seed, config.args)

    def make_example(self, rng: random.Random, index: int) -> Example:
        entry = self.dataset[index]
        return Example(id=f"{self.config.dataset}-{index}", prompt=f"{entry['question']}\n", answer=entry["answer"],
                       info={"index": index})

    def demonstration(self, example: Example) -> str:
        marker = self.config.answer_marker
        answer = f"{marker} {example.answer}" if marker else example.answer
        return answer + self.stop_text

    def score(self, completion: str, example: Example) -> float:
        answer = extract_answer(completion.split(self.stop_text, 1)[0], self.config.answer_marker)
        return self.dataset.score_answer(answer, self.dataset[example.info["index"]])


class ReasoningGym(EnvGroup):
    """reasoning-gym datasets mixed by weight (fixed or adaptive); see the module docstring."""

    class Config(EnvConfig):
        datasets: list[str] = Field(min_length=1, description="reasoning-gym dataset names.")
        weights: list[float] | None = Field(None, description="Relative draw probability per dataset (default equal).")
        args: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                description="Per dataset, its own config keys.")
        size: int = Field(1000, ge=1, description="Rows generated per dataset.")
        answer_marker: str | None = Field(None, description="The answer follows the last such marker "
                                                            "(default: the completion's last line).")
        stop_text: str = Field("\n", min_length=1, description="Where a completion stops.")
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
                    why = unusable(name, create(name, PROBE_ROWS, self.seed, self.args.get(name, {})))
                    if why:
                        problems.append(f"dataset {name!r} cannot serve as a reward: {why}")
            if problems:
                raise ValueError("; ".join(problems))
            return self

    def __init__(self, config: Config):
        self.config = config
        members, weights = {}, {}
        for i, name in enumerate(config.datasets):
            members[name] = Task(Task.Config(
                dataset=name, args=config.args.get(name, {}), num_examples=config.size, seed=config.seed,
                max_tokens=config.max_tokens, temperature=config.temperature, credit=config.credit,
                answer_marker=config.answer_marker, stop_text=config.stop_text))  # fmt: skip
            weights[name] = 1.0 if config.weights is None else config.weights[i]
        self.init_members(members, weights)
