"""``i3core sandbox-agent`` as a real subprocess against a namespaced target process started here.

One agent serves the whole module (it takes seconds to start): its readiness
POST is received by a real aiohttp server, then every route of the API in
docs/sandboxes.md is exercised over HTTP, including requests it must refuse.
"""

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from aiohttp import web

from i3core.sandbox.nsexec import cgroup_parents
from i3core.sandbox.base import AGENT_TOKEN_ENV, AGENT_UID

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

TOKEN = secrets.token_hex(16)
MAX_FILE_BYTES = 1 << 20


class ReadyReceiver:
    """A real aiohttp server, on its own thread and loop, recording readiness POSTs."""

    def __init__(self):
        self.posts: list[tuple[dict, str]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _ready(self, request: web.Request) -> web.Response:
        self.posts.append((await request.json(), request.headers.get("Authorization", "")))
        return web.Response(status=204)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.add_routes([web.post("/ready", self._ready)])
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def start(self) -> None:
        self._thread.start()
        assert self._started.wait(30)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


OWN_TMP = """
import ctypes, os, sys
keep, mark = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
held = os.open(keep, os.O_PATH)  # the host's directory, reachable once /tmp is covered
assert libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=16m,mode=1777") == 0, ctypes.get_errno()
os.makedirs(keep)
assert libc.mount(f"/proc/self/fd/{held}".encode(), keep.encode(), None, 4096, None) == 0, ctypes.get_errno()
os.execvp("sleep", ["sleep", mark])
"""


def start_target(mark: str, keep: Path) -> tuple[subprocess.Popen, int]:
    """``unshare`` with new mount and pid namespaces around ``sleep MARK``, with a /tmp of its own (a reset removes
    the commands' entries there: never the host's) in which the host's directory ``keep`` is bound at its own path;
    (the unshare process, the sleeper's pid)."""
    holder = subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                               sys.executable, "-c", OWN_TMP, str(keep), mark])  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = psutil.Process(holder.pid).children()
        if children and children[0].cmdline()[:1] == ["sleep"]:
            return holder, children[0].pid
        time.sleep(0.05)
    holder.kill()
    raise RuntimeError("unshare did not start its sleeper")


def root_of(path: Path) -> str:
    """The first component under /tmp of ``path`` (pytest's base directory)."""
    return path.relative_to("/tmp").parts[0]


def agent_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "i3core.cli", "sandbox-agent", *args]


