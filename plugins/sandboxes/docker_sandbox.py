"""``docker``: every sandbox is a Docker container on this machine's engine.

Threat model. Model-written code is hostile: it may loop, fork-bomb, eat
memory, flood stdout, scan the network, read host secrets, kill everything it
can, race the orchestrator's file access with symlinks, or leave daemons.

Covered:

- Isolation is the engine's: own PID, mount, IPC, UTS and network namespaces;
  ``network_mode="none"`` (loopback only, inside the container), no
  capabilities (``cap_drop=ALL``), ``no-new-privileges``, a read-only root
  with a tmpfs ``/tmp`` and a tmpfs work directory (``disk_mb`` each: ENOSPC
  past it), and i3core's seccomp profile in place of the engine's default:
  the local backend's filter (``nsfork.DENIED_SYSCALLS``: no keyrings,
  namespaces, mounts, ptrace, bpf, perf, io_uring, netlink but route, ...)
  in Docker's JSON format, from the same lists (and the engine's AppArmor
  profile, where the host has AppArmor).
  Nothing of the host is visible but what the image holds and the
  ``read_only_mounts`` the config names; the host's environment is never
  passed in.
- Limits are the container's cgroups: memory with memory+swap equal (no
  swap), a pids limit (fork bombs), ``nano_cpus`` (spinning threads), and an
  ``fsize`` rlimit on each file a command writes.
- Commands run as an unprivileged ``user``; the container's init (Docker's
  ``docker-init``, tini, which reaps zombies) and its keeper process run as
  the container's root, without capabilities, so a command cannot signal
  them. On a timeout (or ``reset``) the backend kills every process of the
  sandbox but those two from the host: it freezes the container's cgroup (no
  process can fork or exit), SIGKILLs each non-root process listed in it
  through a pidfd (after checking the pid still names a process of this
  container), thaws, and repeats until none is left. Nothing runs inside
  the container for that, so a full pids limit or a full memory cannot stop
  it.
- Output is read from the exec's stream in chunks; at most
  ``max_output_bytes`` of each of stdout and stderr are kept, the rest is read
  and dropped (a gigabyte of output never sits in memory).
- Files: ``read_file``/``write_file`` work from the host on the container's
  work directory, reached through ``/proc/<init pid>/root`` and held open as a
  directory fd from creation on. Each path component is opened with
  ``O_NOFOLLOW`` relative to the previous one and a write renames a fresh
  file over the target (:func:`i3core.sandbox.base.write_beneath`), so a symlink
  anywhere on the way is refused and one the sandbox swaps in while we walk
  is refused too: the walk never resolves a name twice. The container's
  processes cannot race it into following a link.
- ``reset`` also empties ``/dev/shm`` and the container's IPC namespace (through
  a fork server of :mod:`i3core.sandbox.nsexec`) and restores the work
  directory without extended attributes; TCP buffers are charged to the
  container's cgroup v1 memory and capped at ``memory_mb``.
- ``close()`` force-removes the container (every process in it dies);
  ``aclose()`` removes every container labelled with this backend's id, also
  ones whose sandbox object was lost.

Not covered:

- Kernel bugs and container escapes: a container shares the host kernel. For
  a stronger boundary use the Kubernetes backend on dedicated nodes. (A
  user-space kernel runtime such as gVisor keeps the work directory out of
  the host's reach, so this backend does not offer one.)
- The engine must run on this machine and i3core as root (or with
  CAP_SYS_PTRACE): files and the OOM counter are reached through the host's
  ``/proc`` and ``/sys/fs/cgroup``. ``create`` checks that the init's pid is
  in the container's cgroup before it uses it, so an engine elsewhere (whose
  pids mean other processes here) is refused, never written through.
- Disk: the work directory and ``/tmp`` are tmpfs charged to the memory
  limit (two of ``disk_mb``: together up to twice it); ``/dev/shm`` is
  Docker's default 64 MiB. No I/O bandwidth limit.
- Seccomp: the profile lists only this machine's architecture, so a system
  call of another table (32-bit, x32) meets libseccomp's bad-architecture
  action, not the local filter's answers; calls the engine's default
  allowlist refused only for want of a capability are left to the kernel.
- ``pids`` counts the init and keeper too (2 of them). A cancelled ``exec``
  stops reading but leaves its command running until ``reset``/``close``.
- Exit status: Docker reports a command killed by signal N as 128+N, so a
  status 129..192 reads as ``-N``; a command that itself exits with such a
  status reads the same. ``oom_killed`` is True when the container's
  memory cgroup counted an OOM kill during the command (with concurrent
  commands in one sandbox, each of them sees it).
"""

