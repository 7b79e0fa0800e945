"""Run one command inside the namespaces of a target process: what the local backend and the sandbox agent share.

A command joins the target's pid, mount, ipc, uts and net namespaces (the
agent gives commands a fresh network namespace instead), its root and work
directory, as an unprivileged uid/gid with no capabilities and no_new_privs,
with rlimits, a clean environment (PATH, HOME=workdir, LANG; never the
host's), stdin from /dev/null and stdout/stderr read through
:func:`~i3core.sandbox.base.pump` (a gigabyte of output is dropped at a bounded cost to the
host, the writer never blocks for good). On a timeout every process of the sandbox but its
init is killed: ``kill(-1, SIGKILL)`` as the sandbox uid inside its pid
namespace, which reaches every process the sandbox started (they all run as
that uid) and nothing else (the init and the agent run as root). A target
killed from outside while a command runs (an init takes its whole pid
namespace, so the command, down with it) leaves that command without a
result: the exec raises SandboxError, never the command's exit status.

The forking is done by a small single-threaded server, :mod:`i3core.sandbox.nsfork`
(one per :class:`NsExec`), so that this asyncio process, which may hold
threads and a large heap, never forks. A trivial command costs one request
datagram, one fork of that small server and one execve.

Files go beneath the work directory with
:func:`~i3core.sandbox.base.read_beneath`/:func:`~i3core.sandbox.base.write_beneath`
(no symlink ever followed), through ``/proc/self/fd/N`` of the work
directory opened once (the local backend at creation, through the init's
root: it lies on the sandbox's own disk tmpfs; the agent at startup).

Limits come from cgroup v1 controllers (memory, pids, cpu) where the host
lets us make child cgroups of our own; without a memory cgroup, memory is an
address-space rlimit per process instead and ``oom_killed`` is None.
"""

import asyncio
import base64
import json
import math
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from i3core.errors import SandboxError
from i3core.sandbox.base import (
    Captured, SandboxConfig, as_bytes, decode, exec_timeout, pump, read_beneath, relative_path, write_beneath,
)
from i3core.types import ExecResult

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""A command's PATH: the system's, so ``python3`` is /usr/bin/python3 and never a shim of the host's user."""
CGROUP_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
"""CFS period for the cpu quota (the kernel's default)."""
OPEN_FILES = 1024
"""RLIMIT_NOFILE of a command."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Send buffer of the request socket: room for requests queued while the server forks, and for a long argv."""
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
"""Linux socket options that let root go past net.core.wmem_max/rmem_max (2 MiB requests need it)."""
MAX_REQUEST_BYTES = SOCKET_BUFFER_BYTES - (64 << 10)
"""Largest request datagram: room for a checked argv (2 MiB, base64: 2.7 MiB) and the environment."""
SEND_RETRY_S = 0.001
STOP_WAIT_S = 30.0
"""How long the output pipes may stay open after every process was killed before the sandbox counts as broken."""
OUTPUT_GRACE_S = 1.0
"""After a timeout killed every process, how long output pipes may stay open before what they gave is taken as all:
past it only a descriptor in flight in a unix socket (a cycle the kernel collects late) holds one."""
SERVER_WAIT_S = 60.0
"""How long a probe, a creation or a kill may take before the fork server counts as stuck (hundreds of creations
at once on two loaded cores take seconds each)."""


def sandbox_env(workdir: str) -> dict[str, str]:
    """A command's whole environment; nothing of the host's."""
    return {"PATH": PATH, "HOME": workdir, "LANG": "C.UTF-8", "USER": "sandbox", "TMPDIR": "/tmp"}


# --- cgroups ------------------------------------------------------------------------------------


def cgroup_parents() -> tuple[dict[str, Path], dict[str, str]]:
    """Per cgroup v1 controller we use, our own cgroup directory if we may make children in it.

    :return: (usable controllers -> parent directory, missing controllers -> why).
    """
    mounts: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if tail and tail[0] == "cgroup":
            for option in tail[-1].split(","):
                mounts.setdefault(option, (fields[4], fields[3]))  # mount point, root inside the hierarchy
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(","):
            own[name] = path
    parents, missing = {}, {}
    for name in CGROUP_CONTROLLERS:
        if name not in mounts or name not in own:
            missing[name] = "no cgroup v1 hierarchy"
            continue
        point, root = mounts[name]
        path = own[name]
        relative = path[len(root):] if root != "/" and path.startswith(root) else path
        parent = Path(point) / relative.lstrip("/")
        probe = parent / f"i3core-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as exc:
            missing[name] = f"cannot make a child cgroup of {parent}: {exc.strerror}"
            continue
        parents[name] = parent
    return parents, missing


