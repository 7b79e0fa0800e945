"""Built-in metric sinks."""

from i3core import hookimpl
from i3core.plugins.metric_sinks.jsonl import JsonlSink


@hookimpl
def i3_register_metric_sinks(register):
    register("jsonl", JsonlSink)
