"""Built-in policy models."""

from i3core import hookimpl
from i3core.plugins.models.hf import HF
from i3core.plugins.models.tiny_moe import TinyMoE
from i3core.plugins.models.titan import TorchTitan


@hookimpl
def i3_register_models(register):
    register("tiny-moe", TinyMoE)
    register("torchtitan", TorchTitan)
    register("hf", HF)