import asyncio
import contextlib
import errno
import io
import json
import os
import signal
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from pydantic import Field, model_validator

from i3core.errors import I3Error, SandboxError, SandboxFileError
from i3core.sandbox.base import (
    READ_CHUNK, SandboxBase, SandboxConfig, as_bytes, check_exec, restore_dir, decode, empty_dir_fd, open_dir_beneath, read_beneath,
    relative_path, write_beneath,
)  # fmt: skip
from i3core.sandbox import nsfork
from i3core.sandbox.nsexec import NsExec
from i3core.types import ExecResult

LABEL = "i3core.sandbox"
"""Every container a docker backend makes carries it (value: the backend's id), so all can be found and removed."""
KEEPER = ["sleep", "infinity"]
"""The container's main process under its init: it only keeps the container up (a command is an exec)."""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_ROOT = Path("/sys/fs/cgroup")
KILL_ROUNDS = 50
KILL_PAUSE_S = 0.02
"""Between rounds of killing, the killed processes get this long to die before the next round looks."""
FREEZE_WAIT_S = 1.0
"""Longest wait for a cgroup to report frozen; the kill goes ahead regardless (a round later catches the rest)."""
MAX_THREADS = 256
"""Threads for the synchronous SDK; each running command holds one while its output streams."""
SIGNAL_STATUS = range(129, 129 + 64)
"""Docker reports a command killed by signal N as 128+N (N up to SIGRTMAX, 64)."""
NOT_FOUND = 127
"""The shell's status for a command that does not exist (the runtime reports 126 for every failed exec)."""
EXIT_POLL_S = 0.005
EXIT_POLL_MAX_S = 0.25
"""Polls for an exec's exit once its output ended start at EXIT_POLL_S and back off to this."""
DRAIN_WAIT_S = 10.0
"""How long output may keep flowing after the kill, before the stream is cut."""
API_TIMEOUT_S = 60.0
"""Longest wait for one engine API call (an exec's output stream has none)."""
WORKDIR_MODE = 0o755
SECCOMP_OPT = "seccomp=" + json.dumps(nsfork.seccomp_profile(), separators=(",", ":"))
"""The local backend's seccomp filter as a Docker profile, from the same lists (instead of the engine's default)."""
TCP_LIMIT = "memory.kmem.tcp.limit_in_bytes"
"""cgroup v1: writing it turns on the charging of the container's TCP buffers and caps them (v2 charges them
always, within memory.max)."""


def _docker():
    try:
        import docker
    except ImportError:
        raise I3Error("the docker sandbox backend needs the Docker SDK: pip install 'i3core[docker]'") from None
    return docker


def _engine_errors(docker) -> tuple[type[Exception], ...]:
    """What an SDK call raises when the engine refuses or cannot be reached (requests is the SDK's transport)."""
    import requests

    return docker.errors.DockerException, requests.exceptions.RequestException


