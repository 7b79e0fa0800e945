"""The schedulers end to end: `i3core run` with simulated servers (real processes) and the real trainer.

The ledger (started = trained + dropped_stale + masked + failed + in_flight,
with in_flight counted from where the rollouts are) is checked at every step,
under forced staleness and a server that stops answering and comes back.
"""

import os
import signal
import subprocess
import sys

import pytest

from i3core.config import validate
from i3core.testing import plugin_manager

from .conftest import (assert_ledger, interrupt_at_step, killed_on_failure, read_metrics, wait_for_step,
                       wait_while_running)
from .test_end_to_end import logged, server_pids

pytestmark = pytest.mark.slow

HUNG_MAX_STEPS = 5000
"""Far past the hung-server test's end: the run is interrupted once the server is back and has served, so the test
does not bet on how many steps its re-probe (backoff up to 8 s) takes (80 steps did, with a few seconds to spare)."""

BASE = """
[run]
output_dir = "{out}"
max_steps = {steps}
seed = 0

[model]
use = "tiny-moe"

[inference]
use = "simulated"
servers = 2
max_slots = 16
max_len = 256
request_timeout_s = {timeout}
timing = {{ step_base_ms = 5, length_min = 4, length_median = 10, length_max = 24 }}

[env]
use = "reverse-text"
num_examples = 500
max_tokens = 32

[sft]
steps = 2

[trainer]
seq_len = 256

[scheduler]
{scheduler}
"""


def start(tmp_path, steps: int, scheduler: str, timeout: float = 600.0):
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(BASE.format(out=out, steps=steps, scheduler=scheduler, timeout=timeout))
    proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "run", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    return out, proc


def test_the_config_resolves_with_the_simulated_source(tmp_path):
    import tomllib

    text = BASE.format(out=tmp_path, steps=1, scheduler='use = "sync"', timeout=5.0)
    config = validate(tomllib.loads(text), plugin_manager(installed=False))
    assert config.get("inference").config.timing.length_max == 24


def test_sync_trains_every_batch_on_the_weights_that_generated_it(tmp_path):
    out, proc = start(tmp_path, 5, 'use = "sync"\ngroup_size = 4\nbatch_size = 16')
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert_ledger(rows)
    for row in rows:
        assert row["off_policy/max_steps"] == 0
        assert row["weights/served_version"] == row["step"]
        # one batch at a time: nothing generates beyond the batch being trained
        assert row["rollouts/started"] == 16 * row["step"]
        assert row["rollouts/trained"] == 16 * row["step"]
    assert rows[-1]["rollouts/dropped_stale"] == 0
    assert "Traceback" not in stderr


def test_ledger_holds_under_forced_staleness_and_a_server_that_hangs_and_comes_back(tmp_path):
    scheduler = ('use = "async"\ngroup_size = 4\nbatch_size = 16\ninflight = 32\n'
                 "max_async = 2\nweight_update_lag = 1\nmax_off_policy_steps = 1")  # fmt: skip
    out, proc = start(tmp_path, HUNG_MAX_STEPS, scheduler, timeout=2.0)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        pids = server_pids(out)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGSTOP)  # hangs: its requests time out, it is marked down
        wait_for_step(proc, out, 8)
        os.kill(pids[0], signal.SIGCONT)  # answers again: the re-probe lets it back in
        wait_while_running(proc, lambda: logged(out, "inference server re-admitted"), "the re-admission")
    # steps with both servers live again
    stderr, rows = interrupt_at_step(proc, out, len(read_metrics(out)) + 3, HUNG_MAX_STEPS)
    last = rows[-1]
    assert last["rollouts/dropped_stale"] > 0  # forced staleness dropped whole groups ...
    assert last["rollouts/trained"] >= len(rows) * 16  # ... and every step still got a batch
    assert last["rollouts/requeued"] > 0 and last["rollouts/failed"] == 0
    assert all(r["off_policy/max_steps"] <= 1 for r in rows)
    assert "inference server marked down" in stderr and "inference server re-admitted" in stderr
    assert min(r["servers/live"] for r in rows) == 1 and last["servers/live"] == 2
    assert "Traceback" not in stderr
