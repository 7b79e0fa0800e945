"""Hostile code against every sandbox backend that runs here (local always; docker where an engine runs).

Each attack must be contained: the result says what happened, the host and a
neighbouring sandbox are unaffected, and nothing the attack started is left
once the sandbox is closed. The same suite runs over each backend.
"""

import asyncio
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from i3core.errors import SandboxFileError
from tests.sandbox_backends import SANDBOX_BACKENDS, backend_for

pytestmark = pytest.mark.sandbox

LIMITS = {"memory_mb": 128, "pids": 64, "timeout_s": 10.0, "max_output_bytes": 64 * 1024}


@pytest.fixture(params=SANDBOX_BACKENDS)
def backend(request, tmp_path):
    backend = backend_for(request.param, tmp_path, **LIMITS)
    yield backend
    asyncio.run(backend.aclose())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def neighbour_ok(backend) -> None:
    """A second sandbox still works while (or after) the first one misbehaves."""
    async with await backend.create() as other:
        result = await other.exec("echo alive", timeout=20)
        assert result.exit_code == 0 and result.stdout == "alive\n", result


def test_protocol_round_trip(backend):
    async def go():
        async with await backend.create() as sb:
            await sb.write_file("dir/prog.py", "print(open('dir/data.txt').read().upper())")
            await sb.write_file("dir/data.txt", b"hello")
            result = await sb.exec(["python3", "dir/prog.py"])
            assert (result.exit_code, result.stdout, result.timed_out, result.truncated) == (0, "HELLO\n", False, False)
            result = await sb.exec("echo out; echo err >&2; exit 3")
            assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
            await sb.exec("printf made > made.txt")
            assert await sb.read_file("made.txt") == b"made"
            assert await sb.read_file(f"{LIMITS.get('workdir', '/work')}/made.txt") == b"made"
            assert await sb.alive()
            await sb.reset()
            assert (await sb.exec("ls -A")).stdout == ""
            with pytest.raises(SandboxFileError):
                await sb.read_file("made.txt")

    run(go())


def test_fork_bomb(backend):
    async def go():
        async with await backend.create() as sb:
            await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=8)
            await neighbour_ok(backend)  # the pids limit held the bomb inside its sandbox
            await sb.reset()  # the bomb's processes are gone and the sandbox works again
            assert await sb.alive()
            again = await sb.exec("echo ok", timeout=20)
            assert (again.exit_code, again.stdout) == (0, "ok\n"), again
        await neighbour_ok(backend)

    run(go())


def test_memory_hog(backend):
    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(["python3", "-c", "b = []\nwhile True: b.append(bytearray(16 << 20))"], timeout=20)
            assert result.exit_code != 0 and not result.timed_out, result
            assert result.oom_killed in (True, None), result
            if result.oom_killed is None:  # an address-space rlimit: Python raises MemoryError
                assert "MemoryError" in result.stderr, result
            await neighbour_ok(backend)

    run(go())


def test_infinite_loop_times_out_and_is_killed(backend):
    async def go():
        async with await backend.create() as sb:
            start = time.monotonic()
            result = await sb.exec("while :; do :; done", timeout=1.5)
            assert result.timed_out and result.exit_code is None, result
            assert time.monotonic() - start < 10
            left = await sb.exec(["ps", "-eo", "comm="])  # an argv: no shell of our own to count
            assert left.exit_code == 0 and "sh" not in left.stdout.split(), left  # the looping shell is gone

    run(go())


def test_cpu_spin_in_many_threads(backend):
    async def go():
        async with await backend.create() as sb:
            code = "import threading\nfor _ in range(16): threading.Thread(target=lambda: any(iter(int, 1))).start()"
            task = asyncio.create_task(sb.exec(["python3", "-c", code], timeout=3))
            await neighbour_ok(backend)  # a neighbour still answers while 16 threads spin
            result = await task
            assert result.timed_out, result

    run(go())


