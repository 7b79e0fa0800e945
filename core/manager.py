"""The plugin manager: built-in and third-party plugins load through one entry-point group.

A :class:`Plugins` object is built per run (or per test) by :func:`load_plugins`;
there is no module-level manager. Loading order:

1. every entry point of the ``i3core`` group that is not blocked is imported;
   one that fails to import is recorded in ``failures`` (a warning, unless the
   config references a component it would have provided);
2. ``check_pending()``: a hook implementation whose name is not a hook spec is
   an error (a misspelled hook would otherwise never be called);
3. each plugin's component hooks are called once, one plugin at a time, so
   every component knows the distribution that provided it.
"""

import contextlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy
import structlog

from i3core import PROJECT_NAME, hookspecs
from i3core.errors import HookFailed, PluginError, did_you_mean
from i3core.registry import KINDS, Provider, Registry

DISABLE_ENV = "I3CORE_DISABLE_PLUGINS"
"""Comma-separated plugin (entry-point) or distribution names to block."""
TRACE_ENV = "I3CORE_TRACE"
"""Set to 1 to log every hook call with its arguments and results."""

ENTRY_POINT_GROUP = PROJECT_NAME
UNKNOWN_DISTRIBUTION = Provider("?", "(registered directly)", "-")

log = structlog.get_logger("i3core.manager")


@dataclass(frozen=True)
class LoadFailure:
    """An installed plugin that could not be loaded, and why (one line)."""

    plugin: str
    distribution: str
    version: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution} {self.version} failed to load: {self.error}"


@dataclass
class PluginInfo:
    """What ``i3core plugins`` shows for one loaded plugin."""

    name: str
    distribution: str
    version: str
    hooks: list[str]
    components: dict[str, list[str]] = field(default_factory=dict)


class Plugins:
    """A pluggy manager with the i3core hook specs, its component registry and its load report."""

    def __init__(self, *, trace: bool = False) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.failures: list[LoadFailure] = []
        self.blocked: list[str] = []
        self._providers: dict[str, Provider] = {}
        if trace:
            self.pm.add_hookcall_monitoring(_trace_before, _trace_after)

    @property
    def hook(self) -> Any:
        """``plugins.hook.i3_on_step_end(step=..., metrics=...)`` calls every implementation."""
        return self.pm.hook

    def call(self, hook: str, **kwargs: Any) -> list:
        """Call event hook ``hook`` on every implementation, as ``plugins.hook.<hook>(**kwargs)`` does; how the core
        calls them. A plugin's own tests call ``plugins.hook`` and see its exceptions unchanged.

        :return: the implementations' results.
        :raises HookFailed: an implementation raised; names its plugin and the hook (the error is the cause).
        """
        caller = getattr(self.pm.hook, hook)
        try:
            return caller(**kwargs)
        except (Exception, SystemExit) as exc:  # sys.exit() in a hook ended runs with no line, exit 0
            plugin = _raised_in(caller, exc)
            if plugin is None:  # pluggy's own error (a hook called with a wrong argument): the core's bug
                raise
            error = f"{type(exc).__name__}: {_first_line(exc)}"
            raise HookFailed(f"{self.provider(plugin)} failed in {hook}: {error}", hook) from exc

    def register(self, plugin: object, name: str | None = None, provider: Provider | None = None) -> str:
        """Register one plugin object (a module, class or instance) and its components.

        :return: the name the plugin was registered under.
        :raises PluginError: on a misspelled hook, a bad hook signature or a duplicate component.
        """
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        provider = provider or Provider(name, UNKNOWN_DISTRIBUTION.distribution, UNKNOWN_DISTRIBUTION.version)
        if self.pm.has_plugin(name):
            raise PluginError(f"two plugins are named {name!r}: {self._providers[name]} and {provider}")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            if self.pm.has_plugin(name):  # pluggy keeps the name of a plugin it refused
                self.pm.unregister(name=name)
            raise PluginError(f"{provider}: {' '.join(str(exc).split())}") from None
        self._providers[name] = provider
        try:
            self._check_pending(plugin, provider)
            self._register_components(plugin, provider)
        except Exception:
            self.unregister(name)
            raise
        return name

    def unregister(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin, name=name)
        self._providers.pop(name, None)

    def provider(self, name: str) -> Provider:
        return self._providers[name]

    def info(self) -> list[PluginInfo]:
        """One entry per loaded plugin, sorted by name."""
        infos = []
        for name, provider in sorted(self._providers.items()):
            plugin = self.pm.get_plugin(name)
            hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])
            components: dict[str, list[str]] = {}
            for component in self.registry:
                if component.provider.plugin == name:
                    components.setdefault(component.kind, []).append(component.name)
            infos.append(PluginInfo(name, provider.distribution, provider.version, hooks, components))
        return infos

    def failure_hint(self) -> str:
        """A sentence naming plugins that failed to load, for errors about missing components."""
        if not self.failures:
            return ""
        return "; " + "; ".join(str(f) for f in self.failures)

    # -- internals ---------------------------------------------------------

    def _check_pending(self, plugin: object, provider: Provider) -> None:
        known = [name for name in dir(self.pm.hook) if getattr(getattr(self.pm.hook, name), "spec", None)]
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                raise PluginError(
                    f"{provider} implements unknown hook {caller.name!r}{did_you_mean(caller.name, known)}"
                )

    def _register_components(self, plugin: object, provider: Provider) -> None:
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        for kind in KINDS.values():
            caller = self.pm.subset_hook_caller(kind.hook, remove_plugins=others)
            if not caller.get_hookimpls():
                continue
            try:
                caller(register=self.registry.register_callback(kind.name, provider))
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"{provider} failed in {kind.hook}: {_first_line(exc)}") from exc


