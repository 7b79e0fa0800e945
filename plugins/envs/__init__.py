"""Built-in environments."""

from i3core import hookimpl
from i3core.plugins.envs.arithmetic import Arithmetic
from i3core.plugins.envs.reverse_text import ReverseText


@hookimpl
def i3_register_envs(register):
    register("arithmetic", Arithmetic)
    register("reverse-text", ReverseText)
