"""``local``: sandboxes on this machine made of Linux namespaces and cgroups, one tiny init each.

Threat model
------------
Covered: model-written code, buggy or hostile, run by ``exec``. It runs as an
unprivileged uid of its own (one per sandbox: ``UID_BASE`` + the host pid of
the sandbox's init), with no capabilities (bounding set emptied) and
no_new_privs, so setuid binaries and file capabilities give it nothing; under
a seccomp filter (``nsfork.DENIED_SYSCALLS``: no keyring calls, no namespaces
or mounts, no ptrace, bpf, perf, io_uring, netlink but route, ...) and in a new
empty session keyring (never the host's). It sees:

- its own pid namespace (only its own processes; ``kill -9 -1`` reaches only
  them), ipc and uts namespaces, and a network namespace with nothing in it
  but its own loopback: no route to the host's loopback or anywhere else;
- a private root on a read-only tmpfs: the host's /usr, /bin, /lib*, /sbin
  bound read-only and nosuid, a minimal /etc (generated passwd, group, hosts;
  the loader cache, alternatives, python3 and CA certificates bound read-only;
  no shadow, no keys, no host configuration), a fresh /proc, a read-only /dev
  with null, zero, full, random, urandom and tty, and its disk: one tmpfs
  of ``disk_mb`` in its own mount namespace, bound at its work directory
  (``workdir``), /tmp and /dev/shm (ENOSPC past it; nothing on the host's
  filesystem). The host reaches the work directory through the init's root
  with a descriptor held from creation.
  No /root, /home, /work of the host, /sys or host project directories;
- a clean environment (PATH, HOME, LANG, USER, TMPDIR), stdin /dev/null.

Limits: a per-sandbox cgroup (v1 memory with swap capped, pids, cpu quota
from ``cpus``) where the host lets us make one, plus rlimits on every
command (processes per uid, file size, CPU seconds as a backstop, open files,
no core dumps; an address-space limit per process when there is no memory
cgroup); TCP buffers charged to the memory cgroup and capped at ``memory_mb``.
``exec`` output is capped while being read (past the cap, drained at a bounded
cost). ``reset`` also empties the IPC namespace, the uid's user keyrings, /tmp
and /dev/shm, and restores the work directory's owner, mode and extended
attributes. Input the model controls (argv, timeouts, paths, trees of any
depth) gives a result or a SandboxFileError, never a host-side exception. On a
timeout, ``reset`` and ``close`` every process of the sandbox dies; ``close`` kills its init,
which takes the whole pid namespace with it, then removes the cgroup and the
work directory. Sandboxes die with the process that made them (a chain of
parent-death signals), so a crashed orchestrator leaves none behind.

Not covered: the kernel is shared, so a kernel exploit escapes (use a VM or
gVisor-backed backend for that); CPU caches and other side channels; the
disk is memory (what is written counts in ``memory_mb``), with no I/O
bandwidth limit; /proc shows the sandbox's own processes and its mount sources
(host paths of the bound directories); a sandbox
can use its whole CPU and memory budget until ``reset``/``close``
(a background process lives on between ``exec`` calls by design).

Host requirements: root (or CAP_SYS_ADMIN, CAP_SETUID/SETGID, CAP_SYS_CHROOT)
to make pid/mount/net/ipc/uts namespaces, Linux >= 5.8 (setns on a pidfd);
cgroup v1 memory/pids/cpu hierarchies where we may make child cgroups for
the cgroup limits. What is missing is said once, in one warning line, when
the backend starts; without namespaces it refuses to start.
"""

import asyncio
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import structlog
from pydantic import Field

from i3core.sandbox import nsexec
from i3core.errors import SandboxError, SandboxFileError
from i3core.sandbox.nsexec import Cgroup, Jail, NsExec
from i3core.sandbox.base import (
    SandboxBase, SandboxConfig, as_bytes, check_exec, empty_dir_fd, open_dir_beneath, read_beneath, relative_path,
    remove_tree, restore_dir, write_beneath,
)
from i3core.types import ExecResult

log = structlog.get_logger("i3core.sandbox.local")

UID_BASE = 1_000_000
"""A sandbox's uid is this plus its init's host pid: unique among live sandboxes, and no real user's."""
WORKDIR_MODE = 0o755
"""Mode of the work directory, restored by ``reset`` (a ``chmod 0`` of it would break the next rollout)."""
SCRATCH_DIRS = ("tmp", "dev/shm")
"""tmpfs directories inside a sandbox that ``reset`` empties along with the work directory."""