def owned_name(kind: str, suffix: str = "") -> str:
    """``i3core-<kind>-<our pid>[-<suffix>]``: a cgroup or directory name that :func:`sweep_stale` can tell is
    ours and whether its owner still lives."""
    return f"i3core-{kind}-{os.getpid()}" + (f"-{suffix}" if suffix else "")


def sweep_stale(directories: list[Path], kind: str, remove: Callable[[Path], None]) -> None:
    """``remove`` what an owner that died without cleaning up (SIGKILL) left in ``directories``: the entries named
    by :func:`owned_name` after a dead pid (cgroups: ``Path.rmdir``, refused while a process is in one)."""
    pattern = re.compile(rf"^i3core-{re.escape(kind)}-(\d+)(-|$)")
    for directory in directories:
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        for entry in entries:
            match = pattern.match(entry.name)
            if not match or Path(f"/proc/{match.group(1)}").exists():
                continue
            try:
                remove(entry)
            except OSError:
                pass


@dataclass
class Cgroup:
    """One sandbox's cgroup directories, one per available controller."""

    dirs: dict[str, Path]

    @classmethod
    def create(cls, parents: dict[str, Path], name: str, limits: SandboxConfig) -> "Cgroup":
        cgroup = cls({})
        settings = {
            "memory": [("memory.limit_in_bytes", limits.memory_mb << 20),
                       ("memory.memsw.limit_in_bytes", limits.memory_mb << 20),  # no swap on top; absent: skipped
                       ("memory.kmem.tcp.limit_in_bytes", limits.memory_mb << 20)],  # TCP buffers charged, capped
            "pids": [("pids.max", limits.pids)],
            "cpu": [("cpu.cfs_period_us", CPU_PERIOD_US), ("cpu.cfs_quota_us", math.ceil(limits.cpus * CPU_PERIOD_US))],
        }  # fmt: skip
        try:
            for controller, parent in parents.items():
                path = parent / name
                path.mkdir()
                cgroup.dirs[controller] = path
                for key, value in settings[controller]:
                    if (path / key).exists():
                        (path / key).write_text(str(value))
        except OSError as exc:
            cgroup.remove_now()
            raise SandboxError(f"cannot set up the sandbox cgroup {name}: {exc}") from None
        return cgroup

    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.dirs.values()]

    @property
    def has_memory(self) -> bool:
        return "memory" in self.dirs

    def oom_kills(self) -> int | None:
        """The memory cgroup's OOM-kill counter, or None without one."""
        if "memory" not in self.dirs:
            return None
        match = re.search(r"^oom_kill (\d+)$", (self.dirs["memory"] / "memory.oom_control").read_text(), re.M)
        return int(match.group(1)) if match else None

    def remove_now(self) -> list[Path]:
        """Remove every directory that has no process left; :return: those still busy."""
        busy = []
        for path in self.dirs.values():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(path)
        return busy

    async def remove(self) -> None:
        """Remove the cgroup once its last (already killed) process has gone."""
        deadline = time.monotonic() + STOP_WAIT_S
        while busy := self.remove_now():
            if time.monotonic() > deadline:
                raise SandboxError(f"cgroup {busy[0]} still has processes after the sandbox was killed")
            await asyncio.sleep(0.01)


# --- the target and the fork server -------------------------------------------------------------


