"""Built-in orchestrator schedulers."""

from i3core import hookimpl
from i3core.plugins.schedulers.async_scheduler import AsyncScheduler
from i3core.plugins.schedulers.sync_scheduler import SyncScheduler


@hookimpl
def i3_register_schedulers(register):
    register("async", AsyncScheduler)
    register("sync", SyncScheduler)
