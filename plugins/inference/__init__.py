"""Built-in rollout sources (inference backends)."""

from i3core import hookimpl
from i3core.plugins.inference.builtin import BuiltinSource
from i3core.plugins.inference.local import LocalSource
from i3core.plugins.inference.simulated import SimulatedSource
from i3core.plugins.inference.vllm_source import VllmSource


@hookimpl
def i3_register_rollout_sources(register):
    register("builtin", BuiltinSource)
    register("local", LocalSource)
    register("simulated", SimulatedSource)
    register("vllm", VllmSource)