@dataclass
class Jail:
    """Where and as whom commands run: a target process's namespaces, with limits."""

    pid: int
    """Host pid whose namespaces and root commands join (the sandbox's init)."""
    uid: int
    gid: int
    limits: SandboxConfig
    files: Path
    """A host path of the work directory, for read_file/write_file (``/proc/self/fd/N`` where it is held open)."""
    pidfd: int
    """A pidfd of the target, held by the caller: sent to the fork server with every exec and kill, which joins the
    namespaces through it (setns on a dead process's pidfd fails), so a reused ``pid`` is never entered."""
    cgroup: Cgroup | None = None

    def rlimits(self, timeout: float) -> dict[str, int]:
        limits = {
            "RLIMIT_CPU": math.ceil(timeout * (os.cpu_count() or 1)) + 1,  # a backstop for detached processes
            "RLIMIT_NPROC": self.limits.pids,  # per uid, so per sandbox: the pids cgroup's fallback
            "RLIMIT_FSIZE": self.limits.file_size_mb << 20,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": OPEN_FILES,
        }
        if self.cgroup is None or not self.cgroup.has_memory:
            limits["RLIMIT_AS"] = self.limits.memory_mb << 20  # per process: weaker than a memory cgroup
        return limits


def _status_lines(text: str) -> list[tuple[str, str]]:
    return [(line[:1], line[1:]) for line in text.splitlines() if line]


def _raise_errors(lines: list[tuple[str, str]], what: str) -> None:
    for kind, rest in lines:
        if kind == "E":
            raise SandboxError(f"{what}: {rest}")


