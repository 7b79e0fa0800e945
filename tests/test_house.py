"""The house: who may import whom, read from the import graph as Python sees it (every import statement of
core/ and plugins/, nested ones too), not from a list kept by hand. The rules are docs/architecture.md's."""

import ast
import inspect
from pathlib import Path

import pytest

from i3core import protocols

from .conftest import ROOT

ROOMS = ("loop", "sandbox", "cli")
MAY_IMPORT = {
    "contract": {"contract"},
    "sandbox": {"contract", "sandbox"},
    "loop": {"contract", "sandbox", "loop"},
    "cli": {"contract", "sandbox", "loop", "cli"},
    "plugin": {"contract", "sandbox"},
}
"""Per room, the rooms of i3core it may import (a plugin also imports its own kind's modules)."""
MAX_CONTRACT_MODULES = 16


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = ["i3core", *parts[1:]] if parts[0] == "core" else ["i3core", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for folder in ("core", "plugins") for p in (ROOT / folder).rglob("*.py")}


def imports(module: str) -> set[str]:
    """The i3core modules ``module`` imports, each resolved to the longest module name that exists."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["plugins"]:
        return "plugin" if len(parts) > 2 else "contract"  # i3core.plugins itself is an empty namespace
    return parts[1] if len(parts) > 2 or parts[1:] and parts[1] in ROOMS else "contract"


def kind(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[1:2] == ["plugins"] and len(parts) > 2 else None


def test_no_import_circle_among_the_core_modules():
    core = {m for m in GRAPH if room(m) != "plugin"}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(module, path):
        state[module] = 1
        for dep in sorted(GRAPH[module] & core):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(core):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import circles: {cycles}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_each_module_imports_only_what_its_room_may(module):
    allowed = MAY_IMPORT[room(module)]
    wrong = sorted(dep for dep in GRAPH[module]
                   if room(dep) not in allowed and not (room(dep) == "plugin" and kind(dep) == kind(module)))
    assert not wrong, f"{module} ({room(module)}) imports {wrong}"


def test_the_contract_is_small_and_each_room_says_what_it_holds():
    top = sorted(p.name for p in (ROOT / "core").glob("*.py"))
    assert len(top) <= MAX_CONTRACT_MODULES, top
    for name in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "core" / name / "__init__.py").read_text())) or ""
        assert "Holds" in doc and "May import" in doc, f"core/{name}/__init__.py must say what it holds and imports"


def test_the_model_protocol_gives_tensor_shapes():
    for name in ("Model", "CausalLM"):
        cls = getattr(protocols, name)
        assert cls._is_protocol
        methods = [m for m in vars(cls) if not m.startswith("_") and callable(getattr(cls, m))]
        undocumented = [m for m in methods if not inspect.getdoc(getattr(cls, m))]
        assert methods and not undocumented, f"{name}: {undocumented}"
    assert "[R, S]" in inspect.getdoc(protocols.CausalLM.forward)
    assert "[B, S, H]" in inspect.getdoc(protocols.CausalLM.forward_cached)


def test_no_asyncio_wait_for():
    """Python 3.11's ``asyncio.wait_for`` returns the result of what it waits on when a cancel arrives as that
    finishes, dropping the cancel: a stopping run's task goes on. ``async with asyncio.timeout(...)`` does not."""
    found = [
        f"{MODULES[m].relative_to(ROOT)}:{node.lineno}"
        for m in MODULES
        for node in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "wait_for"
        and isinstance(node.value, ast.Name) and node.value.id == "asyncio"
    ]
    assert not found, f"asyncio.wait_for at {found}: use async with asyncio.timeout(...)"