class DockerBackend:
    """Makes sandboxes as Docker containers; all of them carry the label ``i3core.sandbox=<backend id>``."""

    class Config(SandboxConfig):
        image: str = Field(description="Image every sandbox runs (never pulled: it must be on the engine). It "
                           "needs /bin/sh and `sleep infinity`; see docs/sandboxes.md.")
        docker_host: str | None = Field(None, description="Engine URL (unix:///var/run/docker.sock); None: "
                                        "$DOCKER_HOST or the default socket. It must be on this machine.")
        user: str = Field("65534:65534", pattern=r"^[1-9][0-9]*(:[1-9][0-9]*)?$",
                          description="Numeric uid[:gid] commands run as (not root).")
        read_only_mounts: dict[str, str] = Field(default_factory=dict, description="Host path -> path in the "
                                                 "sandbox, bind-mounted read-only.")
        env: dict[str, str] = Field(default_factory=dict, description="Environment of every command, on top "
                                    "of PATH and HOME (the work directory).")
        labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every container.")

        @model_validator(mode="after")
        def _mounts_outside_writable_dirs(self):
            for host, inside in self.read_only_mounts.items():
                if not (host.startswith("/") and inside.startswith("/")):
                    raise ValueError(f"read_only_mounts: {host!r} -> {inside!r}: both paths must be absolute")
                for writable in (self.workdir, "/tmp"):
                    if PurePosixPath(inside) == PurePosixPath(writable) or \
                            PurePosixPath(writable) in PurePosixPath(inside).parents:  # fmt: skip
                        raise ValueError(f"read_only_mounts: {inside!r} lies in {writable}, which the sandbox owns")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.id = uuid.uuid4().hex[:12]
        self._docker = _docker()
        self.engine_errors = _engine_errors(self._docker)
        self._client = None
        self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="i3-docker")
        self._sandboxes: dict[str, "DockerSandbox"] = {}
        self._lock = threading.Lock()
        self._nsexec: NsExec | None = None

    def _call(self, fn, *args) -> asyncio.Future:
        """Run the blocking ``fn(*args)`` in the backend's threads; await the future for its result."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def client(self):
        """The SDK client, made on first use (from a worker thread)."""
        with self._lock:
            if self._client is None:
                kwargs = {"timeout": API_TIMEOUT_S, "max_pool_size": MAX_THREADS}
                try:
                    if self.config.docker_host is None:
                        self._client = self._docker.from_env(**kwargs)
                    else:
                        self._client = self._docker.DockerClient(base_url=self.config.docker_host, **kwargs)
                except self.engine_errors as exc:
                    raise SandboxError(f"no Docker engine answers{self._where()}: {_one_line(exc)}") from None
            return self._client

    def _where(self) -> str:
        return f" at {self.config.docker_host}" if self.config.docker_host else ""

    async def create(self) -> "DockerSandbox":
        sandbox = await self._call(self._create)
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    def _create(self) -> "DockerSandbox":
        cfg = self.config
        errors = self._docker.errors
        client = self.client()
        tmpfs_opts = f"rw,exec,nosuid,nodev,size={cfg.disk_mb}m"
        try:
            container = client.containers.create(
                cfg.image, KEEPER, user="0:0", working_dir=cfg.workdir, init=True, detach=True,
                network_mode="none", mem_limit=f"{cfg.memory_mb}m", memswap_limit=f"{cfg.memory_mb}m",
                pids_limit=cfg.pids, nano_cpus=int(cfg.cpus * 1e9), cap_drop=["ALL"],
                security_opt=["no-new-privileges", SECCOMP_OPT], read_only=True,
                ulimits=[self._docker.types.Ulimit(name="fsize", soft=cfg.file_size_mb << 20,
                                                   hard=cfg.file_size_mb << 20)],
                tmpfs={"/tmp": f"{tmpfs_opts},mode=1777", cfg.workdir: tmpfs_opts},
                volumes={host: {"bind": inside, "mode": "ro"} for host, inside in cfg.read_only_mounts.items()},
                environment={"PATH": PATH, "HOME": cfg.workdir, **cfg.env},
                labels={**cfg.labels, LABEL: self.id},
            )  # fmt: skip
        except errors.ImageNotFound:
            raise SandboxError(f"docker image {cfg.image!r} is not on the engine{self._where()}: pull it "
                               "(docker pull) or build one without a registry (docs/sandboxes.md)") from None
        except self.engine_errors as exc:
            raise SandboxError(f"cannot create a docker sandbox from {cfg.image!r}: {_one_line(exc)}") from None
        try:
            container.start()
            container.reload()
            root, tmp, cgroup = self._attach(container.id, container.attrs["State"]["Pid"])
            return DockerSandbox(self, container.id, root, tmp, cgroup)
        except BaseException as exc:
            self._remove(container.id)
            if isinstance(exc, self.engine_errors):
                raise SandboxError(f"docker sandbox from {cfg.image!r} did not start: {_one_line(exc)}") from None
            raise

    def _attach(self, container_id: str, init_pid: int) -> tuple[int, int, "_Cgroup"]:
        """Fds of the work directory (owned by the sandbox user) and of /tmp (both emptied by reset), and the
        container's cgroup, through the host's /proc."""
        short = container_id[:12]
        root = -1
        try:
            root = open_dir_beneath(f"/proc/{init_pid}/root", PurePosixPath(self.config.workdir).parts[1:])
            tmp = open_dir_beneath(f"/proc/{init_pid}/root", ["tmp"])
        except (OSError, SandboxFileError) as exc:
            if root != -1:
                os.close(root)
            raise SandboxError(f"cannot reach docker sandbox {short} through /proc/{init_pid}/root "
                               f"({getattr(exc, 'strerror', None) or exc}): "
                               "the docker backend needs the engine on this machine and i3core running as "
                               "root") from None  # fmt: skip
        try:
            if container_id not in Path(f"/proc/{init_pid}/cgroup").read_text():
                raise SandboxError(f"docker sandbox {short}: pid {init_pid} on this machine is not its init; the "
                                   "docker backend needs the engine on this machine")  # fmt: skip
            uid, gid = _ids(self.config.user)
            os.fchown(root, uid, gid)
            os.fchmod(root, WORKDIR_MODE)
            cgroup = _Cgroup(init_pid)
            if cgroup.memory is not None and (cgroup.memory / TCP_LIMIT).exists():  # TCP buffers charged, capped
                (cgroup.memory / TCP_LIMIT).write_text(str(self.config.memory_mb << 20))
            return root, tmp, cgroup
        except OSError as exc:
            os.close(root)
            os.close(tmp)
            raise SandboxError(f"docker sandbox {short}: cannot read its cgroup ({exc.strerror})") from None
        except BaseException:
            os.close(root)
            os.close(tmp)
            raise

    def _remove(self, container_id: str) -> None:
        try:
            self.client().api.remove_container(container_id, force=True, v=True)
        except self._docker.errors.NotFound:
            pass
        except self._docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress
                raise SandboxError(f"cannot remove docker sandbox {container_id[:12]}: {_one_line(exc)}") from None
        except self.engine_errors as exc:
            raise SandboxError(f"cannot remove docker sandbox {container_id[:12]}: {_one_line(exc)}") from None

    async def nsexec(self) -> NsExec:
        """The fork server that empties containers' IPC namespaces (started on first use)."""
        if self._nsexec is None or not self._nsexec.running():
            server = NsExec()
            await asyncio.to_thread(server.start)
            self._nsexec = server
        return self._nsexec

    def _forget(self, sandbox: "DockerSandbox") -> None:
        self._sandboxes.pop(sandbox.id, None)

    async def aclose(self) -> None:
        """Close every sandbox still open and remove every container labelled with this backend's id."""
        for sandbox in list(self._sandboxes.values()):
            sandbox._release()
        self._sandboxes.clear()
        if self._client is not None:
            ids = await self._call(self._labelled)
            await asyncio.gather(*(self._call(self._remove, cid) for cid in ids))
            await self._call(self._client.close)
            self._client = None
        if self._nsexec is not None:
            self._nsexec.close()
            self._nsexec = None
        self._pool.shutdown(wait=False)
        self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="i3-docker")

    def _labelled(self) -> list[str]:
        try:
            found = self.client().api.containers(all=True, filters={"label": f"{LABEL}={self.id}"})
        except self.engine_errors as exc:
            raise SandboxError(f"cannot list the docker sandboxes of backend {self.id}: {_one_line(exc)}") from None
        return [c["Id"] for c in found]


