"""Built-in weight-sync transports."""

from i3core import hookimpl
from i3core.plugins.weight_sync.broadcast import BroadcastSync
from i3core.plugins.weight_sync.filesystem import FilesystemSync
from i3core.plugins.weight_sync.memory import MemorySync


@hookimpl
def i3_register_weight_syncs(register):
    register("filesystem", FilesystemSync)
    register("broadcast", BroadcastSync)
    register("memory", MemorySync)
