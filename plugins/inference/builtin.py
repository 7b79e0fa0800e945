"""Rollout source ``builtin``: N independent builtin server processes on this machine.

Each server is its own process (``python -m i3core.plugins.inference.server``)
on 127.0.0.1 with a free port; the orchestrator gets one client per server.
"""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem, ServerError
from i3core.plugins.inference.client import InferenceClient

STARTUP_TIMEOUT_S = 120.0
"""Loading torch and the model takes a few seconds on 2 cores; a server that is not up by then failed."""
HEALTH_POLL_S = 0.2


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


class ServerProcesses:
    """Start ``servers`` server processes on 127.0.0.1 and hand out one client per server.

    Subclasses say which command starts server ``i`` (:meth:`command`). With a
    weight-sync ``receiver`` (a JSON spec, see the weight sync's ``receiver``),
    server ``i`` joins it as rank ``i + 1`` (:func:`receiver_args`).
    """

    Config = ServerConfig
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, config: ServerConfig):
        self.config = config
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []

    @staticmethod
    def check_config(config: ServerConfig, run) -> list[Problem]:
        """A server refuses a request for more than ``max_len`` tokens: the env must ask for fewer."""
        max_tokens = run.option("env", "max_tokens")
        if max_tokens is not None and max_tokens > config.max_len:
            return [Problem("env.max_tokens", f"{max_tokens} exceeds inference.max_len ({config.max_len}): "
                                              "the servers would refuse every request")]
        return []

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None) -> list[str]:
        raise NotImplementedError

    def environment(self, index: int, version: int, receiver: dict | None) -> dict[str, str] | None:
        """The environment of server ``index`` (None: this process's)."""
        return None

    def start(self, model_dir: Path, log_dir: Path, version: int = 0, receiver: dict | None = None) -> list[str]:
        """Start every server on ``model_dir``'s weights; return their base URLs once all are healthy."""
        log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.config.servers):
            port = _free_port(self.config.host)
            log = open(log_dir / f"inference-{i}.log", "ab")
            cmd = self.command(i, port, model_dir, version, receiver)
            env = self.environment(i, version, receiver)
            self.processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            self.urls.append(f"http://{self.config.host}:{port}")
        asyncio.run(self._wait_healthy(log_dir))
        return self.urls

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

    def client(self, url: str, tokenizer, stop_token_ids: list[int]) -> InferenceClient:
        """The orchestrator's client for the server at ``url``."""
        return InferenceClient(url, tokenizer, stop_token_ids=stop_token_ids, timeout_s=self.config.request_timeout_s)

    def close(self) -> None:
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


class BuiltinSource(ServerProcesses):
    """Rollout source ``builtin``: tiny-moe builtin inference servers."""

    class Config(ServerConfig):
        threads: int = Field(1, ge=1, description="torch CPU threads per server.")

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None) -> list[str]:
        return [
            sys.executable, "-m", "i3core.plugins.inference.server",
            "--model-dir", str(model_dir), "--host", self.config.host, "--port", str(port),
            "--max-slots", str(self.config.max_slots), "--max-len", str(self.config.max_len),
            "--threads", str(self.config.threads), "--version", str(version), *receiver_args(receiver, index),
        ]  # fmt: skip


def receiver_args(receiver: dict | None, index: int) -> list[str]:
    """The server flags that join server ``index`` to a weight-sync receiver group (none without one)."""
    if receiver is None:
        return []
    return ["--receiver", json.dumps(receiver), "--receiver-rank", str(index + 1)]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
