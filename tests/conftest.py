import asyncio
import contextlib
import json
import signal
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from i3core.testing import make_component, plugin_manager

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def builtins():
    """A fresh manager with i3core's built-in plugins only (installed third-party ones left out)."""
    return plugin_manager(installed=False)


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


QUICKSTART_LOCAL = '[inference]\nuse = "local"'
"""The quickstart's rollout source: the builtin engine inside the orchestrator's process (a comment follows)."""

SERVERS = ("inference.use='builtin'", "inference.servers=2", "inference.max_slots=64")
"""``--set`` overrides that turn the quickstart's in-process engine (``local``) into two builtin server processes
(HTTP): for the tests of the disaggregated path (server faults, roles, weight transports)."""

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


LEDGER = ["rollouts/trained", "rollouts/dropped_stale", "rollouts/masked", "rollouts/failed", "rollouts/in_flight"]
"""The buckets that add up to ``rollouts/started`` on every metrics row."""


def assert_ledger(rows: list[dict]) -> None:
    for row in rows:
        assert row["rollouts/started"] == sum(row[k] for k in LEDGER), row
        assert row["rollouts/in_flight"] >= 0


def read_metrics(out: Path) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` so far (none before the first step)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_while_running(proc: subprocess.Popen, condition, what: str, timeout: float = 300.0) -> None:
    """Until ``condition()`` holds; fails if ``proc`` (an ``i3core run``) ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: " + proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f}s"
        time.sleep(0.05)


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300.0) -> None:
    """Until the run writing ``out`` has written the metrics of ``step``."""
    wait_while_running(proc, lambda: len(read_metrics(out)) >= step, f"step {step}", timeout)


def sigint_as_at_a_terminal() -> None:
    """``preexec_fn`` of a process a test sends SIGINT: its default action back. A shell's background job (CI
    started as ``bash .ci/run &``) starts with SIGINT ignored, which every child inherits, and Python then
    installs no KeyboardInterrupt: the signal a terminal's Ctrl-C sends would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def killed_on_failure(proc: subprocess.Popen):
    """Kill ``proc`` (an ``i3core run``) if the block fails while it runs: a failed test leaves no run behind.
    First SIGUSR1 (the CLI then prints every thread's stack): the end of its stderr goes to the test's output."""
    try:
        yield
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            proc.kill()
            _, stderr = proc.communicate()
            print(f"--- the run's stderr, last 8000 characters ---\n{(stderr or '')[-8000:]}")
        raise


def finish_run(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 600.0) -> tuple[str, list[dict]]:
    """Wait for the run writing ``out`` to end; assert it exited 0 with the metrics of steps 1..``steps`` and
    the ledger adding up on every row. Returns its stderr and the rows."""
    with killed_on_failure(proc):
        _, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_ledger(rows)
    return stderr, rows


def interrupt_at_step(proc: subprocess.Popen, out: Path, step: int, max_steps: int) -> tuple[str, list[dict]]:
    """Once the run writing ``out`` has written ``step``'s metrics, SIGTERM it; assert it was interrupted (exit
    130) before ``max_steps`` with every row in order and the ledger adding up. Returns its stderr and the rows."""
    with killed_on_failure(proc):
        wait_for_step(proc, out, step)
        proc.send_signal(signal.SIGTERM)  # interrupted as Ctrl-C does
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < max_steps
    assert_ledger(rows)
    return stderr, rows


def trainer_command(config_path: Path, nproc: int, *args: str) -> list[str]:
    """``torchrun ... -m i3core.loop.trainer CONFIG ARGS``: the trainer role as ``i3core run`` starts it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "i3core.loop.trainer", str(config_path), *args]


def torchrun_trainer(config_path: Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The trainer role under torchrun on ``config_path``; asserts it exits 0 and returns what it printed."""
    result = subprocess.run(trainer_command(config_path, nproc, *args), capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


async def wait_until_running(client, metrics_path: str = "/i3/metrics", task=None) -> None:
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


def decode_across_cache_growth(model, capacity) -> float:
    """Largest |hidden state| gap between a full forward of 80 tokens and the cached decode of them (a 20-token
    prompt, then one token a step in slot 2 of 3, max_len 100), its prompt's entries copied to slot 0 at the end;
    ``capacity(cache)`` after the prompt, at 33 and 65 positions and at the end must be 32, 64, 100, 100: the cache
    grows as positions are written, and keeps what it held."""
    import torch

    seq = torch.randint(0, model.vocab_size, (1, 80), generator=torch.Generator().manual_seed(3))
    cache, slot, sizes = model.new_kv_cache(3, 100), torch.tensor([2]), []
    with torch.no_grad():
        full = model(seq)[0]
        outs = [model.forward_cached(seq[:, :20], torch.arange(20)[None], cache, slot)[0]]
        sizes.append(capacity(cache))
        for t in range(20, 80):
            outs.append(model.forward_cached(seq[:, t : t + 1], torch.tensor([[t]]), cache, slot)[0])
            if t + 1 in (33, 65):
                sizes.append(capacity(cache))
        cache.copy_slots(slot, torch.tensor([0]), 20)
        again = model.forward_cached(seq[:, 20:21], torch.tensor([[20]]), cache, torch.tensor([0]))[0]
        sizes.append(capacity(cache))
    assert sizes == [32, 64, 100, 100], sizes
    return max((torch.cat(outs) - full).abs().max().item(), (again - full[20:21]).abs().max().item())


@pytest.fixture(autouse=True)
def _no_admin_token_from_an_earlier_test():
    """An in-process ``i3core run`` puts the run's admin token in this process's environment (its servers and
    clients inherit it): after each test the token and the API key are what they were before it."""
    from i3core.lifetime import ADMIN_TOKEN_ENV, API_KEY_ENV

    before = {name: os.environ.get(name) for name in (ADMIN_TOKEN_ENV, API_KEY_ENV)}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _console_logging_reset():
    """A test that configures logging onto its captured stderr must not leave later tests writing to it
    once pytest has closed that stream."""
    yield
    import structlog

    structlog.reset_defaults()


SERVED_MODEL = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "num_experts": 2,
                "experts_per_token": 1, "moe_intermediate_size": 32}
"""A tiny-moe small enough to serve in a test."""


ADMIN_TOKEN = "test-admin-token"
"""The admin token :func:`i3core_serve` starts its server with (and puts in this process's environment meanwhile, so
the project's own clients send it)."""


@contextlib.contextmanager
def i3core_serve(directory: Path, name: str, max_len: int = 1024, prepare=None, args: tuple[str, ...] = ()):
    """``i3core serve DIR --enable-admin`` (admin token :data:`ADMIN_TOKEN`) in a subprocess on a fresh
    :data:`SERVED_MODEL` saved to ``directory`` (after ``prepare(module)`` sets its weights, when given), served as
    ``name``; yields its base URL, stops it afterwards. Its log is ``directory``'s sibling ``serve.log``."""
    from i3core.lifetime import ADMIN_TOKEN_ENV

    model = make_component("model", "tiny-moe", **SERVED_MODEL)
    module = model.build(seed=0)
    if prepare is not None:
        prepare(module)
    model.save_hf(module, directory)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = directory.parent / "serve.log"
    before = os.environ.get(ADMIN_TOKEN_ENV)
    os.environ[ADMIN_TOKEN_ENV] = ADMIN_TOKEN
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "serve", str(directory), "--port", str(port),
                                 "--max-len", str(max_len), "--served-model-name", name, "--enable-admin",
                                 "--model-option", f"hidden_size={SERVED_MODEL['hidden_size']}", *args],
                                stdout=log_file, stderr=subprocess.STDOUT)  # a pipe nobody reads would fill
    try:
        for _ in range(300):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if before is None:
            os.environ.pop(ADMIN_TOKEN_ENV, None)
        else:
            os.environ[ADMIN_TOKEN_ENV] = before

