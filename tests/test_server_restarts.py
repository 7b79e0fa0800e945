"""The rollout source's supervision of its server processes, with real servers killed by signals.

A crashed server (SIGKILL) comes back on its port and weights, ``restarts``
times at most; one that exits 0 (SIGTERM) stays down; nothing restarts once
the source is closing; a server that fails at start-up is an error.
"""

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from i3core.errors import I3Error, ServerError
from i3core.lifetime import RUN_PID_ENV
from i3core.plugins.inference.builtin import SUPERVISE_POLL_S
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.weight_sync.filesystem import FilesystemSync
from i3core.weights import STABLE
from i3core.testing import make_component

from .test_end_to_end import server_pids
from .test_inference_server import SMALL

pytestmark = pytest.mark.slow

RESTART_TIMEOUT_S = 60.0
"""A restarted server imports torch and loads the model again: seconds on 2 cores, under a minute on a busy one."""


@pytest.fixture
def weights(tmp_path):
    """Version 0 as the filesystem weight sync publishes it: ``broadcasts/step_0/`` with its STABLE marker."""
    component = make_component("model", "tiny-moe", **SMALL)
    root = tmp_path / "broadcasts"
    component.save_hf(component.build(seed=0), root / "step_0")
    (root / "step_0" / STABLE).write_text("")
    return root


def health(url: str) -> dict:
    async def ask():
        client = InferenceClient(url, tokenizer=None)
        try:
            return await client.health()
        finally:
            await client.close()

    return asyncio.run(ask())


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f}s"
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        return health(url)["status"] == "ok"
    except ServerError:
        return False


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


def test_a_crashed_server_comes_back_on_its_port_and_weights_until_its_restarts_are_used_up(weights, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv(RUN_PID_ENV, str(os.getpid()))  # what mark_run() does: this process is the run
    source = make_component("rollout_source", "builtin", servers=1, max_slots=4, max_len=64, restarts=1)
    pruner = FilesystemSync(FilesystemSync.Config(keep=1))
    with capture_logs() as logs:
        try:
            (url,) = source.start(weights / "step_0", tmp_path / "logs")
            first = source.processes[0].pid
            # the trainer's pruning keeps back the version a restarted server loads
            assert pruner.prune(weights, 5) == [0] and (weights / "step_0" / STABLE).exists()
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: source.processes[0].pid != first and healthy(url), RESTART_TIMEOUT_S, "a restart")
            assert health(url)["version"] == 0
            second = source.processes[0].pid
            # the restarted server still stops by itself once its run is gone
            assert f"{RUN_PID_ENV}={os.getpid()}".encode() in Path(f"/proc/{second}/environ").read_bytes().split(b"\0")
            os.kill(second, signal.SIGKILL)
            wait_for(lambda: events(logs, "inference server crashed; not restarted"), 10, "giving up")
            assert source.processes[0].pid == second and not healthy(url)
        finally:
            source.close()
    (restarted,) = events(logs, "inference server crashed; restarting")
    assert restarted["returncode"] == -signal.SIGKILL and restarted["restart"] == "1/1"
    (gave_up,) = events(logs, "inference server crashed; not restarted")
    assert "restarted 1 times already (inference.restarts)" in gave_up["reason"]
    assert gave_up["log"] == str(tmp_path / "logs" / "inference-0.log")
    assert pruner.prune(weights, 5) == [] and not (weights / "step_0").exists()  # closed: the lease is gone


def test_a_stopped_server_stays_down_and_nothing_restarts_once_the_source_closes(weights, tmp_path):
    source = make_component("rollout_source", "builtin", servers=2, max_slots=4, max_len=64, restarts=3)
    with capture_logs() as logs:
        try:
            source.start(weights / "step_0", tmp_path / "logs")
            stopped, crashed = (p.pid for p in source.processes)
            os.kill(stopped, signal.SIGTERM)  # asked to stop: exits 0, not a crash
            wait_for(lambda: events(logs, "inference server stopped; not restarted"), 30, "the stop")
            os.kill(crashed, signal.SIGKILL)
            source.close()  # before the supervisor's next look: it must not bring the crashed one back
        finally:
            source.close()
        time.sleep(3 * SUPERVISE_POLL_S)
    assert [e["index"] for e in events(logs, "inference server stopped; not restarted")] == [0]
    assert events(logs, "inference server crashed; restarting") == []
    assert server_pids(weights / "step_0") == []
    assert not [t for t in threading.enumerate() if t.name == "i3core-server-supervisor"]


def test_a_server_that_fails_at_start_up_is_an_error_not_a_restart(tmp_path):
    (tmp_path / "empty").mkdir()
    source = make_component("rollout_source", "builtin", servers=1, restarts=3)
    try:
        with pytest.raises(I3Error, match=r"inference server 0 exited with 1; see .*inference-0.log"):
            source.start(tmp_path / "empty", tmp_path / "logs")
    finally:
        source.close()
    assert server_pids(tmp_path / "empty") == []
