"""What every sandbox backend and the sandbox agent share: the limits config, argv, capped output, safe paths.

The threat model of each backend opens its own module; this one only holds
the pieces that make the backends agree on the exec protocol
(:class:`i3core.protocols.Sandbox`). It lives in the core because the
sandbox agent (``i3core sandbox-agent``) uses it too.
"""

import asyncio
import fcntl
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import SandboxFileError, SandboxFileNotFound
from i3core.types import ExecResult

READ_CHUNK = 64 * 1024
"""Bytes per read of a command's output; beyond the cap the rest is read and dropped, so the writer never blocks."""


AGENT_TOKEN_ENV = "I3CORE_AGENT_TOKEN"
"""Default environment variable the sandbox agent reads its bearer token from (``--token-env``)."""
AGENT_UID = 1_000_000
"""Default uid/gid of the agent's commands: no image's user (a target running as it would die on /reset)."""
MAX_TIMEOUT_S = 86_400.0
"""Longest exec timeout: a day, longer than any rollout (1e19 would overflow the rlimits and the event loop)."""
REFUSED_EXIT = 126
"""Exit code of an exec refused before anything ran (a NUL in an argument, a bad timeout), as a shell's 126."""
MAX_COMMAND_BYTES = 2 << 20
"""Largest argv, UTF-8 encoded: execve's own limit on arguments is 2 MiB."""


class SandboxConfig(BaseModel):
    """Limits every backend applies; a backend's ``Config`` extends it with its own fields."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S, description="Default exec timeout in seconds.")
    max_output_bytes: int = Field(1 << 20, ge=1, description="Bytes kept of each of stdout and stderr; the rest "
                                  "is dropped and the result marked truncated.")  # fmt: skip
    max_file_bytes: int = Field(16 << 20, ge=1, description="Largest file read_file returns.")
    memory_mb: int = Field(512, ge=16, description="Memory limit of the sandbox (all its processes).")
    pids: int = Field(128, ge=8, description="Most processes and threads alive in the sandbox at once.")
    cpus: float = Field(1.0, gt=0, description="CPU cores the sandbox may use at once.")
    file_size_mb: int = Field(256, ge=1, description="Largest file a command may write.")
    disk_mb: int = Field(256, ge=1, description="Size of the sandbox's disk: a tmpfs holding its work directory and "
                         "/tmp (with local one tmpfs for both and /dev/shm; with docker one each). It is memory, "
                         "charged to memory_mb as it fills.")  # fmt: skip
    workdir: str = Field("/work", pattern=r"^/[^\x00]*$", description="The work directory inside the sandbox.")
    warm: int = Field(0, ge=0, description="Sandboxes the run's pool keeps created and idle ahead of demand.")
    max_concurrent: int = Field(64, ge=1, description="Most sandboxes leased to rollouts at once.")
    reuse: bool = Field(True, description="Reset a sandbox after its rollout and hand it out again (else close it).")
    health_interval_s: float = Field(1.0, gt=0, description="How often a leased sandbox's health is checked; a "
                                     "dead one masks its rollout and cancels its generation.")  # fmt: skip


AGENT_LIMITS = ("timeout_s", "max_output_bytes", "max_file_bytes", "memory_mb", "pids", "cpus", "file_size_mb",
                "workdir")  # fmt: skip
"""The :class:`SandboxConfig` fields the sandbox agent applies, each a flag (``--timeout-s``); the pool's fields
(warm, max_concurrent, reuse, health_interval_s) are the orchestrator's, never the agent's."""


def argv(cmd: str | Sequence[str]) -> list[str]:
    """The argv of ``cmd``: a string runs under ``/bin/sh -c``, a sequence as it is.

    :raises ValueError: one line saying what is wrong: not a string or a non-empty list of strings, a NUL byte or a
        lone surrogate in an item (neither survives execve), or more than ``MAX_COMMAND_BYTES`` in all.
    """
    if isinstance(cmd, str):
        args = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
        args = list(cmd)
    else:
        raise ValueError(f"exec needs a shell string or a non-empty list of strings, got {_short(cmd)}")
    size = 0
    for index, item in enumerate([cmd] if isinstance(cmd, str) else args):
        where = "the command" if isinstance(cmd, str) else f"argument {index}"
        if "\0" in item:
            raise ValueError(f"{where} holds a NUL byte, which no program can receive")
        try:
            size += len(item.encode()) + 1
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where} is not valid Unicode (a lone surrogate at {exc.start})") from None
    if size > MAX_COMMAND_BYTES:
        raise ValueError(f"the command is too long ({size} bytes; at most {MAX_COMMAND_BYTES})")
    return args


def exec_timeout(timeout, default: float) -> float:
    """``timeout`` checked (None: ``default``). :raises ValueError: not a number of seconds in (0, MAX_TIMEOUT_S]."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
                         f"got {_short(timeout)}")  # fmt: skip
    return float(timeout)


