"""The processes ``i3core run`` starts end with it.

``i3core run`` writes its pid into ``$I3CORE_RUN_PID`` before it starts the
trainer and the inference servers; they inherit it. A run that ends normally
stops them itself, but a run killed with SIGKILL cannot: then each of them
notices that the pid is gone and stops on its own, instead of holding its
memory and ports for ever. Processes started otherwise (the roles on a
cluster) have no such variable and are not watched.
"""

import os
import signal
import threading

RUN_PID_ENV = "I3CORE_RUN_PID"
WATCH_INTERVAL_S = 1.0
"""How often a watched process checks that its run is still there."""


def mark_run() -> None:
    """Make this process the run that the processes it starts from now on belong to."""
    os.environ[RUN_PID_ENV] = str(os.getpid())


def run_gone() -> bool:
    """Whether the ``i3core run`` process named by ``$I3CORE_RUN_PID`` has died (False when unset)."""
    pid = os.environ.get(RUN_PID_ENV)
    if not pid or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        return False
    return False


def terminate_with_run() -> None:
    """Send this process SIGTERM once its run is gone (a daemon thread polls); nothing when not started by a run."""
    if not os.environ.get(RUN_PID_ENV):
        return

    def watch() -> None:
        while not run_gone():
            threading.Event().wait(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="i3core-run-watch", daemon=True).start()
