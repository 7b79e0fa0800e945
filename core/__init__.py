"""i3core: a plugin-based framework for asynchronous, agentic RL post-training.

Plugins mark their hook implementations with :data:`hookimpl`::

    from i3core import hookimpl

    @hookimpl
    def i3_register_losses(register):
        register("my-loss", MyLoss)
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

PROJECT_NAME = "i3core"
"""The pluggy project name and the entry-point group plugins are found under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

try:
    __version__ = version(PROJECT_NAME)
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