@dataclass
class Agent:
    url: str
    proc: subprocess.Popen
    target_pid: int
    work: Path
    posts: list

    def call(self, method: str, path: str, body: bytes | dict | None = None, token: str | None = TOKEN,
             timeout: float = 60) -> tuple[int, bytes]:  # fmt: skip
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def exec(self, cmd, timeout: float | None = None) -> dict:
        status, body = self.call("POST", "/exec", {"cmd": cmd, "timeout": timeout})
        assert status == 200, (status, body)
        return json.loads(body)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    root.chmod(0o755)
    work = root / "work"  # made by the agent
    mark = str(2_000_000_000 + secrets.randbelow(100_000_000))
    holder, target_pid = start_target(mark, root)
    receiver = ReadyReceiver()
    receiver.start()
    proc = subprocess.Popen(agent_argv("--target-match", f"^sleep {mark}$", "--host", "127.0.0.1", "--port", "0",
                                       "--sandbox-id", "sb-agent-test", "--workdir", str(work),
                                       "--ready-url", f"http://127.0.0.1:{receiver.port}/ready", "--timeout-s", "10",
                                       "--max-output-bytes", "4096", "--max-file-bytes", str(MAX_FILE_BYTES)),
                            env={**os.environ, AGENT_TOKEN_ENV: TOKEN}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not receiver.posts:
            assert proc.poll() is None and time.monotonic() < deadline, "the agent never announced itself"
            time.sleep(0.05)
        address = receiver.posts[0][0]["address"]
        yield Agent(f"http://{address}", proc, target_pid, work, receiver.posts)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            receiver.stop()
            holder.kill()
            holder.wait(10)


def test_readiness_is_pushed_with_the_token(agent):
    body, authorization = agent.posts[0]
    host, port = body["address"].rsplit(":", 1)
    assert body == {"sandbox": "sb-agent-test", "address": f"127.0.0.1:{port}"} and int(port) > 0
    assert authorization == f"Bearer {TOKEN}"
    status, health = agent.call("GET", "/health", token=None)
    assert status == 200 and json.loads(health) == {"ok": True, "target_pid": agent.target_pid}


def test_exec_runs_inside_the_target_as_the_sandbox_user_without_network(agent):
    result = agent.exec(["sh", "-c", "echo $$; id -u; pwd; cat /proc/net/dev | grep -c :"])
    pid, uid, cwd, interfaces = result["stdout"].split()
    assert int(pid) < 100 and int(uid) == AGENT_UID and cwd == str(agent.work) and interfaces == "1", result
    assert result["exit_code"] == 0 and set(result) == {"exit_code", "stdout", "stderr", "timed_out", "oom_killed",
                                                        "truncated", "duration_s"}  # fmt: skip
    result = agent.exec("echo out; echo err >&2; exit 3")
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (3, "out\n", "err\n")
    result = agent.exec(["printf", "%s|", "a b", "$HOME"])
    assert result["stdout"] == "a b|$HOME|"
    assert agent.exec("head -c 100000 /dev/zero")["truncated"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), 2)\n" \
               "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)"  # fmt: skip
        assert "refused" in agent.exec(["python3", "-c", code])["stdout"]
    finally:
        listener.close()


