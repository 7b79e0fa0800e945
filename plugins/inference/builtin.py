"""Rollout source ``builtin``: N independent builtin server processes on this machine.

Each server is its own process (``python -m i3core.plugins.inference.server``)
on 127.0.0.1 with a free port; the orchestrator gets one client per server.

Once every server is up, a supervisor thread watches them for the rest of the
run: a server that crashes (a non-zero exit or a signal such as SIGKILL) is
started again with the same command, port and weights, at most ``restarts``
times; the orchestrator's re-probe then brings it to the served version and
re-admits it. A server that exits 0 was asked to stop (SIGTERM, Ctrl-C) and is
left down. Supervision ends at :meth:`ServerProcesses.close`, before the
servers are stopped, so nothing restarts during shutdown.
"""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem, ServerError
from i3core.plugins.inference.client import InferenceClient
from i3core.weights import STABLE, check_max_len, reading

log = structlog.get_logger("i3core.inference")

STARTUP_TIMEOUT_S = 120.0
"""Loading torch and the model takes a few seconds on 2 cores; a server that is not up by then failed."""
HEALTH_POLL_S = 0.2
SUPERVISE_POLL_S = 0.5
"""How often the supervisor looks for a crashed server: a restart begins at most this long after the crash."""


def max_tokens_problems(run, max_len: int, engine: str) -> list[Problem]:
    """``env.max_tokens`` above ``inference.max_len``: ``engine`` (who serves) would refuse every request."""
    max_tokens = run.option("env", "max_tokens")
    if max_tokens is not None and max_tokens > max_len:
        return [Problem("env.max_tokens", f"{max_tokens} exceeds inference.max_len ({max_len}): "
                                          f"{engine} would refuse every request")]
    return []

class ServerConfig(BaseModel):
    """What every source of local server processes takes."""

    model_config = ConfigDict(extra="forbid")

    servers: int = Field(2, ge=1, le=64, description="Independent server processes.")
    max_slots: int = Field(64, ge=1, description="Sequences each server decodes together.")
    max_len: int = Field(256, ge=8, description="Longest prompt + completion, in tokens.")
    host: str = Field("127.0.0.1", description="Address the servers listen on (loopback only by default).")
    request_timeout_s: float = Field(
        600.0, gt=0, description="A completion not back by then marks its server down (its rollouts are re-queued)."
    )
    restarts: int = Field(
        3, ge=0, description="Times each server is started again (same port and weights) after it crashes mid-run; "
                             "0: never. Keeps the version the servers started from on disk for the run.")