class DockerSandbox(SandboxBase):
    """One container: commands are execs as the configured user, files go through the host's /proc."""

    def __init__(self, backend: DockerBackend, container_id: str, root: int, tmp: int, cgroup: "_Cgroup"):
        self.backend = backend
        self.config = backend.config
        self.id = container_id[:12]
        self.container_id = container_id
        self._root = root
        self._tmp = tmp
        self._root_lock = threading.Lock()  # close() waits for a file operation using the fd, never reuses it
        self._cgroup = cgroup
        self._closed = False
        self._uid, self._gid = _ids(self.config.user)
        self._user = f"{self._uid}:{self._gid}"  # an explicit gid: Docker would pick group 0 for a bare uid

    # -- commands ---------------------------------------------------------------------------------

    async def exec(self, cmd, timeout: float | None = None) -> ExecResult:
        self._check_open()
        checked = check_exec(cmd, timeout, self.config.timeout_s)
        if isinstance(checked, ExecResult):
            return checked
        args, timeout = checked
        oom_before = _read_oom_kills(self._cgroup.oom_counter)
        start = time.monotonic()
        exec_id, stream = await self.backend._call(self._start, args)
        finish = self.backend._call(self._finish, exec_id, stream)
        finish.add_done_callback(_retrieved)  # an exec abandoned by an error or a cancel logs nothing
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                exit_code, started = await asyncio.shield(finish)
        except TimeoutError:
            timed_out, exit_code = True, None
            await self._kill_all()
            try:
                async with asyncio.timeout(DRAIN_WAIT_S):
                    await asyncio.shield(finish)
            except TimeoutError:
                stream.cut()  # something outside the user's reach holds the pipe: stop reading
        finally:
            if not finish.done():  # cancelled (or the kill failed): stop the thread too
                stream.cut()
        await finish
        stdout, stderr = decode(bytes(stream.out)), decode(bytes(stream.err))
        if not timed_out and not started:  # the runtime could not exec it and wrote why to stdout: as a shell would
            stdout, stderr = "", stdout.replace("\r\n", "\n")
            exit_code = NOT_FOUND if "not found" in stderr else exit_code
        oom_after = _read_oom_kills(self._cgroup.oom_counter)
        oom = None if oom_before is None or oom_after is None else oom_after > oom_before
        return ExecResult(exit_code=exit_code, stdout=stdout, stderr=stderr, timed_out=timed_out, oom_killed=oom,
                          truncated=stream.truncated, duration_s=stream.ended - start)  # fmt: skip

    def _start(self, args: list[str]) -> tuple[str, "_Stream"]:
        api = self.backend.client().api
        try:
            exec_id = api.exec_create(self.container_id, args, user=self._user, workdir=self.config.workdir)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except self.backend.engine_errors as exc:
            raise self._failure(exc) from None
        return exec_id, _Stream(sock, self.config.max_output_bytes)

    def _finish(self, exec_id: str, stream: "_Stream") -> tuple[int | None, bool]:
        """Read the output to its end, then wait for the exit (a command may close its output and go on).

        :return: the exit status (``-N`` for signal N; None once the stream was cut) and whether the
            process ever started.
        """
        stream.pump()
        return self._wait_exit(exec_id, stream.stopped)

    def _wait_exit(self, exec_id: str, stopped: threading.Event) -> tuple[int | None, bool]:
        """Poll the exec until it exited: (its status, ``-N`` for signal N, whether it started), or (None, True)
        once ``stopped`` is set."""
        api = self.backend.client().api
        poll = EXIT_POLL_S
        while not stopped.is_set():
            try:
                info = api.exec_inspect(exec_id)
            except self.backend.engine_errors as exc:
                raise self._failure(exc) from None
            if not info["Running"] and info["ExitCode"] is not None:
                code = info["ExitCode"]
                return (-(code - 128) if code in SIGNAL_STATUS else code), info["Pid"] != 0
            stopped.wait(poll)
            poll = min(2 * poll, EXIT_POLL_MAX_S)
        return None, True

    async def _kill_all(self) -> None:
        """SIGKILL every process of the sandbox but its init and keeper (the two that run as root).

        From the host, with the container's cgroup frozen, so no process forks or exits meanwhile;
        repeated until none is left (a process in uninterruptible sleep dies only when it wakes).

        :raises SandboxError: when processes are still there after KILL_ROUNDS rounds.
        """
        await self.backend._call(self._kill_all_sync)

    def _kill_all_sync(self) -> None:
        try:
            for _ in range(KILL_ROUNDS):
                with self._cgroup.frozen():
                    killed = sum(_kill_if_users(pid, self.container_id) for pid in self._cgroup.pids())
                if not killed:
                    return
                time.sleep(KILL_PAUSE_S)
        except OSError as exc:  # its cgroup is gone with the container, or the host refuses
            if self._closed:
                raise SandboxError(f"docker sandbox {self.id} is closed") from None
            if not self._running():
                raise SandboxError(f"docker sandbox {self.id} died: its container is no longer running") from None
            raise SandboxError(f"docker sandbox {self.id}: cannot kill its processes ({exc})") from None
        raise SandboxError(f"docker sandbox {self.id}: processes still alive after {KILL_ROUNDS} rounds of SIGKILL")

    def _failure(self, exc: Exception) -> SandboxError:
        if self._closed:
            return SandboxError(f"docker sandbox {self.id} is closed")
        if getattr(exc, "status_code", None) == 409:  # the engine's answer to an exec in a stopped container
            return SandboxError(f"docker sandbox {self.id} died: its container is no longer running")
        return SandboxError(f"docker sandbox {self.id} failed: {_one_line(exc)}")

    # -- files ------------------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes | str) -> None:
        payload = as_bytes(data)
        rel = relative_path(path, self.config.workdir)
        await self.backend._call(self._in_workdir, write_beneath, rel, payload, self._uid, self._gid)

    async def read_file(self, path: str) -> bytes:
        rel = relative_path(path, self.config.workdir)
        return await self.backend._call(self._in_workdir, read_beneath, rel, self.config.max_file_bytes)

    def _in_workdir(self, fn, *args):
        """``fn(work directory, *args)`` on the work directory held open since creation (in a worker thread)."""
        with self._root_lock:
            self._check_open()
            return fn(Path(f"/proc/self/fd/{self._root}"), *args)  # reopens that very directory

    # -- lifecycle --------------------------------------------------------------------------------

    async def reset(self) -> None:
        self._check_open()
        await self._kill_all()
        pidfd = await self.backend._call(self._in_workdir, self._empty)
        try:
            await (await self.backend.nsexec()).clean_ipc(pidfd)
        finally:
            os.close(pidfd)

    def _empty(self, _: Path) -> int:
        """Empty the work directory, /tmp and /dev/shm (never following symlinks); restore the work directory's
        owner and mode, without extended attributes. :return: a pidfd of the container's init (checked to be
        its), for emptying its IPC namespace."""
        pid = self._cgroup.init_pid
        pidfd = os.pidfd_open(pid)
        try:
            if self.container_id not in Path(f"/proc/{pid}/cgroup").read_text():
                raise SandboxError(f"docker sandbox {self.id}: its init is gone")
            shm = open_dir_beneath(f"/proc/{pid}/root", ["dev", "shm"])
            try:
                for fd in (self._root, self._tmp, shm):
                    empty_dir_fd(fd)
            finally:
                os.close(shm)
            restore_dir(self._root, self._uid, self._gid, WORKDIR_MODE)
        except BaseException:
            os.close(pidfd)
            raise
        return pidfd

    async def alive(self) -> bool:
        if self._closed:
            return False
        return await self.backend._call(self._running)

    def _running(self) -> bool:
        try:
            return bool(self.backend.client().api.inspect_container(self.container_id)["State"]["Running"])
        except self.backend.engine_errors:
            return False

    async def close(self) -> None:
        if self._closed:
            return
        self._release()
        self.backend._forget(self)
        await self.backend._call(self.backend._remove, self.container_id)

    def _release(self) -> None:
        with self._root_lock:
            if not self._closed:
                self._closed = True
                os.close(self._root)
                os.close(self._tmp)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"docker sandbox {self.id} is closed")


