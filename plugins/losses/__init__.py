"""Built-in loss components."""

from i3core import hookimpl
from i3core.plugins.losses.cispo import Cispo
from i3core.plugins.losses.grpo import Grpo
from i3core.plugins.losses.gspo import Gspo
from i3core.plugins.losses.icepop import IcePop
from i3core.plugins.losses.pg import PolicyGradient


@hookimpl
def i3_register_losses(register):
    register("icepop", IcePop)
    register("cispo", Cispo)
    register("gspo", Gspo)
    register("grpo", Grpo)
    register("pg", PolicyGradient)