class LocalSandbox(SandboxBase):
    """One sandbox: an init process in its own namespaces, a cgroup, and a work directory on the host."""

    def __init__(self, backend: "LocalBackend", sandbox_id: str, jail: Jail, pidfd: int, work: int, base: Path):
        self.id = sandbox_id
        self._backend = backend
        self._nsexec = backend.nsexec
        self._jail = jail
        self._pidfd = pidfd
        self._work = work
        """The work directory on the sandbox's disk, opened through its init's root at creation (``jail.files``)."""
        self._work_lock = threading.Lock()
        self._base = base
        self._closed = False

    def _check_open(self) -> None:
        """Refuse a closed sandbox, or one whose init died: its pid may name a host process by now, whose
        namespaces an exec would join."""
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        nsexec.check_alive(self._pidfd, f"sandbox {self.id}")

    async def exec(self, cmd: str | Sequence[str], timeout: float | None = None) -> ExecResult:
        self._check_open()
        checked = check_exec(cmd, timeout, self._jail.limits.timeout_s)
        if isinstance(checked, ExecResult):
            return checked
        return await self._nsexec.exec(self._jail, *checked)

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        payload = as_bytes(data)
        rel = relative_path(path, self._jail.limits.workdir)
        await asyncio.to_thread(self._in_workdir, write_beneath, rel, payload, self._jail.uid, self._jail.gid)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        rel = relative_path(path, self._jail.limits.workdir)
        return await asyncio.to_thread(self._in_workdir, read_beneath, rel, self._jail.limits.max_file_bytes)

    def _in_workdir(self, fn, *args):
        """``fn(work directory, *args)`` through the descriptor held since creation (in a worker thread); ``close``
        waits for it, so the descriptor's number never names another file meanwhile."""
        with self._work_lock:
            if self._closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            return fn(self._jail.files, *args)

    async def reset(self) -> None:
        self._check_open()
        await self._nsexec.kill_all(self._jail, clean=True)
        try:
            await asyncio.to_thread(self._empty)
        except OSError as exc:
            raise SandboxError(f"sandbox {self.id}: cannot empty it: {exc}") from None

    def _empty(self) -> None:
        """Empty the work directory (on the host) and the scratch tmpfs, those relative to the init's root opened
        and checked to be our init's once: never a /proc/<pid> path that a reused pid points elsewhere."""
        with self._work_lock:  # a close meanwhile cannot hand the descriptor's number to another file
            if self._closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            dirs = [os.dup(self._work)]
        try:
            root = nsexec.open_root(self._jail.pid, self._pidfd, f"sandbox {self.id}")
            try:
                for name in SCRATCH_DIRS:
                    dirs.append(open_dir_beneath(f"/proc/self/fd/{root}", PurePosixPath(name).parts))
            finally:
                os.close(root)
            for fd in dirs:
                empty_dir_fd(fd)
            restore_dir(dirs[0], self._jail.uid, self._jail.gid, WORKDIR_MODE)
        finally:
            for fd in dirs:
                os.close(fd)

    def _init_exited(self) -> bool:
        return bool(select.select([self._pidfd], [], [], 0)[0])

    async def alive(self) -> bool:
        return not self._closed and not self._init_exited()

    async def close(self) -> None:
        if self._closed:
            return
        with self._work_lock:
            self._closed = True
            os.close(self._work)  # the last reference to its disk once the init is gone
        self._backend._open.discard(self)
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            deadline = time.monotonic() + nsexec.STOP_WAIT_S
            while not self._init_exited():  # readable once the init, and so its whole pid namespace, is gone
                if time.monotonic() > deadline:
                    raise SandboxError(f"sandbox {self.id}: its init outlived SIGKILL")
                await asyncio.sleep(0.002)
        finally:
            os.close(self._pidfd)
        if self._jail.cgroup is not None:
            await self._jail.cgroup.remove()
        await asyncio.to_thread(remove_tree, self._base)