def check_exec(cmd, timeout, default_timeout: float) -> tuple[list[str], float] | ExecResult:
    """What every backend's ``exec`` does first with input a model controls: (argv, timeout), or the refusal as a
    result (``REFUSED_EXIT``, the reason on stderr), never an exception: no command runs, the sandbox is fine."""
    try:
        return argv(cmd), exec_timeout(timeout, default_timeout)
    except ValueError as exc:
        return refused(str(exc))


def refused(reason: str) -> ExecResult:
    """The result of an exec refused before anything ran."""
    return ExecResult(exit_code=REFUSED_EXIT, stderr=f"i3core: exec refused: {reason}\n")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


DRAIN_PAUSE_S = 0.01
"""Past the cap, output is drained at most this often: a command that floods stdout costs the host at most 100
wake-ups a second (each a zero-copy splice of one pipe-full into /dev/null), and is slowed to that pace."""
DRAIN_PIPE_BYTES = 1 << 20
"""Pipe size once draining (fs.pipe-max-size's default): a flood is dropped at up to 100 MiB/s."""
F_SETPIPE_SZ = 1031


class Captured:
    """What one output pipe gave: the first ``cap`` bytes, and whether more came. It fills while the pipe is
    pumped, so a pump given up on (a pipe held open by no process) still leaves what arrived."""

    def __init__(self, cap: int):
        self.cap = cap
        self.kept = bytearray()
        self.truncated = False


