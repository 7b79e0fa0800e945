"""Fault injection on sandboxes, with real processes killed by signals: an ``i3core run`` of the code env on the
``local`` backend whose sandbox inits (and then its fork server) are SIGKILLed while the model's program runs in
them. Each such rollout is masked (``sandbox_failed``), the ledger still adds up, and the pool replaces what died.
The k8s agent killed mid-exec is in test_sandbox_k8s.py."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from i3core.sandbox.nsfork import INIT

from tests.sandbox_backends import running

from .conftest import assert_ledger, killed_on_failure, read_metrics, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

HARNESS = ["python3", "harness.py"]
"""The code env's test command: while it runs, the model's program is executing in that sandbox."""
INIT_KILLS = 3
"""Sandbox inits killed, each while the harness runs in it."""
KILL_WINDOW_S = 60.0
"""How long the test may look for a harness to kill in flight before it counts as failed."""

CONFIG = """\
[run]
name = "sandbox-faults"
max_steps = 24
seed = 0

[model]
use = "tiny-moe"

[inference]
use = "builtin"
servers = 1
max_slots = 32
max_len = 320

[env]
use = "code"
max_tokens = 120
max_total_tokens = 320
test_timeout_s = 5.0

[sandbox]
use = "local"
root_dir = "{root_dir}"
warm = 4
max_concurrent = 16

[sft]
steps = 3
batch_size = 32
lr = 3e-3

[trainer]
seq_len = 512
micro_batch_rows = 8

[loss]
use = "icepop"

[optimizer]
use = "adamw"
lr = 5e-4
weight_decay = 0.0

[scheduler]
use = "async"
group_size = 4
batch_size = 16
inflight = 32
max_off_policy_steps = 8
max_async = 1

[metrics]
use = "jsonl"

[weight_sync]
use = "filesystem"
keep = 3
"""


def pid_namespace(proc: psutil.Process) -> int:
    return os.stat(f"/proc/{proc.pid}/ns/pid").st_ino


def harnesses_in_flight(run: subprocess.Popen) -> list[tuple[psutil.Process, psutil.Process]]:
    """(harness, the init of its sandbox) for every code-env test run now executing in one of this run's
    sandboxes (descendants of ``run`` only: other sandboxes on this machine are left alone)."""
    inits, harnesses = {}, []
    for proc in psutil.Process(run.pid).children(recursive=True):
        try:
            cmdline = proc.cmdline()
            if cmdline == list(INIT):
                inits[pid_namespace(proc)] = proc
            elif cmdline == HARNESS:
                harnesses.append((proc, pid_namespace(proc)))
        except (psutil.Error, OSError):  # ended while we looked
            continue
    return [(harness, inits[ns]) for harness, ns in harnesses if ns in inits]


def kill_mid_exec(run: subprocess.Popen, victim) -> psutil.Process:
    """SIGKILL ``victim(harness, init)`` (a process) once a harness is running, and :return: it."""
    deadline = time.monotonic() + KILL_WINDOW_S
    while time.monotonic() < deadline:
        assert run.poll() is None, "the run ended before the faults were injected"
        for harness, init in harnesses_in_flight(run):
            if harness.is_running():
                target = victim(harness, init)
                target.send_signal(signal.SIGKILL)  # psutil: never a reused pid
                return target
        time.sleep(0.005)
    raise AssertionError(f"no code-env test run in flight within {KILL_WINDOW_S:g}s")


def fork_server(harness: psutil.Process, init: psutil.Process) -> psutil.Process:
    """The local backend's fork server (:mod:`i3core.sandbox.nsfork`): the parent of every command it runs."""
    server = harness.parent()
    assert server.cmdline()[2].endswith("nsfork.py"), server.cmdline()
    return server


def masked(rows: list[dict]) -> int:
    return rows[-1].get("rollouts/masked/sandbox_failed", 0) if rows else 0


def test_sandboxes_killed_mid_exec_mask_their_rollouts_and_the_run_trains_on(tmp_path):
    out, root_dir = tmp_path / "run", tmp_path / "sandboxes"
    config = tmp_path / "sandbox-faults.toml"
    config.write_text(CONFIG.format(root_dir=root_dir))
    run = subprocess.Popen([sys.executable, "-m", "i3core.cli", "run", str(config), "--set",
                            f"run.output_dir='{out}'"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    with killed_on_failure(run):
        wait_for_step(run, out, 2)  # RL under way: the kills hit rollouts, not the SFT warm-up
        before = read_metrics(out)[-1]
        for _ in range(INIT_KILLS):  # one sandbox at a time: its init takes the model's program down with it
            killed.append(kill_mid_exec(run, lambda harness, init: init))
            time.sleep(0.2)
        while not masked(read_metrics(out)):  # seen in a step's metrics before the next fault (bounded: the run)
            assert run.poll() is None, "no rollout masked after the inits were killed"
            time.sleep(0.05)
        # the fork server behind every local sandbox: all of them die, the backend starts a new one
        killed.append(kill_mid_exec(run, fork_server))
        step_at_kills = len(read_metrics(out))
        stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr + stdout, (stdout + stderr)[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert_ledger(rows)
    for row in rows:
        assert row["rollouts/failed"] == 0, row  # a sandbox that dies is a mask, not a failure of the env
    last = rows[-1]
    assert masked(rows) >= masked(rows[:step_at_kills]) + 1, last  # the fork server's death masked more
    assert last["sandboxes/failed"] >= 1 and last["sandboxes/created"] > before["sandboxes/created"], last
    assert step_at_kills < len(rows) and last["rollouts/trained"] > rows[step_at_kills - 1]["rollouts/trained"]
    assert not [p for p in killed if running(p)]
    assert list(root_dir.iterdir()) == []  # every sandbox, dead or alive, was cleaned up
    print(json.dumps({k: v for k, v in last.items() if k.startswith(("rollouts/", "sandboxes/"))}))
