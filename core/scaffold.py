"""``i3core new-plugin NAME``: a pip-installable plugin package with one loss and one passing test."""

import re
from pathlib import Path
from string import Template

from i3core import __version__
from i3core.errors import I3Error

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

FILES = {
    "pyproject.toml": '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "An i3core plugin: the $name loss (a sign-of-advantage policy gradient)"
requires-python = ">=3.11"
dependencies = ["i3core>=$core_version"]

[project.optional-dependencies]
test = ["pytest>=8"]

# i3core finds plugins through this entry-point group.
[project.entry-points.i3core]
$name = "$package"

[tool.setuptools]
packages = ["$package"]
''',
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


def new_plugin(name: str, directory: Path) -> Path:
    """Write the plugin package ``i3-plugin-NAME`` under ``directory``; return its folder.

    :raises I3Error: on a bad name or an existing folder.
    """
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
        "cls": "".join(part.capitalize() for part in name.split("-")) + "Loss",
        "core_version": __version__,
    }
    for relative, text in FILES.items():
        path = root / Template(relative).substitute(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(text).substitute(values), encoding="utf-8")
    return root
