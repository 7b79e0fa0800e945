"""Built-in optimizer components."""

from i3core import hookimpl
from i3core.plugins.optimizers.adamw import AdamW
from i3core.plugins.optimizers.muon import Muon


@hookimpl
def i3_register_optimizers(register):
    register("adamw", AdamW)
    register("muon", Muon)
