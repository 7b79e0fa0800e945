"""Built-in metric sinks. ``jsonl`` is the run's record and always written; ``[metrics]`` may add another."""

from i3core import hookimpl
from i3core.plugins.metric_sinks.jsonl import JsonlSink
from i3core.plugins.metric_sinks.tensorboard_sink import TensorBoardSink
from i3core.plugins.metric_sinks.wandb_sink import WandbSink


@hookimpl
def i3_register_metric_sinks(register):
    register("jsonl", JsonlSink)
    register("tensorboard", TensorBoardSink)
    register("wandb", WandbSink)