class LocalBackend:
    """Makes :class:`LocalSandbox` es through one fork server (:mod:`i3core.sandbox.nsfork`)."""

    class Config(SandboxConfig):
        root_dir: str = Field("/var/tmp/i3core-sandboxes", description="Host directory under which each sandbox's "
                              "work directory lives (root_dir/<id>/work), removed on close.")  # fmt: skip

    def __init__(self, config: Config):
        self.config = config
        self.nsexec: NsExec | None = None
        self.cgroup_parents: dict[str, Path] = {}
        self.missing: dict[str, str] = {}
        """What this host does not allow (e.g. ``{"cgroup memory": "..."}``), found when the backend starts."""
        self._open: set[LocalSandbox] = set()
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start the fork server and find what the host allows (``create`` calls it: once, and again if the server
        died, which took every sandbox it made with it)."""
        with self._start_lock:
            if self.nsexec is not None and self.nsexec.running():
                return
            if self.nsexec is not None:
                log.warning("the sandbox fork server died, and its sandboxes with it; starting a new one")
                self.nsexec.close()
                self.nsexec = None
            server = NsExec()
            server.start()
            try:
                refused = server.probe()
            except BaseException:
                server.close()
                raise
            if "namespaces" in refused or "pidfd" in refused or "pivot_root" in refused:
                server.close()
                raise SandboxError("local sandboxes need pid, mount, net, ipc and uts namespaces, which this host "
                                   f"refuses: {'; '.join(refused.values())} (run as root, or pick another "
                                   "backend)")  # fmt: skip
            self.cgroup_parents, missing = nsexec.cgroup_parents()
            self.missing = {f"cgroup {name}": why for name, why in missing.items()}
            if self.missing:
                fallback = {"cgroup memory": "memory is an address-space rlimit per process; oom_killed is None",
                            "cgroup pids": "processes are an RLIMIT_NPROC per sandbox uid",
                            "cgroup cpu": "no CPU quota: a sandbox may use every core"}  # fmt: skip
                log.warning("local sandboxes run without: " + "; ".join(
                    f"{name} ({why}; {fallback[name]})" for name, why in self.missing.items()))
            try:
                Path(self.config.root_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
                nsexec.sweep_stale(list(self.cgroup_parents.values()), "local", Path.rmdir)
                nsexec.sweep_stale([Path(self.config.root_dir)], "local", remove_tree)
            except OSError as exc:
                server.close()
                raise SandboxError(f"local sandboxes: cannot use root_dir {self.config.root_dir}: "
                                   f"{exc.strerror or exc}") from None  # fmt: skip
            self.nsexec = server

    async def create(self) -> LocalSandbox:
        if self.nsexec is None or not self.nsexec.running():
            await asyncio.to_thread(self.start)
        sandbox_id = uuid.uuid4().hex[:12]
        base = Path(self.config.root_dir) / nsexec.owned_name("local", sandbox_id)
        cgroup = None
        pidfd = work = -1
        try:
            try:
                (base / "root").mkdir(parents=True)
            except OSError as exc:
                raise SandboxError(f"local sandbox {sandbox_id}: cannot make its directories under "
                                   f"{self.config.root_dir}: {exc.strerror or exc}") from None  # fmt: skip
            if self.cgroup_parents:
                cgroup = Cgroup.create(self.cgroup_parents, nsexec.owned_name("local", sandbox_id), self.config)
            pid, uid = await self.nsexec.create_init(base / "root", self.config.workdir, UID_BASE,
                                                     disk_mb=self.config.disk_mb)  # fmt: skip
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as exc:
                raise SandboxError(f"local sandbox {sandbox_id}: its init is gone at once ({exc.strerror})") from None
            work = _open_work(pid, pidfd, self.config.workdir, f"local sandbox {sandbox_id}")
        except BaseException:
            if work != -1:
                os.close(work)
            if pidfd != -1:  # the init lives on: end it (its parent, the fork server, reaps it)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
            if cgroup is not None:
                cgroup.remove_now()
            try:
                remove_tree(base)
            except OSError:
                pass
            raise
        jail = Jail(pid=pid, uid=uid, gid=uid, limits=self.config, files=Path(f"/proc/self/fd/{work}"), pidfd=pidfd,
                    cgroup=cgroup)  # fmt: skip
        sandbox = LocalSandbox(self, sandbox_id, jail, pidfd, work, base)
        self._open.add(sandbox)
        return sandbox

    async def aclose(self) -> None:
        results = await asyncio.gather(*(sandbox.close() for sandbox in list(self._open)), return_exceptions=True)
        if self.nsexec is not None:
            self.nsexec.close()  # whatever failed above: its init dies with the server
            self.nsexec = None
        for result in results:
            if isinstance(result, BaseException):
                raise result


def _open_work(pid: int, pidfd: int, workdir: str, what: str) -> int:
    """A descriptor of the work directory on the disk of the sandbox whose init is ``pid``, reached through the
    init's root (checked to be the process of ``pidfd``) without following a symlink."""
    root = nsexec.open_root(pid, pidfd, what)
    try:
        return open_dir_beneath(f"/proc/self/fd/{root}", PurePosixPath(workdir).parts[1:])
    except (OSError, SandboxFileError) as exc:
        raise SandboxError(f"{what}: cannot open its work directory ({getattr(exc, 'strerror', None) or exc})") \
            from None
    finally:
        os.close(root)