class NsExec:
    """A client of one :mod:`i3core.sandbox.nsfork` server; every method but :meth:`start`/:meth:`close` is usable from
    any event loop (nothing here is bound to one)."""

    def __init__(self, own_netns: bool = False):
        self.own_netns = own_netns
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the fork server (once); with ``own_netns`` it makes a fresh network namespace for commands."""
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock, forced, option in ((ours, SO_SNDBUFFORCE, socket.SO_SNDBUF),
                                     (theirs, SO_RCVBUFFORCE, socket.SO_RCVBUF)):  # fmt: skip
            try:
                sock.setsockopt(socket.SOL_SOCKET, forced, SOCKET_BUFFER_BYTES)
            except PermissionError:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        server = Path(__file__).with_name("nsfork.py")
        args = [sys.executable, "-I", str(server), str(theirs.fileno())] + (["--own-netns"] if self.own_netns else [])
        try:
            self._proc = subprocess.Popen(args, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, env={"PATH": PATH},
                                          start_new_session=True)  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours

    def running(self) -> bool:
        """Whether the fork server is started and has not exited (killed, say: its sandboxes died with it)."""
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stop the fork server; sandbox inits it made die with it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=SERVER_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _try_send(self, data: bytes, fds: list[int]) -> bool:
        if self._sock is None:
            raise SandboxError("the sandbox fork server is not running")
        try:
            socket.send_fds(self._sock, [data], fds)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise SandboxError(f"the sandbox fork server is gone: {exc}") from None
        return True

    async def _send(self, request: dict, fds: list[int]) -> int:
        """Send ``request`` with ``fds`` (closed here); :return: the read end of its status pipe."""
        data = json.dumps(request).encode()
        if len(data) > MAX_REQUEST_BYTES:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"the command is too long ({len(data)} bytes as JSON; at most {MAX_REQUEST_BYTES})")
        status_r, status_w = os.pipe()
        try:
            while not self._try_send(data, [*fds, status_w]):
                await asyncio.sleep(SEND_RETRY_S)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in (*fds, status_w):
                os.close(fd)
        return status_r

    async def _call(self, request: dict, what: str, fds: list[int]) -> list[tuple[str, str]]:
        """A request answered only on its status pipe (``fds`` sent ahead of it, closed here); :return: its lines,
        after raising any error among them."""
        reader, transport = await _pipe_reader(await self._send(request, fds))
        try:
            async with asyncio.timeout(SERVER_WAIT_S):
                text = decode(await reader.read())
        except TimeoutError:
            raise SandboxError(f"{what}: the fork server did not answer within {SERVER_WAIT_S:g}s") from None
        finally:
            transport.close()
        lines = _status_lines(text)
        _raise_errors(lines, what)
        if not lines:
            raise SandboxError(f"{what}: no answer from the fork server")
        return lines

    def probe(self) -> dict[str, str]:
        """What this host refuses us (``{"namespaces": "unshare: Operation not permitted"}``); empty: all good."""
        status_r, status_w = os.pipe()
        try:
            data = json.dumps({"op": "probe"}).encode()
            deadline = time.monotonic() + SERVER_WAIT_S
            while not self._try_send(data, [status_w]):
                if time.monotonic() > deadline:
                    raise SandboxError("the sandbox fork server does not take requests")
                time.sleep(SEND_RETRY_S)
            os.close(status_w)
            status_w = -1
            chunks = []
            while select.select([status_r], [], [], max(deadline - time.monotonic(), 0))[0]:
                if not (chunk := os.read(status_r, 65536)):
                    break
                chunks.append(chunk)
        finally:
            os.close(status_r)
            if status_w != -1:
                os.close(status_w)
        lines = _status_lines(decode(b"".join(chunks)))
        _raise_errors(lines, "probing the host")
        for kind, rest in lines:
            if kind == "O":
                return json.loads(rest)
        raise SandboxError("probing the host: the fork server did not answer")

    async def create_init(self, root: Path, workdir: str, uid_base: int, disk_mb: int) -> tuple[int, int]:
        """A new sandbox init (see :mod:`i3core.sandbox.nsfork`) with its root built on ``root`` (an empty directory)
        and a disk of ``disk_mb`` (a tmpfs at ``workdir``, /tmp and /dev/shm); :return: (its host pid, the uid its
        commands run as)."""
        request = {"op": "create", "root": str(root), "workdir": workdir, "uid_base": uid_base,
                   "disk_mb": disk_mb}  # fmt: skip
        for kind, rest in await self._call(request, "starting the sandbox", []):
            if kind == "P":
                pid, uid = rest.split()
                return int(pid), int(uid)
        raise SandboxError("starting the sandbox: the fork server gave no pid")

    async def kill_all(self, jail: Jail, clean: bool = False) -> None:
        """Kill every process running as the jail's uid in its pid namespace (all of the sandbox but its init); with
        ``clean`` (a reset), then empty its IPC namespace and the uid's user keyrings."""
        request = {"op": "kill", "target": jail.pid, "uid": jail.uid, "gid": jail.gid, "clean": clean}
        for kind, rest in await self._call(request, "killing the sandbox's processes", [os.dup(jail.pidfd)]):
            if kind == "X" and os.waitstatus_to_exitcode(int(rest)) != 0:
                raise SandboxError("processes of the sandbox survived being killed")

    async def clean_ipc(self, pidfd: int) -> None:
        """Empty the IPC namespace of the process behind ``pidfd`` (System V objects, POSIX message queues)."""
        await self._call({"op": "clean"}, "emptying the sandbox's IPC namespace", [os.dup(pidfd)])

    async def exec(self, jail: Jail, args: list[str], timeout: float | None = None) -> ExecResult:
        """Run ``args`` in the jail; on ``timeout`` (None: the limits' default) kill all of it but its init.

        :raises SandboxError: the target died while the command ran (which ended the command too, when the target
            is its pid namespace's init): the sandbox failed, the command has no result.
        """
        timeout = exec_timeout(timeout, jail.limits.timeout_s)
        request = {"op": "exec", "target": jail.pid, "uid": jail.uid, "gid": jail.gid, "cwd": jail.limits.workdir,
                   "argv": encode_argv(args), "env": sandbox_env(jail.limits.workdir), "rlimits": jail.rlimits(timeout),
                   "cgroup_procs": jail.cgroup.procs_files() if jail.cgroup else []}  # fmt: skip
        oom_before = jail.cgroup.oom_kills() if jail.cgroup else None
        out_r, out_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(out_w, True)
        os.set_blocking(err_w, True)
        out, err = Captured(jail.limits.max_output_bytes), Captured(jail.limits.max_output_bytes)
        start = time.monotonic()
        try:
            status_r = await self._send(request, [os.dup(jail.pidfd), out_w, err_w])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        outputs = asyncio.gather(pump(out_r, out), pump(err_r, err))
        outputs.add_done_callback(_retrieved)  # cancelled from any side (the caller, a loop shutting down): no warning
        reader, transport = await _pipe_reader(status_r)
        status_task = asyncio.ensure_future(reader.read())
        status_task.add_done_callback(_retrieved)
        finished = asyncio.gather(outputs, status_task)
        finished.add_done_callback(_retrieved)
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(finished)
            except TimeoutError:
                timed_out = True
                await self.kill_all(jail)
                try:  # what the killed processes wrote; a pipe still open now is held by no process (an fd in flight
                    async with asyncio.timeout(OUTPUT_GRACE_S):  # in a unix socket): dropped
                        await asyncio.shield(outputs)
                except TimeoutError:
                    pass
                try:
                    async with asyncio.timeout(STOP_WAIT_S):
                        await asyncio.shield(status_task)
                except TimeoutError:
                    raise SandboxError(f"no exit status {STOP_WAIT_S:g}s after the command was killed") from None
            except asyncio.CancelledError:
                outputs.cancel()
                status_task.cancel()
                await self.kill_all(jail)
                raise
        finally:
            outputs.cancel()
            await asyncio.wait([outputs])  # the pumps have let go of the pipes (done, or cancelled before starting)
            os.close(out_r)
            os.close(err_r)
            transport.close()
        status = status_task.result()
        duration = time.monotonic() - start
        if exiting(jail.pid, jail.pidfd):  # a command killed with its sandbox is no result of the model's code
            raise SandboxError("running the command: the sandbox died while it ran (its target process is gone)")
        lines = _status_lines(decode(status))
        _raise_errors(lines, "running the command")
        exits = [int(rest) for kind, rest in lines if kind == "X"]
        if not exits:
            raise SandboxError("running the command: the sandbox went away")
        oom_after = jail.cgroup.oom_kills() if jail.cgroup else None
        return ExecResult(
            exit_code=None if timed_out else os.waitstatus_to_exitcode(exits[0]),
            stdout=decode(out.kept),
            stderr=decode(err.kept),
            timed_out=timed_out,
            oom_killed=None if oom_before is None or oom_after is None else oom_after > oom_before,
            truncated=out.truncated or err.truncated,
            duration_s=duration,
        )


