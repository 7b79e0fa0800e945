"""The processes ``i3core run`` starts end with it.

``i3core run`` writes its pid into ``$I3CORE_RUN_PID`` before it starts the
trainer and the inference servers; they inherit it. A run that ends normally
stops them itself, but a run killed with SIGKILL cannot: then each of them
notices that the pid is gone and stops on its own, instead of holding its
memory and ports for ever. Processes started otherwise (the roles on a
cluster) have no such variable and are not watched.
"""

import os
import secrets
import signal
import threading

RUN_PID_ENV = "I3CORE_RUN_PID"
ADMIN_TOKEN_ENV = "I3CORE_ADMIN_TOKEN"
"""The token the inference servers' admin routes (weights, pause, sessions) ask for, and the run's clients send:
``i3core run`` makes one (:func:`mark_run`); the roles of a cluster job share the one set in their environment."""
API_KEY_ENV = "I3CORE_API_KEY"
"""What an inference server's ``/v1/*`` asks for when ``--api-key`` is not given (vLLM reads ``VLLM_API_KEY``)."""
WATCH_INTERVAL_S = 1.0
"""How often a watched process checks that its run is still there."""


def mark_run() -> None:
    """Make this process the run that the processes it starts from now on belong to, and give the run an admin
    token (unless its environment has one) that its servers and its clients inherit."""
    os.environ[RUN_PID_ENV] = str(os.getpid())
    if not os.environ.get(ADMIN_TOKEN_ENV):
        os.environ[ADMIN_TOKEN_ENV] = secrets.token_urlsafe(32)


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
