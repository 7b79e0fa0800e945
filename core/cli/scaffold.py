"""``i3core new-plugin NAME [--kind loss|env]``: a pip-installable plugin package with one component
(a loss, or an environment) and passing tests."""

import re
from pathlib import Path
from string import Template

from i3core import __version__
from i3core.errors import I3Error

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "An i3core plugin: $description"
requires-python = ">=3.11"
dependencies = ["i3core>=$core_version"]

[project.optional-dependencies]
test = ["pytest>=8"]

# i3core finds plugins through this entry-point group.
[project.entry-points.i3core]
$name = "$package"

[tool.setuptools]
packages = ["$package"]
'''

LOSS_FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": '''\
# $dist

An [i3core](https://pypi.org/project/i3core/) plugin providing the `$name` loss.

```bash
pip install -e '.[test]'
i3core plugins          # lists $name
pytest                  # runs the hook-level test
```

Use it in a plugins.toml:

```toml
[loss]
use = "$name"
scale = 1.0
```
''',
    "$package/__init__.py": '''\
"""The $name plugin for i3core."""

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core import hookimpl
from i3core.types import LossInputs, LossOutput


class $cls:
    """Sign-of-advantage policy gradient: -scale * sum(sign(A_t) * logp_t) / num_loss_tokens."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        scale: float = Field(1.0, gt=0, description="Multiplies the loss.")

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.loss_mask.bool()
        per_token = torch.where(mask, inputs.advantages.sign() * inputs.trainer_logprobs, 0.0)
        loss = -self.config.scale * per_token.sum() / inputs.normaliser()
        return LossOutput(loss=loss, metrics={"$name/loss_tokens": float(mask.sum())})


@hookimpl
def i3_register_losses(register):
    register("$name", $cls)
''',
    "tests/test_$package.py": '''\
import torch

from i3core.types import LossInputs


def test_hook_i3_register_losses(i3_plugins):
    assert i3_plugins.registry.get("loss", "$name") is not None


def test_gradient_is_minus_sign_of_advantage_over_tokens(i3_make_component):
    loss_fn = i3_make_component("loss", "$name", scale=1.0)
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=logp,
        inference_logprobs=logp.detach(),
        advantages=torch.tensor([1.0, -1.0, 2.0]),
        loss_mask=torch.tensor([True, True, False]),
        sequence_ids=torch.tensor([0, 0, 0]),
    )
    loss_fn(inputs).loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-0.5, 0.5, 0.0]))
''',
}


ENV_FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": '''\
# $dist

An [i3core](https://pypi.org/project/i3core/) environment, `$name`: how often does a letter
occur in a word? The model may call the `count_letter` tool (a Python function: its
signature and docstring are the tool's schema), then answers with the number.

```bash
pip install -e '.[test]'
i3core plugins                      # lists $name
pytest                              # hook-level tests with a scripted client, no model
i3core env eval $name --n 20        # rollouts against a server (a fresh tiny model by default)
```

Train on it alone:

```toml
[env]
use = "$name"
max_turns = 3
```

or with other envs:

```toml
[env]
use = "group"
[[env.members]]
use = "$name"
[[env.members]]
use = "reverse-text"
```
''',
    "$package/__init__.py": '''\
"""The $name environment for i3core: count a letter in a word, with a tool."""

import random

from pydantic import Field

from i3core import hookimpl
from i3core.plugins.envs import Rubric, ToolConfig, ToolEnv
from i3core.types import Example

WORDS = ["banana", "letter", "mississippi", "coffee", "bookkeeper", "assessment", "parallel", "committee"]


def count_letter(word: str, letter: str) -> int:
    """Count how often a letter occurs in a word.

    :param word: the word to search
    :param letter: one letter
    """
    if len(letter) != 1:
        raise ValueError("letter must be exactly one character")
    return word.count(letter)


def last_answer(completion: list[dict]) -> str:
    """The content of the model's last message, trimmed."""
    return next((m["content"].strip() for m in reversed(completion) if m["role"] == "assistant"), "")


class $cls(ToolEnv):
    """How often does a letter occur in a word? Reward 1 for the exact count in the last turn."""

    class Config(ToolConfig):
        num_examples: int = Field(200, ge=1, description="Size of the generated dataset.")
        max_turns: int = Field(3, ge=1, description="Model turns per rollout.")

    tools = (count_letter,)

    def load_examples(self) -> list[Example]:
        rng = random.Random(self.config.seed)
        rows = []
        for i in range(self.config.num_examples):
            word = rng.choice(WORDS)
            letter = rng.choice(word)
            rows.append(Example(id=f"$name-{i}", prompt=[{"role": "user", "content": f"How many {letter} in {word}?"}],
                                answer=str(word.count(letter)), info={"word": word, "letter": letter}))
        return rows

    def build_rubric(self) -> Rubric:
        def correct(completion: list[dict], answer: str) -> float:
            return 1.0 if last_answer(completion) == answer else 0.0

        def used_tool(state: dict) -> float:
            return float(state["metrics"].get("tool_calls", 0) > 0)

        rubric = Rubric([correct])
        rubric.add_metric(used_tool)  # logged, weight 0
        return rubric


@hookimpl
def i3_register_envs(register):
    register("$name", $cls)
''',
    "tests/test_$package.py": '''\
import asyncio
import json

from i3core.testing import ScriptedClient

END = "<|im_end|>"


def tool_call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>" + END


def test_hook_i3_register_envs(i3_plugins):
    assert i3_plugins.registry.get("env", "$name") is not None


def test_dataset_is_seeded(i3_make_component):
    first = i3_make_component("env", "$name", num_examples=20, seed=1).examples()
    again = i3_make_component("env", "$name", num_examples=20, seed=1).examples()
    assert first == again and len(first) == 20


def test_tool_call_then_the_answer_scores_1(i3_make_component):
    env = i3_make_component("env", "$name", num_examples=5, max_tokens=128, max_total_tokens=512)
    tokenizer = i3_make_component("model", "tiny-moe").tokenizer()
    example = env.examples()[0]
    client = ScriptedClient(tokenizer, [tool_call("count_letter", **example.info), example.answer + END])
    rollout = asyncio.run(env.rollout(client, example))
    assert rollout.reward == 1.0 and rollout.metrics["used_tool"] == 1.0
    tool_message = rollout.state["completion"][1]
    assert tool_message["role"] == "tool" and tool_message["content"] == example.answer
    # the tool's answer is env tokens (loss mask 0): the model is not trained to produce it
    env_tokens = [t for t, trained in zip(rollout.completion_ids, rollout.completion_mask) if not trained]
    assert "<|im_start|>tool\\n" + example.answer in tokenizer.decode(env_tokens, skip_special_tokens=False)


def test_a_bad_tool_call_is_an_error_message_and_a_wrong_answer_scores_0(i3_make_component):
    env = i3_make_component("env", "$name", num_examples=5, max_tokens=128, max_total_tokens=512)
    tokenizer = i3_make_component("model", "tiny-moe").tokenizer()
    example = env.examples()[0]
    client = ScriptedClient(tokenizer, [tool_call("count_letter", word="abc", letter="xy"), "99" + END])
    rollout = asyncio.run(env.rollout(client, example))
    assert rollout.state["completion"][1]["content"].startswith("Error: ValueError")
    assert rollout.reward == 0.0 and rollout.metrics["tool_errors"] == 1
''',
}
KIND_FILES = {"loss": LOSS_FILES, "env": ENV_FILES}
DESCRIPTIONS = {"loss": "the $name loss (a sign-of-advantage policy gradient)",
                "env": "the $name environment (count a letter in a word, with a tool)"}
SUFFIX = {"loss": "Loss", "env": "Env"}


def new_plugin(name: str, directory: Path, kind: str = "loss") -> Path:
    """Write the plugin package ``i3-plugin-NAME`` providing one ``kind`` component under ``directory``;
    return its folder.

    :raises I3Error: on a bad name or kind, or an existing folder.
    """
    if kind not in KIND_FILES:
        raise I3Error(f"plugin kind {kind!r} is not one of: {', '.join(KIND_FILES)}")
    if not NAME_PATTERN.match(name):
        raise I3Error(f"plugin name {name!r} must be lowercase letters and digits separated by '-', e.g. 'my-loss'")
    dist = f"i3-plugin-{name}"
    package = dist.replace("-", "_")
    root = directory / dist
    if root.exists():
        raise I3Error(f"{root} already exists; pick another name or --dir")
    values = {
        "name": name,
        "dist": dist,
        "package": package,
        "cls": "".join(part.capitalize() for part in name.split("-")) + SUFFIX[kind],
        "core_version": __version__,
    }
    values["description"] = Template(DESCRIPTIONS[kind]).substitute(values)
    for relative, text in KIND_FILES[kind].items():
        path = root / Template(relative).substitute(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(text).substitute(values), encoding="utf-8")
    return root
