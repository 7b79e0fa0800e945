"""Meta-tests: every hook is documented with its exact signature and has a test_hook_<name>."""

import inspect
import re

import pytest

from i3core.cli import hookdoc
from i3core import hookspecs

from .conftest import ROOT

HOOKS = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("i3_")]


def test_every_spec_is_listed_by_the_renderer():
    assert sorted(name for _, name in hookdoc.hook_specs()) == sorted(HOOKS) and len(HOOKS) == 16


def test_plugin_hooks_doc_is_current():
    assert (ROOT / "docs" / "plugin_hooks.md").read_text() == hookdoc.render(), (
        "docs/plugin_hooks.md is stale: run python -m i3core.cli.hookdoc > docs/plugin_hooks.md"
    )


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_exact_signature(name):
    doc = (ROOT / "docs" / "plugin_hooks.md").read_text()
    signature = f"{name}{inspect.signature(getattr(hookspecs, name))}"
    assert f"### `{signature}`" in doc


@pytest.mark.parametrize("name", HOOKS)
def test_hook_docstring_names_every_parameter_and_the_return(name):
    spec = getattr(hookspecs, name)
    doc = spec.__doc__ or ""
    for param in inspect.signature(spec).parameters:
        assert f":param {param}:" in doc, f"{name} does not document {param}"
    assert ":return:" in doc and "Called" in doc


def test_every_hook_has_a_test():
    from . import test_hooks

    source = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    defined = set(re.findall(r"def (test_hook_i3_\w+)", source)) | {n for n in dir(test_hooks) if n.startswith("test_hook_")}
    missing = [name for name in HOOKS if f"test_hook_{name}" not in defined]
    assert not missing, f"hooks without a test_hook_<name>: {missing}"


def test_docs_pages_exist_and_mention_the_contract():
    writing = (ROOT / "docs" / "writing_plugins.md").read_text()
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    assert "[project.entry-points.i3core]" in writing and "make_component" in writing
    assert "--set" in configuration and "did you mean" in configuration