class _Stream:
    """The multiplexed stdout/stderr of one exec (8-byte frame headers); keeps at most ``cap`` bytes of each."""

    HEADER = struct.Struct(">BxxxL")

    def __init__(self, sock, cap: int):
        self.raw = getattr(sock, "_sock", sock)  # the socket under the SDK's SocketIO wrapper
        self.raw.settimeout(None)  # a command may stay silent longer than the API timeout
        self.reader = io.BufferedReader(sock, READ_CHUNK) if isinstance(sock, io.RawIOBase) else \
            self.raw.makefile("rb", buffering=READ_CHUNK)  # fmt: skip
        self.cap = cap
        self.out = bytearray()
        self.err = bytearray()
        self.truncated = False
        self.ended = time.monotonic()
        self.stopped = threading.Event()

    def pump(self) -> None:
        """Read to the end of the stream (in a worker thread)."""
        try:
            while header := self.reader.read(self.HEADER.size):
                if len(header) < self.HEADER.size:
                    break
                kind, size = self.HEADER.unpack(header)
                kept = self.err if kind == 2 else self.out
                while size > 0:
                    chunk = self.reader.read(min(size, READ_CHUNK))
                    if not chunk:
                        return
                    size -= len(chunk)
                    room = self.cap - len(kept)
                    if len(chunk) > room:
                        self.truncated = True
                        chunk = chunk[: max(room, 0)]
                    kept += chunk
        except (OSError, ValueError):
            pass  # cut() shut the socket
        finally:
            self.ended = time.monotonic()
            self.raw.close()

    def cut(self) -> None:
        self.stopped.set()
        try:
            self.raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _ids(user: str) -> tuple[int, int]:
    """(uid, gid) of a ``uid[:gid]`` user; the gid defaults to the uid."""
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


