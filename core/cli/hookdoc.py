"""Render the hook reference (docs/plugin_hooks.md) from the hook specs' docstrings.

``python -m i3core.cli.hookdoc > docs/plugin_hooks.md``; a test asserts the file is current.
"""

import inspect

from i3core import hookspecs

HEADER = """\
# Plugin hooks reference

Generated from `core/hookspecs.py` by `python -m i3core.cli.hookdoc`; do not edit by hand.
Implement a hook with `from i3core import hookimpl` and a function of the same name
(it may take any subset of the parameters). See writing_plugins.md for a walk-through.
"""


def hook_specs() -> list[tuple[str, str]]:
    """``(section banner, hook name)`` for every hook spec, in file order."""
    source = inspect.getsource(hookspecs)
    specs = []
    banner = ""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# ") and i > 0 and lines[i - 1].startswith("# ---"):
            banner = line[2:].strip()
        if line.startswith("def i3_"):
            specs.append((banner, line[4 : line.index("(")]))
    return specs


def signature(name: str) -> str:
    return f"{name}{inspect.signature(getattr(hookspecs, name))}"


def render() -> str:
    parts = [HEADER]
    current = None
    for banner, name in hook_specs():
        if banner != current:
            parts.append(f"\n## {banner}\n")
            current = banner
        doc = inspect.cleandoc(getattr(hookspecs, name).__doc__ or "")
        parts.append(f"\n### `{signature(name)}`\n\n{doc}\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
