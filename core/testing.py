"""Hook-level testing helpers for plugin authors (in the spirit of pytest's ``pytester``).

Every helper takes or builds its own :class:`~i3core.manager.Plugins`; nothing
is global, so tests never leak plugins into each other. The same helpers are
pytest fixtures (``i3_plugins``, ``i3_make_component``, ``i3_hook_recorder``)
through the ``pytest11`` entry point.
"""

from dataclasses import dataclass
from typing import Any

import importlib_metadata

from i3core import PROJECT_NAME
from i3core.config import validate_component
from i3core.errors import ConfigError, I3Error, Problem
from i3core.manager import ENTRY_POINT_GROUP, Plugins, load_plugins
from i3core.registry import KINDS, Provider


def plugin_manager(*plugins: object, installed: bool = True, disable: tuple[str, ...] = ()) -> Plugins:
    """A fresh plugin manager.

    :param plugins: plugin objects (modules, classes, instances) to register on top.
    :param installed: load every installed plugin; ``False`` loads only i3core's built-ins.
    :param disable: plugin or distribution names to block.
    """
    entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    if not installed:
        entry_points = [ep for ep in entry_points if ep.dist is not None and ep.dist.metadata["Name"] == PROJECT_NAME]
    manager = load_plugins(entry_points=entry_points, disable=disable, trace=False)
    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        manager.register(plugin, name=name, provider=Provider(name, "(test)", "-"))
    return manager


def make_component(kind: str, name: str, *, plugins: Plugins | None = None, **options: Any) -> Any:
    """Build one component from its registered class and validated options, with no run.

    :param kind: a component kind (``loss``, ``optimizer``, ``env``, ...).
    :param name: the registered name (``icepop``).
    :param plugins: the manager to look in; default: a fresh one with every installed plugin.
    :param options: the component's ``Config`` fields.
    :raises ConfigError: unknown name or invalid options, every problem listed.
    """
    if kind not in KINDS:
        raise I3Error(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    plugins = plugins if plugins is not None else plugin_manager()
    problems: list[Problem] = []
    spec = validate_component(KINDS[kind].section, {"use": name, **options}, plugins, problems)
    if spec is None:
        raise ConfigError(problems)
    return spec.build()


@dataclass
class HookCall:
    """One recorded hook call."""

    name: str
    kwargs: dict[str, Any]
    result: Any = None
    error: BaseException | None = None


class HookRecorder:
    """Records every hook call made through one plugin manager until :meth:`close`."""

    def __init__(self, plugins: Plugins):
        self.calls: list[HookCall] = []
        self._pending: list[HookCall] = []
        self._undo = plugins.pm.add_hookcall_monitoring(self._before, self._after)

    def _before(self, hook_name: str, hook_impls: list, kwargs: dict) -> None:
        self._pending.append(HookCall(hook_name, dict(kwargs)))

    def _after(self, outcome: Any, hook_name: str, hook_impls: list, kwargs: dict) -> None:
        call = self._pending.pop()
        call.error = outcome.exception
        call.result = None if call.error is not None else outcome.get_result()
        self.calls.append(call)

    def getcalls(self, name: str) -> list[HookCall]:
        """Every recorded call of hook ``name``, in order."""
        return [call for call in self.calls if call.name == name]

    def names(self) -> list[str]:
        """The hook names called, in order."""
        return [call.name for call in self.calls]

    def assert_called(self, name: str, times: int | None = None) -> list[HookCall]:
        """Assert ``name`` was called (exactly ``times`` times when given); return its calls."""
        calls = self.getcalls(name)
        if times is None:
            assert calls, f"hook {name} was never called; called: {self.names()}"
        else:
            assert len(calls) == times, f"hook {name} called {len(calls)} times, expected {times}"
        return calls

    def close(self) -> None:
        self._undo()


__all__ = ["HookCall", "HookRecorder", "make_component", "plugin_manager"]