async def pump(fd: int, into: Captured) -> None:
    """Read the pipe ``fd`` (non-blocking; the caller closes it) to its end into ``into``, at a bounded cost: up to the cap,
    every chunk as it comes (at most one pipe-full per wake-up, so a fast writer cannot hold the event loop); past
    the cap, a splice into /dev/null every ``DRAIN_PAUSE_S``. The writer never blocks for good."""
    loop = asyncio.get_running_loop()
    devnull = -1
    try:
        while True:
            await _readable(loop, fd)
            if devnull != -1:
                try:
                    if os.splice(fd, devnull, DRAIN_PIPE_BYTES, flags=os.SPLICE_F_NONBLOCK) == 0:
                        return
                except BlockingIOError:
                    pass
                await asyncio.sleep(DRAIN_PAUSE_S)
                continue
            for _ in range(16):  # one 1 MiB pipe-full at most per wake-up
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    break
                if not chunk:
                    return
                room = into.cap - len(into.kept)
                if len(chunk) > room:
                    into.truncated = True
                    into.kept += chunk[: max(room, 0)]
                    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        fcntl.fcntl(fd, F_SETPIPE_SZ, DRAIN_PIPE_BYTES)
                    except OSError:
                        pass
                    break
                into.kept += chunk
            else:
                await asyncio.sleep(0)  # a full pipe-full: let others run before the next
    finally:
        if devnull != -1:
            os.close(devnull)


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def relative_path(path: str, workdir: str) -> PurePosixPath:
    """``path`` relative to the work directory: relative, or absolute inside ``workdir``; never ``..``.

    :raises SandboxFileError: for anything that would leave the work directory.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxFileError(f"invalid path {_short(path)}")
    try:
        path.encode()
    except UnicodeEncodeError as exc:
        raise SandboxFileError(f"invalid path {_short(path)}: a lone surrogate at {exc.start}") from None
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(workdir)
        except ValueError:
            raise SandboxFileError(f"{path!r} is outside the work directory {workdir}") from None
    if ".." in pure.parts or not pure.parts:
        raise SandboxFileError(f"{path!r} is not a file inside the work directory {workdir}")
    return pure


def _open_dir_beneath(root_fd: int, parts: Sequence[str], create: bool, uid: int = -1, gid: int = -1) -> int:
    """An fd of the directory ``root/parts``, walked one component at a time without following symlinks;
    with ``create``, missing directories are made (owned by ``uid``/``gid``)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if uid != -1 or gid != -1:
                        os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                raise SandboxFileNotFound(f"{part!r}: no such directory") from None
            except OSError as exc:
                raise SandboxFileError(f"{part!r}: {exc.strerror} (a symlink or not a directory?)") from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir_beneath(root: str | Path, parts: Sequence[str], create: bool = False, uid: int = -1,
                     gid: int = -1) -> int:  # fmt: skip
    """An fd of the directory ``root/parts``; no symlink below ``root`` is followed (``root`` itself may be one,
    e.g. ``/proc/<pid>/root``). :raises SandboxFileError: a component is a symlink, missing or not a directory."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_dir_beneath(root_fd, parts, create, uid, gid)
    finally:
        os.close(root_fd)


def as_bytes(data) -> bytes:
    """What ``write_file`` writes: a str as UTF-8, bytes-like as it is. :raises TypeError: anything else."""
    if isinstance(data, str):
        try:
            return data.encode()
        except UnicodeEncodeError as exc:
            raise SandboxFileError(f"write_file: the text is not valid Unicode (a lone surrogate at {exc.start})") \
                from None
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"write_file needs bytes or str, got {type(data).__name__}")
    return bytes(data)


def read_beneath(root: Path, rel: PurePosixPath, max_bytes: int) -> bytes:
    """The bytes of the regular file ``root/rel``, refusing symlinks anywhere on the way and special files.

    :raises SandboxFileError: for every failure, an OSError included (one line, the path and its reason).
    """
    try:
        return _read_beneath(root, rel, max_bytes)
    except SandboxFileError:
        raise
    except OSError as exc:
        raise SandboxFileError(f"{str(rel)!r}: {exc.strerror or exc}") from None


def _read_beneath(root: Path, rel: PurePosixPath, max_bytes: int) -> bytes:
    dir_fd = open_dir_beneath(root, rel.parts[:-1])
    try:
        try:
            fd = os.open(rel.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise SandboxFileNotFound(f"{str(rel)!r}: no such file") from None
        except OSError as exc:
            raise SandboxFileError(f"{str(rel)!r}: {exc.strerror} (a symlink?)") from None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SandboxFileError(f"{str(rel)!r} is not a regular file")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise SandboxFileError(f"{str(rel)!r} is larger than max_file_bytes ({max_bytes})")
    return data


def write_beneath(root: Path, rel: PurePosixPath, data: bytes, uid: int = -1, gid: int = -1) -> None:
    """Create or replace ``root/rel`` (parents made), refusing symlinks anywhere on the way.

    The file is written under a random temporary name and renamed over ``rel``,
    so a symlink or FIFO the sandbox left at ``rel`` is replaced, never
    followed. ``uid``/``gid`` (-1: unchanged) own the new file and directories.

    :raises SandboxFileError: for every failure, an OSError (ENOSPC, EROFS, ...) included.
    """
    try:
        _write_beneath(root, rel, data, uid, gid)
    except IsADirectoryError:
        raise SandboxFileError(f"{str(rel)!r} is a directory") from None
    except SandboxFileError:
        raise
    except OSError as exc:
        raise SandboxFileError(f"{str(rel)!r}: {exc.strerror or exc}") from None


def _write_beneath(root: Path, rel: PurePosixPath, data: bytes, uid: int, gid: int) -> None:
    dir_fd = open_dir_beneath(root, rel.parts[:-1], create=True, uid=uid, gid=gid)
    try:
        tmp = f".i3tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                if uid != -1 or gid != -1:
                    os.fchown(file.fileno(), uid, gid)
            os.rename(tmp, rel.parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


def empty_dir_fd(dir_fd: int) -> None:
    """Remove everything in the directory ``dir_fd`` (its processes already killed), relative to that fd: a
    renamed parent or a planted symlink cannot redirect it; symlinks inside are removed, never followed.

    No recursion and two descriptors at most, whatever the depth (a program can build a tree 100 000 deep): it
    walks down by name and back up through ``..``, checked to be the directory it came from.

    :raises OSError: an entry cannot be removed, or the tree changed under the walk.
    """
    fd = os.dup(dir_fd)
    stack: list[tuple[int, int, list[str], str]] = []
    """Per directory above ``fd``: its (st_dev, st_ino), its subdirectories still to remove, the name walked into."""
    try:
        pending = _unlink_files(fd)
        while True:
            if pending:
                name = pending.pop()
                try:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    continue
                here = os.fstat(fd)
                stack.append((here.st_dev, here.st_ino, pending, name))
                os.close(fd)
                fd = child
                pending = _unlink_files(fd)
                continue
            if not stack:
                return
            dev, ino, pending, name = stack.pop()
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            seen = os.fstat(parent)
            os.close(fd)
            fd = parent
            if (seen.st_dev, seen.st_ino) != (dev, ino):
                raise OSError(f"the directory holding {name!r} moved while it was being emptied")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


def _unlink_files(dir_fd: int) -> list[str]:
    """Remove every entry of ``dir_fd`` that is not a directory; :return: the names of its subdirectories."""
    subdirs = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            else:
                try:
                    os.unlink(entry.name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
    return subdirs


def restore_dir(dir_fd: int, uid: int, gid: int, mode: int) -> None:
    """Give the directory ``dir_fd`` back its owner and mode and drop every extended attribute (ACLs included) a
    command set on it: what ``reset`` leaves must not depend on the rollout before."""
    os.fchown(dir_fd, uid, gid)
    os.fchmod(dir_fd, mode)
    for name in os.listxattr(dir_fd):
        try:
            os.removexattr(dir_fd, name)
        except OSError:  # security.* labels of the host's LSM are not ours to drop
            pass


def remove_tree(path: str | Path) -> None:
    """Remove the directory ``path`` and everything in it, at any depth (:func:`empty_dir_fd`); absent: nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        empty_dir_fd(fd)
    finally:
        os.close(fd)
    os.rmdir(path)


class SandboxBase:
    """The async context manager every sandbox is: ``async with await backend.create() as sb``."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