def test_timeout_kills_every_process_of_the_sandbox(agent):
    result = agent.exec("sleep 300 >/dev/null 2>&1 & sleep 30", timeout=1)
    assert result["timed_out"] and result["exit_code"] is None, result
    assert not [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == AGENT_UID
                and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip


def test_files_round_trip_and_refusals(agent):
    assert agent.call("PUT", "/files?path=dir/a.txt", b"hello")[0] == 204
    assert agent.call("PUT", f"/files?path={agent.work}/dir/b.txt", b"abs")[0] == 204
    assert agent.call("GET", "/files?path=dir/a.txt") == (200, b"hello")
    assert agent.exec("cat dir/b.txt")["stdout"] == "abs"
    assert (agent.work / "dir" / "a.txt").stat().st_uid == AGENT_UID
    status, body = agent.call("GET", "/files?path=missing.txt")
    assert status == 404 and "error" in json.loads(body)
    agent.exec("ln -s /etc link")
    for method, path in (("GET", "/files?path=../x"), ("GET", "/files?path=/etc/passwd"), ("GET", "/files?path="),
                         ("GET", "/files"), ("GET", "/files?path=link/passwd"), ("PUT", "/files?path=link/x"),
                         ("PUT", "/files?path=/etc/x")):  # fmt: skip
        status, body = agent.call(method, path, b"x" if method == "PUT" else None)
        assert status == 400 and "error" in json.loads(body), (method, path, status, body)
    status, body = agent.call("PUT", "/files?path=big", b"x" * (MAX_FILE_BYTES + 1))
    assert status == 413 and "error" in json.loads(body)


def test_reset_kills_and_empties(agent):
    agent.call("PUT", "/files?path=x/y", b"1")
    agent.exec("sleep 300 >/dev/null 2>&1 &")
    tmp = Path(f"/proc/{agent.target_pid}/root/tmp")
    (tmp / "the-targets").write_text("kept")  # the target's own (root's): not the commands' to leave or take
    made = agent.exec("touch /tmp/left && mkdir -p /tmp/d/e && touch /tmp/d/e/f && ln -s /etc /tmp/link && ls /tmp")
    assert sorted(made["stdout"].split()) == sorted(["d", "left", "link", "the-targets", root_of(agent.work)]), made
    assert agent.call("POST", "/reset") == (204, b"")
    assert list(agent.work.iterdir()) == []
    assert sorted(os.listdir(tmp)) == sorted(["the-targets", root_of(agent.work)])  # judged from the host
    assert os.path.isdir("/etc") and agent.work.is_dir()
    rows = [line.split() for line in agent.exec(["ps", "-eo", "uid=,stat=,comm="])["stdout"].splitlines()]
    assert [row for row in rows if int(row[0]) == AGENT_UID and row[1] != "Z" and row[2] != "ps"] == [], rows


def test_files_and_reset_stay_on_the_work_directory_when_its_path_is_replaced(agent, tmp_path):
    """The agent holds its work directory open: renaming the path to it and planting a symlink in its place (what a
    command under a sticky /tmp could do) redirects neither file ops nor the reset's emptying."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    moved = agent.work.with_name("work.moved")
    agent.work.rename(moved)
    agent.work.symlink_to(elsewhere)
    try:
        assert agent.call("PUT", "/files?path=a.txt", b"into the real one")[0] == 204
        assert (moved / "a.txt").read_bytes() == b"into the real one"
        assert agent.call("GET", "/files?path=a.txt") == (200, b"into the real one")
        assert agent.call("GET", "/files?path=keep.txt")[0] == 404
        assert agent.call("POST", "/reset") == (204, b"")
        assert list(moved.iterdir()) == []
        assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    finally:
        agent.work.unlink()
        moved.rename(agent.work)


def test_auth_is_refused_without_the_token(agent):
    for method, path in (("POST", "/exec"), ("GET", "/files?path=a"), ("PUT", "/files?path=a"), ("POST", "/reset")):
        for token in (None, "wrong", ""):
            status, body = agent.call(method, path, {"cmd": "true"} if method == "POST" else b"x", token=token)
            assert status == 401 and "error" in json.loads(body), (method, path, token)
    assert not (agent.work / "a").exists()


@pytest.mark.parametrize("body", [b"{bad", b"[1]", b'"cmd"', b"{}", b'{"cmd": []}', b'{"cmd": [1]}',
                                  b'{"cmd": {"a": 1}}', b'{"cmd": null}', b'{"cmd": "true", "timeout": "x"}',
                                  b'{"cmd": "true", "timeout": -1}', b'{"cmd": "true", "timeout": true}',
                                  b'{"cmd": "true", "extra": 1}', b"\xff\xfe", b""])  # fmt: skip
def test_malformed_exec_requests_get_a_4xx_and_it_keeps_serving(agent, body):
    status, answer = agent.call("POST", "/exec", body)
    assert 400 <= status < 500 and "error" in json.loads(answer), (status, answer)
    assert agent.exec("echo still")["stdout"] == "still\n"


def test_unknown_routes_methods_and_huge_bodies_get_json_4xx(agent):
    for method, path, body, expected in (("GET", "/nope", None, 404), ("DELETE", "/exec", None, 405),
                                         ("POST", "/exec", b"{" + b" " * (8 << 20) + b"}", 413)):  # fmt: skip
        status, answer = agent.call(method, path, body)
        assert status == expected and "error" in json.loads(answer), (method, path, status)
    assert agent.exec("echo still")["stdout"] == "still\n"


def test_health_is_503_once_the_target_is_gone_and_sigterm_cleans_up(agent):
    os.kill(agent.target_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while agent.call("GET", "/health", token=None)[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, body = agent.call("GET", "/health", token=None)
    assert json.loads(body)["ok"] is False
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0
    parents, _ = cgroup_parents()  # the agent's cgroups are children of ours (it is our child process)
    assert not [p for p in parents.values() if (p / f"i3core-agent-{agent.proc.pid}").exists()]


def test_refuses_to_start_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != AGENT_TOKEN_ENV}
    result = subprocess.run(agent_argv("--target-pid", str(os.getpid()), "--workdir", str(tmp_path)), env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1 and AGENT_TOKEN_ENV in result.stderr, result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