def test_no_network_to_the_host_loopback(backend):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]

    async def go():
        async with await backend.create() as sb:
            code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
                    f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
                    f"except OSError as e:\n    print('refused', e)")  # fmt: skip
            result = await sb.exec(["python3", "-c", code])
            assert "CONNECTED" not in result.stdout and "refused" in result.stdout, result

    try:
        run(go())
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_writing_outside_the_work_directory(backend, tmp_path):
    marker = tmp_path / "host-marker"

    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(f"echo pwned > {marker}; echo pwned > /etc/i3-pwned; echo pwned > /usr/i3-pwned")
            assert result.exit_code != 0, result
            with pytest.raises(SandboxFileError):
                await sb.write_file("../escape.txt", "x")
            with pytest.raises(SandboxFileError):
                await sb.write_file("/etc/i3-pwned", "x")

    run(go())
    assert not marker.exists()
    assert not Path("/etc/i3-pwned").exists() and not Path("/usr/i3-pwned").exists()


def test_host_environment_and_home_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("I3_HOST_SECRET", "s3cret-value")
    home = Path.home()
    secret = home / ".i3-sandbox-test-secret"
    secret.write_text("s3cret-file")

    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(f"env; cat /proc/1/environ; cat {secret}; ls -A {home}")
            assert "s3cret" not in result.stdout + result.stderr, result
            assert "I3_HOST_SECRET" not in result.stdout, result

    try:
        run(go())
    finally:
        secret.unlink()


def test_kill_all_stays_inside(backend):
    async def go():
        async with await backend.create() as sb:
            bystander = subprocess.Popen(["sleep", "60"])  # a host process of ours, as kill -1 would see it
            try:
                await sb.exec("kill -9 -1; echo after", timeout=5)  # kills its own shell, nothing else
                assert await sb.alive()  # the sandbox's init survived
                again = await sb.exec("echo ok", timeout=20)
                assert (again.exit_code, again.stdout) == (0, "ok\n"), again
                await neighbour_ok(backend)
                assert bystander.poll() is None, "kill -9 -1 in a sandbox reached a host process"
            finally:
                bystander.kill()
                bystander.wait()

    run(go())


def test_daemon_left_behind_is_gone_after_close(backend):
    marker = f"i3-daemon-{uuid.uuid4().hex[:12]}"  # the daemon's $0: findable on the host, and only it

    async def go():
        sb = await backend.create()
        result = await sb.exec(f"nohup setsid sh -c 'while :; do sleep 1; done' {marker} >/dev/null 2>&1 & echo started")
        assert result.stdout == "started\n", result
        await asyncio.sleep(0.5)
        assert marker in (await sb.exec(["ps", "-eo", "args="])).stdout
        assert _pids_with(marker), "the daemon is not visible from the host"
        await sb.close()
        assert not await sb.alive()

    run(go())
    time.sleep(0.5)
    assert _pids_with(marker) == set(), "a daemon outlived close()"


def test_a_gigabyte_of_stdout_is_capped(backend):
    async def go():
        async with await backend.create() as sb:
            start = time.monotonic()
            result = await sb.exec("head -c 1073741824 /dev/zero | tr '\\0' x; echo done >&2", timeout=60)
            assert result.truncated and len(result.stdout.encode()) <= LIMITS["max_output_bytes"], len(result.stdout)
            assert result.exit_code == 0 and result.stderr == "done\n", result.stderr
            assert time.monotonic() - start < 60

    run(go())


def test_symlink_escape_through_read_file(backend):
    async def go():
        async with await backend.create() as sb:
            await sb.exec("ln -s /etc/shadow shadow; ln -s / root; mkdir d; ln -s /etc d/etc")
            for path in ("shadow", "root/etc/shadow", "d/etc/hostname"):
                with pytest.raises(SandboxFileError):
                    await sb.read_file(path)
            with pytest.raises(SandboxFileError):
                await sb.write_file("root/tmp/i3-escaped", "x")  # a symlinked parent is refused too
            await sb.write_file("shadow", "replaced")  # replaces the link itself, never its target
            assert await sb.read_file("shadow") == b"replaced"

    run(go())
    assert not Path("/tmp/i3-escaped").exists()
    assert "replaced" not in Path("/etc/shadow").read_text()


def _pids_with(marker: str) -> set[int]:
    """Host processes whose command line holds ``marker``."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or ()):
            found.add(proc.pid)
    return found
