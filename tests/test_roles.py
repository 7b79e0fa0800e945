"""The three roles started on their own, as deploy/'s templates start them, meeting in one output_dir."""

import json
import socket
import subprocess
import sys

import pytest

from .conftest import LEDGER, QUICKSTART_LOCAL, ROOT

pytestmark = pytest.mark.slow



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def role_config(tmp_path, steps: int = 2):
    text = (ROOT / "examples" / "quickstart.toml").read_text()
    for old, new in {'output_dir = "runs/quickstart"': f'output_dir = "{tmp_path / "run"}"',
                     "max_steps = 200": f"max_steps = {steps}", "[sft]\nsteps = 15": "[sft]\nsteps = 0",
                     QUICKSTART_LOCAL: '[inference]\nuse = "builtin"\nservers = 1\n'}.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "plugins.toml"
    path.write_text(text)
    return path


def test_trainer_inference_and_orchestrator_run_as_separate_processes(tmp_path):
    config, port = role_config(tmp_path), free_port()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("trainer", "inference", "orchestrator")}
    commands = {
        "trainer": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    "-m", "i3core.loop.trainer", str(config)],
        "inference": [sys.executable, "-m", "i3core.cli", "inference", str(config), "--index", "0",
                      "--port", str(port)],
        "orchestrator": [sys.executable, "-m", "i3core.cli", "orchestrator", str(config),
                         "--servers", f"http://127.0.0.1:{port}"],
    }  # fmt: skip
    procs = {name: subprocess.Popen(cmd, stdout=logs[name], stderr=subprocess.STDOUT) for name, cmd in commands.items()}
    try:
        assert procs["orchestrator"].wait(timeout=400) == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
        assert procs["trainer"].wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert procs["inference"].poll() is None  # a server serves until its launcher stops it
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        for log in logs.values():
            log.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollouts/started"] == sum(r[k] for k in LEDGER) for r in rows)
    assert rows[-1]["weights/served_version"] == 2
    assert (tmp_path / "run" / "plots" / "index.html").exists()
    assert "Traceback" not in (tmp_path / "orchestrator.log").read_text()


def test_roles_refuse_the_broadcast_weight_sync_in_one_line(tmp_path):
    config = role_config(tmp_path)
    config.write_text(config.read_text().replace('use = "filesystem"', 'use = "broadcast"').replace("keep = 3", ""))
    for role in (["inference", str(config)], ["orchestrator", str(config), "--servers", "http://127.0.0.1:1"]):
        result = subprocess.run([sys.executable, "-m", "i3core.cli", *role], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and result.stderr.splitlines() == [
            "error: weight_sync 'broadcast' works only under `i3core run`; roles on separate machines need "
            '[weight_sync] use = "filesystem"'], result.stderr


def test_roles_refuse_the_in_process_engine_in_one_line(tmp_path):
    """The quickstart as it is: its ``local`` engine lives in ``i3core run``'s orchestrator, not in roles."""
    config = tmp_path / "quickstart.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    expected = {
        "inference": "error: inference 'local' does not start server processes; it has no inference role",
        "orchestrator": "error: inference 'local' runs no servers for the orchestrator role to drive; roles on "
                        'separate machines need [inference] use = "builtin" or "vllm"'}
    for role in (["inference", str(config)], ["orchestrator", str(config), "--servers", "http://127.0.0.1:1"]):
        result = subprocess.run([sys.executable, "-m", "i3core.cli", *role], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and result.stderr.splitlines() == [expected[role[0]]], result.stderr
