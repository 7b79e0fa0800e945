"""The event hooks whose results the core acts on, in one place for every role."""

from i3core.manager import Plugins
from i3core.types import Group


def group_kept(plugins: Plugins, group: Group) -> bool:
    """Call ``i3_on_group_scored``; the group is dropped if any implementation returns ``False``."""
    return all(result is not False for result in plugins.call("i3_on_group_scored", group=group))


def end_step(plugins: Plugins, sinks: list, step: int, metrics: dict[str, float],
             rollouts: list[dict] | None = None) -> dict[str, float]:
    """Call ``i3_on_step_end`` (plugins may add metrics), then write the metrics to every sink, and the step's
    rollout lines (:mod:`i3core.loop.rollouts`) to every sink that takes them (``write_rollouts``)."""
    plugins.call("i3_on_step_end", step=step, metrics=metrics)
    for sink in sinks:
        if rollouts and hasattr(sink, "write_rollouts"):
            sink.write_rollouts(step, rollouts)
        sink.write(step, metrics)
    return metrics