class _Cgroup:
    """The container's cgroup as the host sees it (v1 hierarchies or v2), read through /sys/fs/cgroup."""

    def __init__(self, init_pid: int):
        self.init_pid = init_pid
        v1: dict[str, Path] = {}
        unified = None
        for line in Path(f"/proc/{init_pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                if controller:
                    v1[controller] = CGROUP_ROOT / controller / path.lstrip("/")
            if controllers == "":
                unified = CGROUP_ROOT / path.lstrip("/")
        self.memory = v1.get("memory")
        if "freezer" in v1 and "memory" in v1:
            self.procs = v1["freezer"] / "cgroup.procs"
            self.freeze, self.states = v1["freezer"] / "freezer.state", ("FROZEN", "THAWED")
            self.oom_counter = v1["memory"] / "memory.oom_control"
        elif unified is not None:
            self.procs = unified / "cgroup.procs"
            self.freeze, self.states = unified / "cgroup.freeze", ("1", "0")
            self.oom_counter = unified / "memory.events"
        else:
            raise OSError(errno.ENOENT, "no freezer and memory cgroup found for the container")
        if not self.procs.exists():
            raise OSError(errno.ENOENT, f"{self.procs} is missing")

    def is_frozen(self) -> bool:
        if self.freeze.name == "freezer.state":
            return self.freeze.read_text().strip() == "FROZEN"
        return "frozen 1" in (self.freeze.parent / "cgroup.events").read_text().splitlines()

    @contextlib.contextmanager
    def frozen(self):
        """Every process of the cgroup stopped (none can fork or exit) for the duration."""
        self.freeze.write_text(self.states[0])
        try:
            deadline = time.monotonic() + FREEZE_WAIT_S
            while not self.is_frozen() and time.monotonic() < deadline:
                time.sleep(0.001)
            yield
        finally:
            self.freeze.write_text(self.states[1])

    def pids(self) -> list[int]:
        return [int(pid) for pid in self.procs.read_text().split()]


def _kill_if_users(pid: int, container_id: str) -> bool:
    """SIGKILL ``pid`` if it is a live process of the container not run by root; whether it was signalled.

    The pidfd pins the process: if ``pid`` was reused after it was listed, the checks read the
    new process (not the container's: skipped) or the signal finds the old one gone.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        if fields["State"].split()[0] in ("Z", "X") or fields["Uid"].split()[0] == "0":
            return False  # a zombie (its parent reaps it), or the init or keeper
        if container_id not in Path(f"/proc/{pid}/cgroup").read_text():
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except (ProcessLookupError, FileNotFoundError):
        return False
    finally:
        os.close(pidfd)


def _read_oom_kills(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except OSError:
        pass
    return None


def _one_line(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip()
    return " ".join(text.split()) or type(exc).__name__