def encode_argv(args: list[str]) -> str:
    """``args`` as the fork server takes them: UTF-8, NUL-separated, base64 (the child execs the bytes as they are,
    with no codec of the host's interpreter; JSON escapes would swell control characters sixfold)."""
    return base64.b64encode(b"\0".join(arg.encode() for arg in args)).decode()


def _retrieved(future: asyncio.Future) -> None:
    """Mark a future's outcome as seen; whoever awaits it still gets it."""
    if not future.cancelled():
        future.exception()


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.ReadTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), open(fd, "rb", 0))
    return reader, transport


# --- files --------------------------------------------------------------------------------------


async def write_file(jail: Jail, path: str, data: bytes | str) -> None:
    """Create or replace ``path`` beneath the work directory, owned by the sandbox user."""
    payload = as_bytes(data)
    rel = relative_path(path, jail.limits.workdir)
    await asyncio.to_thread(write_beneath, jail.files, rel, payload, jail.uid, jail.gid)


async def read_file(jail: Jail, path: str) -> bytes:
    """The bytes of ``path`` beneath the work directory, at most ``max_file_bytes``."""
    rel = relative_path(path, jail.limits.workdir)
    return await asyncio.to_thread(read_beneath, jail.files, rel, jail.limits.max_file_bytes)


# --- the target's liveness ----------------------------------------------------------------------


def check_alive(pidfd: int, what: str) -> None:
    """:raises SandboxError: the process behind ``pidfd`` has exited (its pid may name another process by now)."""
    if select.select([pidfd], [], [], 0)[0]:
        raise SandboxError(f"{what}: its init process is gone")


PF_EXITING = 0x4
"""The kernel's flag of a process that has begun to exit (field 9 of ``/proc/<pid>/stat``)."""


def exiting(pid: int, pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` (host pid ``pid``) has exited or begun to. A sandbox's init killed
    from outside takes its pid namespace down before its pidfd turns readable: it waits in its exit for every
    process there to be reaped, so a command it killed has ended, and been reported, while the init still looks
    alive to a pidfd. The flag tells it is on its way out."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # reaped already
    if select.select([pidfd], [], [], 0)[0]:
        return True
    return bool(int(stat.rsplit(")", 1)[1].split()[6]) & PF_EXITING)  # not reaped, so the stat read was its own


def open_root(pid: int, pidfd: int, what: str) -> int:
    """An fd of the root directory of ``pid``, checked after opening to still be the process of ``pidfd`` (a pid
    reused after the process died is refused)."""
    try:
        fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        check_alive(pidfd, what)
        raise SandboxError(f"{what}: cannot open its root ({exc.strerror})") from None
    try:
        check_alive(pidfd, what)
    except BaseException:
        os.close(fd)
        raise
    return fd
