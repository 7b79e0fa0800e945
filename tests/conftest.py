import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from i3core.testing import plugin_manager

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def builtins():
    """A fresh manager with i3core's built-in plugins only (installed third-party ones left out)."""
    return plugin_manager(installed=False)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """``proc`` for the block; killed and drained if the block leaves it running (a failed assertion, a timeout),
    so no run outlives its test."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``i3core ARGS`` in a real subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "i3core.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


QUICKSTART_FILESYSTEM_SYNC = 'use = "filesystem"          # safetensors in broadcasts/step_N/ + a STABLE marker\nkeep = 3'


def quickstart_run(tmp_path: Path, *sets: str, replace: dict[str, str] | None = None,
                   timeout: float = 600) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    """``i3core run`` on the quickstart with text ``replace``-d in its TOML and ``--set`` overrides;
    the finished process, the run directory and its metrics rows."""
    config = (ROOT / "examples" / "quickstart.toml").read_text()
    for old, new in (replace or {}).items():
        assert old in config, old
        config = config.replace(old, new)
    path = tmp_path / "quickstart-variant.toml"
    path.write_text(config)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "i3core.cli", "run", str(path), "--set", f"run.output_dir='{out}'"]
    proc = subprocess.run([*args, *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                          timeout=timeout, check=False)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc, out, rows


def trainer_command(config_path: Path, nproc: int, *args: str) -> list[str]:
    """``torchrun ... -m i3core.trainer CONFIG ARGS``: the trainer role as ``i3core run`` starts it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "i3core.trainer", str(config_path), *args]


def torchrun_trainer(config_path: Path, nproc: int, *args: str, timeout: float = 300) -> None:
    """The trainer role under torchrun on ``config_path``; asserts it exits 0."""
    result = subprocess.run(trainer_command(config_path, nproc, *args), capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


async def wait_until_running(client, metrics_path: str = "/metrics", task=None) -> None:
    """Until the server reports a running sequence (bounded: about 5 s), or ``task`` is done."""
    for _ in range(500):
        if (await client._request("GET", metrics_path))["running"] >= 1 or (task is not None and task.done()):
            return
        await asyncio.sleep(0.01)


def abs_logprob_diffs(model, completion):
    """|server logprob - trainer logprob| per token of ``completion`` under the torch ``model``."""
    import torch

    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model.logits(model(ids)).float(), dim=-1)[0]
    start = len(completion.prompt_ids) - 1
    ref = torch.stack([logprobs[start + i, t] for i, t in enumerate(completion.token_ids)])
    return (ref - torch.tensor(completion.logprobs)).abs()


@pytest.fixture(autouse=True)
def _console_logging_reset():
    """A test that configures logging onto its captured stderr must not leave later tests writing to it
    once pytest has closed that stream."""
    yield
    import structlog

    structlog.reset_defaults()
