"""The ``local`` backend's own behaviour, over real sandboxes: what it detects, what it leaves behind, reset,
many sandboxes at once, argv versus shell strings, and bad input. The hostile suite is test_sandbox_hostile.py."""

import asyncio
import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import psutil
import pytest

from i3core.errors import SandboxError, SandboxFileError
from i3core.sandbox.base import as_bytes, read_beneath, write_beneath
from i3core.testing import make_component
from tests.sandbox_backends import all_gone, namespace_members, running, sleep_in_flight

pytestmark = pytest.mark.sandbox

LIMITS = {"memory_mb": 128, "pids": 64, "timeout_s": 10.0, "cpus": 0.5, "file_size_mb": 1}


@pytest.fixture
def backend(tmp_path):
    backend = make_component("sandbox", "local", root_dir=str(tmp_path / "sandboxes"), **LIMITS)
    yield backend
    asyncio.run(backend.aclose())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_host_support_is_detected_and_limits_reach_the_cgroup(backend):
    backend.start()
    assert set(backend.missing) <= {"cgroup memory", "cgroup pids", "cgroup cpu"}
    assert set(backend.cgroup_parents) | {k.split()[1] for k in backend.missing} == {"memory", "pids", "cpu"}

    async def go():
        async with await backend.create() as sb:
            cgroup = sb._jail.cgroup
            if "memory" in backend.cgroup_parents:
                assert (cgroup.dirs["memory"] / "memory.limit_in_bytes").read_text().strip() == str(128 << 20)
                assert cgroup.oom_kills() == 0
            if "pids" in backend.cgroup_parents:
                assert (cgroup.dirs["pids"] / "pids.max").read_text().strip() == "64"
            if "cpu" in backend.cgroup_parents:
                assert (cgroup.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
            result = await sb.exec("cat /proc/self/cgroup")
            for controller, path in cgroup.dirs.items():  # the command runs inside the sandbox's cgroups
                assert f"{path.name}\n" in result.stdout, (controller, result.stdout)

    run(go())


def test_close_leaves_no_process_cgroup_or_directory(backend, tmp_path):
    async def go():
        sb = await backend.create()
        await sb.write_file("keep.txt", "x")
        started = await sb.exec("setsid sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & echo $!")
        assert started.exit_code == 0, started
        init = sb._jail.pid
        members = namespace_members(init)
        assert len(members) >= 2, members  # init, the loop (and its sleep)
        dirs = list(sb._jail.cgroup.dirs.values()) if sb._jail.cgroup else []
        base = sb._base
        assert base.is_dir() and all(d.is_dir() for d in dirs)
        await sb.close()
        await sb.close()  # idempotent
        assert not await sb.alive()
        assert not [p for p in members if running(p)], "a process of the sandbox outlived close()"
        assert not any(d.exists() for d in dirs), "a cgroup directory outlived close()"
        assert not base.exists()
        with pytest.raises(SandboxError):
            await sb.exec("true")

    run(go())
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_reset_kills_everything_but_init_and_empties_the_work_dir_and_tmp(backend):
    async def go():
        async with await backend.create() as sb:
            await sb.write_file("a/b.txt", "data")
            quiet = ">/dev/null 2>&1"  # a background process holding stdout open would hold exec until its timeout
            await sb.exec(f"echo x > /tmp/t; echo y > /dev/shm/s; (sleep 300 {quiet} &) ; sleep 300 {quiet} &")
            assert "sleep" in (await sb.exec(["ps", "-eo", "comm="])).stdout
            await sb.reset()
            ps = await sb.exec(["ps", "-eo", "pid=,comm="])
            assert [line.split()[1] for line in ps.stdout.splitlines()] == ["sleep", "ps"], ps.stdout  # init, ps
            assert (await sb.exec("ls -A . /tmp /dev/shm")).stdout == ".:\n\n/dev/shm:\n\n/tmp:\n"
            assert await sb.alive()
            result = await sb.exec("echo again > f; cat f")
            assert result.stdout == "again\n"

    run(go())


def test_32_sandboxes_at_once_are_isolated_from_each_other(backend):
    async def one(index: int):
        sb = await backend.create()
        await sb.write_file("me.txt", str(index))
        result = await sb.exec("cat me.txt; echo; id -u; ls /proc | grep -c '^[0-9]'")
        return sb, result

    async def go():
        pairs = await asyncio.gather(*(one(i) for i in range(32)))
        uids = set()
        for index, (sb, result) in enumerate(pairs):
            me, uid, processes = result.stdout.split()
            assert me == str(index) and int(processes) <= 4, result  # its own only: init, sh, ls, grep
            uids.add(uid)
        assert len(uids) == 32  # one uid per sandbox: RLIMIT_NPROC and kill -1 stay per sandbox
        await asyncio.gather(*(sb.close() for sb, _ in pairs))

    run(go())


def test_argv_is_literal_and_a_string_is_shell(backend):
    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(["printf", "%s|", "a b", "$HOME", ";", "*"])
            assert result.stdout == "a b|$HOME|;|*|", result
            result = await sb.exec("printf '%s|' $HOME; echo; kill -TERM $$")
            assert result.stdout == "/work|\n" and result.exit_code == -15, result
            result = await sb.exec(["no-such-program"])
            assert result.exit_code == 127 and "no-such-program" in result.stderr, result
            result = await sb.exec(["env"])
            assert dict(line.split("=", 1) for line in result.stdout.splitlines()) == {
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/work",
                "LANG": "C.UTF-8", "USER": "sandbox", "TMPDIR": "/tmp"}  # fmt: skip
            status = (await sb.exec("grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs):' /proc/self/status")).stdout
            assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
            assert "NoNewPrivs:\t1" in status and "Uid:\t0" not in status
            assert (await sb.exec("cat /proc/net/dev | grep -c :")).stdout == "1\n"  # lo only
            result = await sb.exec("head -c 2000000 /dev/zero > big")  # file_size_mb = 1
            assert result.exit_code != 0, result
            assert (await sb.exec("python3 -c 'import sys; print(sys.executable)'")).stdout == "/usr/bin/python3\n"
            result = await sb.exec(["printf", "%s", "x" * 100_000, "y" * 100_000])  # long argv travel whole
            assert result.stdout == "x" * 100_000 + "y" * 100_000, len(result.stdout)
            result = await sb.exec("echo " + "z" * 200_000)  # past execve's 128 KiB per argument: its error
            assert result.exit_code == 126 and "Argument list too long" in result.stderr, result
            result = await sb.exec(["true", "w" * (3 << 20)])  # past execve's 2 MiB in all: refused, one line
            assert result.exit_code == 126 and "too long" in result.stderr and result.stderr.count("\n") == 1

    run(go())


@pytest.mark.parametrize("cmd", [[], [1, 2], ["ok", None], 7, None, ["a\0b"], "echo \0", ["echo", "\ud800"]])
def test_bad_commands_are_refused_results(backend, cmd):
    """A command or timeout no program can take is an exec result (126, one line on stderr), never an exception:
    the model wrote it, the sandbox is fine."""
    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(cmd)
            assert result.exit_code == 126 and result.stderr.startswith("i3core: exec refused: "), result
            assert result.stderr.count("\n") == 1 and not result.timed_out, result
            for timeout in (0, -1, float("inf"), float("nan"), "1", True, 1e19):
                result = await sb.exec("true", timeout=timeout)
                assert result.exit_code == 126 and "timeout must be" in result.stderr, (timeout, result)
            with pytest.raises(SandboxFileError):
                await sb.read_file("")
            with pytest.raises(SandboxFileError):
                await sb.read_file("missing")
            with pytest.raises(SandboxFileError):
                await sb.write_file(".", "x")
            with pytest.raises(SandboxFileError, match="surrogate"):
                await sb.write_file("a\udc80.txt", "x")
            with pytest.raises(SandboxFileError, match="surrogate"):
                await sb.read_file("\ud800")
            with pytest.raises(SandboxFileError, match="surrogate"):
                await sb.write_file("ok.txt", "\ud800")
            assert (await sb.exec("echo fine")).stdout == "fine\n"

    run(go())


def test_a_sandbox_whose_init_died_refuses_everything(backend):
    """Once its init is gone its pid may name a host process: exec, files and reset must not go near that pid."""
    async def go():
        async with await backend.create() as sb:
            signal.pidfd_send_signal(sb._pidfd, signal.SIGKILL)
            while not select.select([sb._pidfd], [], [], 1)[0]:
                pass
            assert not await sb.alive()
            for call in (sb.exec("true"), sb.reset(), sb.write_file("a", "x"), sb.read_file("a")):
                with pytest.raises(SandboxError, match="init process is gone"):
                    await call
            # the fork server joins through the held pidfd, not the pid: a pid now naming a host process is refused
            host = subprocess.Popen(["sleep", "60"])
            try:
                reused = dataclasses.replace(sb._jail, pid=host.pid)
                for call in (backend.nsexec.exec(reused, ["true"]), backend.nsexec.kill_all(reused)):
                    with pytest.raises(SandboxError):
                        await call
                assert host.poll() is None
            finally:
                host.kill()
                host.wait()

    run(go())


def test_killing_a_sandbox_init_mid_exec_fails_the_exec_with_a_sandbox_error(backend):
    """The command dies with its pid namespace; that is the sandbox failing, never an exit status (-9) of the
    model's code. Three rounds: the init still looks alive to its pidfd when the command's end is reported."""
    async def go():
        for _ in range(3):
            sb = await backend.create()
            task, members = await sleep_in_flight(sb.exec(["sleep", "60"], timeout=120), sb._jail.pid)
            start = time.monotonic()
            signal.pidfd_send_signal(sb._pidfd, signal.SIGKILL)
            with pytest.raises(SandboxError, match="died while it ran"):
                await task
            assert time.monotonic() - start < 10  # not the command's 60 s, nor its timeout
            assert await all_gone(members)
            await sb.close()

    run(go())


def test_killing_the_fork_server_mid_exec_fails_the_exec_and_the_next_sandbox_gets_a_new_server(backend):
    async def go():
        sb = await backend.create()
        task, members = await sleep_in_flight(sb.exec(["sleep", "60"], timeout=120), sb._jail.pid)
        server = backend.nsexec
        os.kill(server._proc.pid, signal.SIGKILL)
        with pytest.raises(SandboxError):
            await task
        assert await all_gone(members)  # the init dies with its server (a parent-death signal), the command too
        assert not await sb.alive()
        await sb.close()
        async with await backend.create() as fresh:
            assert backend.nsexec is not server and backend.nsexec.running()
            assert (await fresh.exec("echo fine")).stdout == "fine\n"

    run(go())


def test_an_unusable_root_dir_is_one_sandbox_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    backend = make_component("sandbox", "local", root_dir=str(tmp_path / "file" / "sandboxes"), **LIMITS)
    try:
        with pytest.raises(SandboxError, match="cannot use root_dir .*Not a directory"):
            run(backend.create())
    finally:
        run(backend.aclose())


def test_file_errors_are_sandbox_file_errors_and_temporaries_are_random(tmp_path):
    with pytest.raises(SandboxFileError):
        write_beneath(tmp_path / "missing", PurePosixPath("a.txt"), b"x")
    with pytest.raises(SandboxFileError):
        read_beneath(tmp_path / "missing", PurePosixPath("a.txt"), 10)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside").write_text("x")
    with pytest.raises(SandboxFileError, match="is a directory"):
        write_beneath(tmp_path, PurePosixPath("dir"), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]  # no temporary left behind
    assert as_bytes("é") == "é".encode() and as_bytes(memoryview(b"ab")) == b"ab"
    with pytest.raises(TypeError):
        as_bytes(3)


@pytest.mark.slow
def test_refuses_to_start_without_namespaces(tmp_path):
    code = ("import asyncio\nfrom i3core.errors import SandboxError\nfrom i3core.testing import make_component\n"
            f"backend = make_component('sandbox', 'local', root_dir={str(tmp_path)!r})\n"
            "try:\n    asyncio.run(backend.create())\nexcept SandboxError as e:\n    print('REFUSED', e)")  # fmt: skip
    result = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--", sys.executable,
                             "-c", code], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "REFUSED local sandboxes need pid, mount, net, ipc and uts namespaces" in result.stdout, result
    assert "Operation not permitted" in result.stdout