class ServerProcesses:
    """Start ``servers`` server processes on 127.0.0.1, hand out one client per server, restart crashed ones.

    Subclasses say which command starts server ``i`` (:meth:`command`). With a
    weight-sync ``receiver`` (a JSON spec, see the weight sync's ``receiver``),
    server ``i`` joins it as rank ``i + 1`` (:func:`receiver_args`); such a
    server is not restarted (a broadcast group cannot take a member back).
    """

    Config = ServerConfig
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, config: ServerConfig):
        self.config = config
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self._launches: list[tuple[list[str], dict[str, str] | None, Path]] = []
        """Per server, what starts it: its command, its environment and its log file."""
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lease = contextlib.ExitStack()

    @staticmethod
    def check_config(config: ServerConfig, run) -> list[Problem]:
        """A server refuses a request for more than ``max_len`` tokens: the env must ask for fewer."""
        return max_tokens_problems(run, config.max_len, "the servers")

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None,
                model: dict | None = None) -> list[str]:
        """The command line of server ``index``; ``model`` is the run's ``[model]`` (``{"use": name, **options}``),
        None for the servers' default."""
        raise NotImplementedError

    def environment(self, index: int, version: int, receiver: dict | None, model_dir: Path | None = None,
                    model: dict | None = None) -> dict[str, str] | None:
        """The environment of server ``index`` started on ``model_dir`` as ``model`` (None: this process's)."""
        return None

    def start(self, model_dir: Path, log_dir: Path, version: int = 0, receiver: dict | None = None,
              model: dict | None = None) -> list[str]:
        """Start every server on ``model_dir``'s weights, served as the model component ``model`` (the run's
        ``[model]`` as ``{"use": name, **options}``; None: the servers' default); return their base URLs once
        all are healthy.

        From then on until :meth:`close`, a server that crashes is restarted (``restarts``). While restarts are
        allowed, a reader's lease holds ``model_dir`` when it is a weight version (it has a STABLE marker), so
        the weight sync does not prune the weights a restarted server loads.
        """
        if receiver is None:  # said here with the run's key, not by each server with its --max-len flag
            check_max_len(Path(model_dir), self.config.max_len, "inference.max_len")
        log_dir.mkdir(parents=True, exist_ok=True)
        restart = self.config.restarts > 0 and receiver is None
        if restart and (Path(model_dir) / STABLE).exists():
            self._lease.enter_context(reading(Path(model_dir)))
        for i in range(self.config.servers):
            port = _free_port(self.config.host)
            cmd = self.command(i, port, model_dir, version, receiver, model)
            env = self.environment(i, version, receiver, Path(model_dir), model)
            self._launches.append((cmd, env, log_dir / f"inference-{i}.log"))
            self.processes.append(self._launch(i))
            self.urls.append(f"http://{self.config.host}:{port}")
        asyncio.run(self._wait_healthy(log_dir))
        if self.config.restarts > 0:
            why_not = None if restart else "a server of a broadcast weight sync cannot rejoin its group"
            self._supervisor = threading.Thread(target=self._supervise, args=(why_not,),
                                                name="i3core-server-supervisor", daemon=True)
            self._supervisor.start()
        return self.urls

    def _launch(self, index: int) -> subprocess.Popen:
        cmd, env, log_path = self._launches[index]
        with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
            # a process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches the process
            # that started it, which stops its servers itself (close); they no longer shut down under a run that
            # is still deciding what the interrupt means
            return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, process_group=0)

    def _supervise(self, why_not: str | None) -> None:
        """Restart each crashed server, ``restarts`` times at most, until :meth:`close` (a daemon thread)."""
        left = [self.config.restarts] * len(self.processes)
        settled: set[int] = set()
        """Servers that exited and stay down."""
        while not self._closing.wait(SUPERVISE_POLL_S):
            for i, proc in enumerate(self.processes):
                code = proc.poll()
                if code is None or i in settled or self._closing.is_set():
                    continue
                where = {"index": i, "url": self.urls[i], "returncode": code, "log": str(self._launches[i][2])}
                if code == 0:  # asked to stop (SIGTERM, Ctrl-C): not a crash
                    settled.add(i)
                    log.info("inference server stopped; not restarted", **where)
                elif why_not is not None or left[i] == 0:
                    settled.add(i)
                    reason = why_not or f"restarted {self.config.restarts} times already (inference.restarts)"
                    log.warning("inference server crashed; not restarted", **where, reason=reason)
                else:
                    left[i] -= 1
                    log.warning("inference server crashed; restarting", **where,
                                restart=f"{self.config.restarts - left[i]}/{self.config.restarts}")
                    try:
                        self.processes[i] = self._launch(i)
                    except OSError as exc:
                        settled.add(i)
                        log.warning("inference server crashed; not restarted", **where, reason=str(exc))

    async def _wait_healthy(self, log_dir: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for i, (url, proc) in enumerate(zip(self.urls, self.processes)):
            client = InferenceClient(url, tokenizer=None)
            try:
                while True:
                    if proc.poll() is not None:
                        raise I3Error(f"inference server {i} exited with {proc.returncode}; see {log_dir}/inference-{i}.log")
                    try:
                        await client.health()
                        break
                    except ServerError:
                        if time.monotonic() > deadline:
                            raise I3Error(f"inference server {i} not healthy after {self.startup_timeout_s:.0f}s") from None
                        await asyncio.sleep(HEALTH_POLL_S)
            finally:
                await client.close()

    def client(self, url: str, tokenizer, stop_token_ids: list[int], stop: list[str] = ()) -> InferenceClient:
        """The orchestrator's client for the server at ``url``, stopping by default at ``stop_token_ids`` and the
        ``stop`` strings."""
        return InferenceClient(url, tokenizer, stop_token_ids=stop_token_ids, stop=stop,
                               timeout_s=self.config.request_timeout_s)

    def close(self) -> None:
        """Stop supervising, then stop every server (SIGTERM, SIGKILL after 10 s) and release the weights."""
        self._closing.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        self._lease.close()


class BuiltinSource(ServerProcesses):
    """Rollout source ``builtin``: builtin inference servers over the run's model component."""

    class Config(ServerConfig):
        threads: int = Field(1, ge=1, description="torch CPU threads per server.")
        served_model_name: str | None = Field(
            None, description="The model name the servers answer to and echo in responses (default: its directory).")

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None,
                model: dict | None = None) -> list[str]:
        return [
            sys.executable, "-m", "i3core.plugins.inference.server",
            "--model-dir", str(model_dir), "--host", self.config.host, "--port", str(port),
            "--max-slots", str(self.config.max_slots), "--max-len", str(self.config.max_len),
            "--threads", str(self.config.threads), "--version", str(version), *model_args(model),
            *(["--served-model-name", self.config.served_model_name] if self.config.served_model_name else []),
            *receiver_args(receiver, index),
        ]  # fmt: skip


def model_args(model: dict | None) -> list[str]:
    """The server flags that pick the model component ``model`` (``{"use": name, **options}``; none for None)."""
    if model is None:
        return []
    options = {k: v for k, v in model.items() if k != "use"}
    return ["--model", model["use"], "--model-options", json.dumps(options)]


def receiver_args(receiver: dict | None, index: int) -> list[str]:
    """The server flags that join server ``index`` to a weight-sync receiver group (none without one)."""
    if receiver is None:
        return []
    return ["--receiver", json.dumps(receiver), "--receiver-rank", str(index + 1)]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
