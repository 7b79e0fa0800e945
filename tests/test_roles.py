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


def test_roles_restarted_one_at_a_time_follow_the_trainer_and_train_every_step_once(tmp_path):
    """Kubernetes' semantics on one machine (no attempt id in common, each role restarted alone with --resume when
    it exits, as restartPolicy: OnFailure does): the orchestrator SIGKILLed and restarted asks the trainer for a new
    attempt (the trainer checkpoints and exits 75, and is restarted); then the trainer SIGKILLed and restarted, and
    the running orchestrator exits 75 to follow it. The run ends with one row per step and every prompt trained
    once."""
    import os
    import signal
    import time

    import psutil

    from i3core.loop.checkpoint import OrchestratorState

    from .conftest import assert_ledger, read_metrics

    # enough steps that the run is still going when the trainer is killed after step 6: with 8 a fast machine had
    # trained them all by then, and the restarted trainer found the run done (no new attempt to follow)
    steps = 24
    config, port = role_config(tmp_path, steps), free_port()
    config.write_text(config.read_text().replace("[trainer]\n", "[trainer]\ncheckpoint_every = 2\n"))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "I3CORE_ATTEMPT"}
    commands = {
        "trainer": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    "-m", "i3core.loop.trainer", str(config), "--resume"],
        "inference": [sys.executable, "-m", "i3core.cli", "inference", str(config), "--port", str(port), "--resume"],
        "orchestrator": [sys.executable, "-m", "i3core.cli", "orchestrator", str(config), "--resume",
                         "--servers", f"http://127.0.0.1:{port}"],
    }  # fmt: skip
    logs = {name: open(tmp_path / f"{name}.log", "a") for name in commands}
    procs, exits = {}, []

    def start(name):
        procs[name] = subprocess.Popen(commands[name], stdout=logs[name], stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)

    def kill(name):
        tree = [psutil.Process(procs[name].pid), *psutil.Process(procs[name].pid).children(recursive=True)]
        for member in tree:
            member.send_signal(signal.SIGKILL)
        procs[name].wait()
        psutil.wait_procs(tree, timeout=30)

    def asked_to_restart(name, code):
        """Exit 75; torchrun exits 1 for a rank's 75: the rank's own line says it."""
        if name == "trainer" and code == 1:
            errors = [ln for ln in (tmp_path / "trainer.log").read_text().splitlines() if ln.startswith("error: ")]
            return bool(errors) and errors[-1].startswith("error: stopped on restart:")
        return code == 75

    def supervise(until, timeout=400):
        """Restart a role that asks for it, as its restartPolicy would, until ``until()``."""
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in procs}
            for name, proc in procs.items():
                code = proc.poll()
                if code is not None and asked_to_restart(name, code):
                    exits.append(name)
                    start(name)
                elif code is not None and code != 0:
                    raise AssertionError(f"{name} exited {code}: " + (tmp_path / f"{name}.log").read_text()[-3000:])
            time.sleep(0.2)

    try:
        for name in commands:
            start(name)
        supervise(lambda: len(read_metrics(out)) >= 3)
        kill("orchestrator")
        start("orchestrator")
        supervise(lambda: exits == ["trainer"] and len(read_metrics(out)) >= 6)
        kill("trainer")
        start("trainer")
        supervise(lambda: procs["orchestrator"].poll() == 0)
        assert procs["trainer"].wait(timeout=120) == 0
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                kill(name)
        for log in logs.values():
            log.close()
    assert exits == ["trainer", "orchestrator"]
    assert "error: stopped on restart: checkpoint step_" in (tmp_path / "trainer.log").read_text()
    assert "error: the trainer started attempt" in (tmp_path / "orchestrator.log").read_text()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_ledger(rows)
    positions = [p for s in range(1, steps + 1)
                 for p in OrchestratorState.load(out / "orchestrator" / f"step_{s}.json").batch_positions]
    assert len(positions) == len(set(positions)) == steps * 8
