"""Components by (kind, name), each with the class that builds it and who provided it."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pydantic

from i3core.errors import I3Error, PluginError, exception_line


@dataclass(frozen=True)
class Kind:
    """A component kind: its name, the hook that registers it and its config section."""

    name: str
    hook: str
    section: str


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("model", "i3_register_models", "model"),
        Kind("rollout_source", "i3_register_rollout_sources", "inference"),
        Kind("env", "i3_register_envs", "env"),
        Kind("loss", "i3_register_losses", "loss"),
        Kind("optimizer", "i3_register_optimizers", "optimizer"),
        Kind("scheduler", "i3_register_schedulers", "scheduler"),
        Kind("weight_sync", "i3_register_weight_syncs", "weight_sync"),
        Kind("sandbox", "i3_register_sandboxes", "sandbox"),
        Kind("metric_sink", "i3_register_metric_sinks", "metrics"),
    )
}
SECTION_KINDS: dict[str, Kind] = {kind.section: kind for kind in KINDS.values()}


@dataclass(frozen=True)
class Provider:
    """Where a component comes from: the plugin and its distribution."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution} {self.version}"


@dataclass(frozen=True)
class Component:
    """One registered component class."""

    kind: str
    name: str
    cls: type
    provider: Provider

    @property
    def config_model(self) -> type[pydantic.BaseModel]:
        return self.cls.Config

    def build(self, config: pydantic.BaseModel):
        """The component object, ``cls(config)``.

        :raises I3Error: the constructor raised; an error of its own kind (:class:`I3Error`, one line already) as it
            is, anything else as one line naming the component and its plugin (it was an "internal error").
        """
        try:
            return self.cls(config)
        except I3Error:
            raise
        except Exception as exc:
            raise I3Error(f"{self.kind} {self.name!r} ({self.provider}) could not be built: "
                          f"{exception_line(exc)}") from exc


class Registry:
    """Every registered component, keyed by (kind, name)."""

    def __init__(self) -> None:
        self._components: dict[tuple[str, str], Component] = {}

    def register_callback(self, kind: str, provider: Provider) -> Callable[[str, type], None]:
        """The ``register(name, cls)`` callback handed to one plugin's hook."""

        def register(name: str, cls: type) -> None:
            self.add(Component(kind, name, cls, provider))

        return register

    def add(self, component: Component) -> None:
        kind, name = component.kind, component.name
        if kind not in KINDS:
            raise PluginError(f"{component.provider} registers unknown kind {kind!r}")
        if not isinstance(name, str) or not name:
            raise PluginError(f"{component.provider} registers a {kind} with an empty or non-string name")
        _check_config_model(component)
        previous = self._components.get((kind, name))
        if previous is not None:
            raise PluginError(
                f"{kind} {name!r} is registered twice: by {previous.provider} and by {component.provider}"
            )
        self._components[(kind, name)] = component

    def get(self, kind: str, name: str) -> Component | None:
        return self._components.get((kind, name))

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, name) in self._components if k == kind)

    def of_kind(self, kind: str) -> list[Component]:
        return [self._components[(kind, name)] for name in self.names(kind)]

    def __iter__(self) -> Iterator[Component]:
        return iter(sorted(self._components.values(), key=lambda c: (c.kind, c.name)))

    def __len__(self) -> int:
        return len(self._components)


def _check_config_model(component: Component) -> None:
    config = getattr(component.cls, "Config", None)
    where = f"{component.kind} {component.name!r} ({component.provider})"
    if not (isinstance(config, type) and issubclass(config, pydantic.BaseModel)):
        raise PluginError(f"{where}: the class needs a `Config` pydantic model")
    if config.model_config.get("extra") != "forbid":
        raise PluginError(f"{where}: its Config must set model_config = ConfigDict(extra='forbid')")