def load_plugins(
    *,
    disable: Iterable[str] = (),
    entry_points: Iterable[importlib_metadata.EntryPoint] | None = None,
    trace: bool | None = None,
) -> Plugins:
    """Build a :class:`Plugins` from the ``i3core`` entry points (built-ins included).

    :param disable: plugin (entry-point) or distribution names to block, on top
        of those in ``$I3CORE_DISABLE_PLUGINS``.
    :param entry_points: the entry points to load; default: every installed one.
    :param trace: log every hook call; default: ``$I3CORE_TRACE``.
    :raises PluginError: a loaded plugin misnames a hook or registers a duplicate.
    """
    if trace is None:
        trace = os.environ.get(TRACE_ENV, "") not in ("", "0")
    plugins = Plugins(trace=trace)
    blocked = set(disable) | {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    if entry_points is None:
        entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(entry_points, key=lambda ep: ep.name):
        dist_name, dist_version = _distribution(ep)
        provider = Provider(ep.name, dist_name, dist_version)
        if ep.name in blocked or dist_name in blocked:
            plugins.pm.set_blocked(ep.name)
            plugins.blocked.append(ep.name)
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):  # a print at import would corrupt `plugins --json`
                module = ep.load()
        except (Exception, SystemExit) as exc:  # a broken third-party plugin must not take the CLI down
            failure = LoadFailure(ep.name, dist_name, dist_version, f"{type(exc).__name__}: {_first_line(exc)}")
            plugins.failures.append(failure)
            log.warning("plugin failed to load", plugin=ep.name, distribution=dist_name, error=failure.error)
            continue
        plugins.register(module, name=ep.name, provider=provider)
    return plugins


def _distribution(ep: importlib_metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return UNKNOWN_DISTRIBUTION.distribution, UNKNOWN_DISTRIBUTION.version
    return dist.metadata["Name"], dist.version


def _raised_in(caller: Any, exc: BaseException) -> str | None:
    """The name of the plugin whose implementation of ``caller``'s hook ``exc`` came out of: the outermost frame
    of its traceback that runs an implementation's code (pluggy calls each from its own loop)."""
    plugins = {getattr(impl.function, "__code__", None): impl.plugin_name for impl in caller.get_hookimpls()}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in plugins:
            return plugins[tb.tb_frame.f_code]
        tb = tb.tb_next
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_trace_log = structlog.get_logger("i3core.trace")
_TRACE_REPR_CHARS = 240
"""Long arguments (a whole RunConfig) are cut so a trace line stays readable."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _TRACE_REPR_CHARS else text[: _TRACE_REPR_CHARS - 3] + "..."


def _trace_before(hook_name: str, hook_impls: list, kwargs: dict) -> None:
    _trace_log.info("hook call", hook=hook_name, plugins=[impl.plugin_name for impl in hook_impls], kwargs={k: _short(v) for k, v in kwargs.items()})


def _trace_after(outcome: Any, hook_name: str, hook_impls: list, kwargs: dict) -> None:
    exc = outcome.exception
    if exc is not None:
        _trace_log.info("hook raised", hook=hook_name, error=repr(exc))
    else:
        _trace_log.info("hook result", hook=hook_name, result=_short(outcome.get_result()))


__all__ = ["DISABLE_ENV", "TRACE_ENV", "LoadFailure", "PluginInfo", "Plugins", "load_plugins"]
