"""A killed `i3core run` leaves nothing behind: its trainer and inference servers stop on their own."""

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .conftest import ROOT, SERVERS

pytestmark = pytest.mark.slow


def test_sigkill_of_the_run_stops_its_trainer_and_servers(tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "i3core.cli", "run", str(ROOT / "examples" / "quickstart.toml"),
         "--set", f"run.output_dir='{out}'", "--set", "run.max_steps=200",
         *[a for s in SERVERS for a in ("--set", s)]],  # the run's own server processes
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # servers up, the trainer in its RL loop
            assert run.poll() is None, "the run ended before its first step"
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.2)
        children = psutil.Process(run.pid).children(recursive=True)
        names = [" ".join(c.cmdline()[1:4]) for c in children]
        assert any("i3core.loop.trainer" in " ".join(c.cmdline()) for c in children), names
        assert sum("inference.server" in " ".join(c.cmdline()) for c in children) == 2, names
        run.send_signal(signal.SIGKILL)
        run.wait()
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, f"left running after the run was killed: {[p.cmdline()[:4] for p in alive]}"
        assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1
    finally:
        if run.poll() is None:
            run.kill()