def test_the_host_root_and_secrets_are_not_visible(backend):
    async def go():
        async with await backend.create() as sb:
            listing = (await sb.exec("ls -A /")).stdout.split()
            optional = [name for name in ("lib32", "libx32") if Path(f"/{name}").exists()]
            assert sorted(listing) == sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr", "work",
                                              *optional])  # fmt: skip
            etc = (await sb.exec("ls -A /etc")).stdout.split()
            assert "shadow" not in etc and "gshadow" not in etc and "ssh" not in etc
            assert (await sb.exec("touch /usr/x /etc/x /x")).exit_code != 0

    run(go())


@pytest.mark.slow
def test_what_a_killed_owner_left_is_swept_when_the_next_backend_starts(tmp_path):
    code = ("import asyncio, os, time\nfrom i3core.testing import make_component\n"
            f"backend = make_component('sandbox', 'local', root_dir={str(tmp_path)!r})\n"
            "async def go():\n    sb = await backend.create()\n    print(sb._jail.pid, flush=True)\n"
            "    await asyncio.sleep(300)\nasyncio.run(go())")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    init = int(owner.stdout.readline())
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(f"i3core-local-{owner.pid}-")
    owner.kill()  # no cleanup at all: its sandbox dies with it (parent-death signals), its directories stay
    owner.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(init) and psutil.Process(init).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the sandbox outlived its owner"
        time.sleep(0.05)
    backend = make_component("sandbox", "local", root_dir=str(tmp_path))
    backend.start()
    try:
        assert list(tmp_path.iterdir()) == []
        assert not [p for p in backend.cgroup_parents.values() for c in p.iterdir()
                    if c.name.startswith(f"i3core-local-{owner.pid}-")]  # fmt: skip
    finally:
        asyncio.run(backend.aclose())
