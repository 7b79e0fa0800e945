"""Built-in loss components."""

from i3core import hookimpl
from i3core.plugins.losses.icepop import IcePop


@hookimpl
def i3_register_losses(register):
    register("icepop", IcePop)
