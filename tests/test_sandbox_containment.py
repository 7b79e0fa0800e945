"""What a rollout can leave or reach beyond its files and processes, judged from the host side: kernel keyrings,
IPC objects, the work directory itself, the seccomp filter, socket memory. Over every backend that runs here.
"""

import asyncio
import ctypes
import os
import platform
import subprocess
import uuid
from pathlib import Path

import pytest

from i3core.errors import SandboxFileError

from tests.sandbox_backends import SANDBOX_BACKENDS, backend_for, namespace_members

pytestmark = pytest.mark.sandbox

SYS_KEYCTL, SYS_ADD_KEY = {"x86_64": (250, 248), "aarch64": (219, 217)}[platform.machine()]
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING = 0, 1
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4
DISK_MB = 16


@pytest.fixture(params=SANDBOX_BACKENDS)
def backend(request, tmp_path):
    backend = backend_for(request.param, tmp_path, memory_mb=64, timeout_s=20.0, disk_mb=DISK_MB)
    yield backend
    asyncio.run(backend.aclose())


def init_pid(sb) -> int:
    """Host pid of the sandbox's init (local: the sleeper at pid 1; docker: the container's init)."""
    return sb._jail.pid if hasattr(sb, "_jail") else sb._cgroup.init_pid


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


KEYS_INSIDE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
session = libc.syscall({keyctl}, ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0))
print("session", session, os.strerror(ctypes.get_errno()) if session < 0 else "")
added = libc.syscall({add_key}, b"user", b"planted", b"x", ctypes.c_size_t(1), ctypes.c_long(-4))
print("added", added, os.strerror(ctypes.get_errno()) if added < 0 else "")
print(open("/proc/keys").read())
"""


def test_no_host_keyring_is_reachable_and_no_key_can_be_left(backend, tmp_path):
    libc = ctypes.CDLL(None, use_errno=True)
    name = f"i3core-canary-{uuid.uuid4().hex[:8]}".encode()
    session = libc.syscall(SYS_KEYCTL, ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_char_p(name))
    assert session > 0, os.strerror(ctypes.get_errno())
    canary = libc.syscall(SYS_ADD_KEY, b"user", b"i3core-canary", b"secret", ctypes.c_size_t(6),
                          ctypes.c_long(KEY_SPEC_SESSION_KEYRING))  # fmt: skip
    assert canary > 0, os.strerror(ctypes.get_errno())
    if hasattr(backend, "start"):
        backend.start()  # the fork server inherits this thread's session keyring, as a service's would

    async def go():
        async with await backend.create() as sb:
            code = KEYS_INSIDE.format(keyctl=SYS_KEYCTL, add_key=SYS_ADD_KEY)
            result = await sb.exec(["python3", "-c", code])
            assert result.exit_code == 0, result
            lines = result.stdout.splitlines()
            assert lines[0].startswith("session -1 ") and lines[1].startswith("added -1 "), result.stdout
            assert "i3core-canary" not in result.stdout and f"{session:08x}" not in result.stdout, result.stdout
            uid = sb._jail.uid if hasattr(sb, "_jail") else int(backend.config.user.split(":")[0])
            users = Path("/proc/key-users").read_text()
            assert not any(line.split(":")[0].strip() == str(uid) for line in users.splitlines()), users

    run(go())
    keys = Path("/proc/keys").read_text()
    assert f"{canary:08x}" in keys and "planted" not in keys  # the canary is untouched, nothing was planted


IPC_INSIDE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x1234, 4096, 0o1600) >= 0 and libc.msgget(0x1235, 0o1600) >= 0
assert libc.semget(0x1236, 1, 0o1600) >= 0
assert libc.mq_open(b"/i3core-q", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, os.strerror(ctypes.get_errno())
print("made")
"""


def host_ipc(pid: int) -> tuple[str, list[str]]:
    """(``ipcs`` in the sandbox's IPC namespace, its POSIX message queues), read from the host."""
    ipcs = subprocess.run(["nsenter", "-t", str(pid), "-i", "ipcs"], capture_output=True, text=True, check=True)
    queues = subprocess.run(["nsenter", "-t", str(pid), "-i", "unshare", "-m", "sh", "-c",
                             "mount -t mqueue none /mnt && ls -A /mnt"], capture_output=True, text=True, check=True)  # fmt: skip
    return ipcs.stdout, queues.stdout.split()


def test_reset_empties_ipc_the_work_directory_itself_and_scratch(backend):
    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(["python3", "-c", IPC_INSIDE])
            assert result.stdout == "made\n", result
            ipcs, queues = host_ipc(init_pid(sb))
            assert "0x00001234" in ipcs and "0x00001235" in ipcs and "0x00001236" in ipcs and queues == ["i3core-q"]
            setup = "import os; os.setxattr('.', 'user.left', b'1'); open('/dev/shm/x', 'w'); os.chmod('.', 0)"
            assert (await sb.exec(["python3", "-c", setup])).exit_code == 0
            await sb.reset()
            ipcs, queues = host_ipc(init_pid(sb))
            assert "0x0000123" not in ipcs and queues == [], (ipcs, queues)
            work = f"/proc/{init_pid(sb)}/root{backend.config.workdir}"
            assert os.stat(work).st_mode & 0o7777 == 0o755 and "user.left" not in os.listxattr(work)
            assert os.listdir(f"/proc/{init_pid(sb)}/root/dev/shm") == []
            again = await sb.exec("touch ok && ls")
            assert (again.exit_code, again.stdout) == (0, "ok\n"), again

    run(go())


FILL = """
import errno, os, sys
written = 0
try:
    with open(sys.argv[1], "wb", buffering=0) as file:
        while True:
            written += file.write(b"x" * (1 << 20))
except OSError as exc:
    print(errno.errorcode[exc.errno], written >> 20)
"""


def test_a_program_that_fills_its_disk_gets_enospc_and_reset_gives_it_back(backend, tmp_path):
    """The work directory is a tmpfs of disk_mb in the sandbox's own mount namespace, judged from the host through
    /proc/<init>/root: a program that writes past it gets ENOSPC (a result, the sandbox healthy), nothing lands on
    the host's filesystem, a host-side write_file is a SandboxFileError, and reset gives the space back."""
    async def go():
        async with await backend.create() as sb:
            work = f"/proc/{init_pid(sb)}/root{backend.config.workdir}"
            disk = os.statvfs(work)
            assert disk.f_blocks * disk.f_frsize == DISK_MB << 20, disk
            result = await sb.exec(["python3", "-c", FILL, "big"])
            assert result.exit_code == 0 and result.stdout.split()[0] == "ENOSPC", result
            assert int(result.stdout.split()[1]) <= DISK_MB
            assert 0 < os.stat(f"{work}/big").st_size <= DISK_MB << 20
            assert os.statvfs(work).f_bavail == 0
            tmp = await sb.exec(["python3", "-c", FILL, "/tmp/more"])
            if hasattr(sb, "_jail"):  # local: the work directory, /tmp and /dev/shm share the one disk
                assert os.stat(work).st_dev == os.stat(f"/proc/{init_pid(sb)}/root/tmp").st_dev
                assert tmp.stdout == "ENOSPC 0\n", tmp
            else:  # docker: /tmp is a tmpfs of disk_mb of its own
                assert tmp.stdout.split()[0] == "ENOSPC" and int(tmp.stdout.split()[1]) <= DISK_MB, tmp
            with pytest.raises(SandboxFileError, match="No space left"):
                await sb.write_file("from-host.bin", b"y" * (1 << 20))
            assert len(await sb.read_file("big")) == os.stat(f"{work}/big").st_size  # reading still works
            host_bytes = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file() and not f.is_symlink())
            assert host_bytes < 1 << 20, host_bytes  # nothing of it on the host's filesystem (root_dir included)
            await sb.reset()
            assert os.listdir(work) == [] and os.statvfs(work).f_bfree == os.statvfs(work).f_blocks
            again = await sb.exec(["python3", "-c", "open('half', 'wb').write(bytes(8 << 20)); print('ok')"])
            assert again.stdout == "ok\n", again
            await sb.write_file("from-host.bin", b"y" * (1 << 20))
            assert os.stat(f"{work}/from-host.bin").st_size == 1 << 20

    run(go())


SYSCALL_PROBE = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
nr = {nr}
def attempt(name, *args):
    result = libc.syscall(nr[name], *(ctypes.c_long(a) for a in args))
    if result == 0 and name == "clone":
        os._exit(0)  # the child: a fork into new namespaces
    print(name, "ok" if result >= 0 else os.strerror(ctypes.get_errno()))
    if result > 0 and name == "clone":
        os.waitpid(result, 0)
attempt("unshare", 0x10000000)  # CLONE_NEWUSER: no user namespace, nor what it unlocks
attempt("unshare", 0x00020000)
attempt("clone", 0x10000000 | 17)  # CLONE_NEWUSER | SIGCHLD, no new stack: a fork
attempt("clone3", 0, 0)
attempt("ptrace", 0)  # PTRACE_TRACEME
attempt("perf_event_open", 0, 0, -1, -1, 0)  # a NULL attr: EFAULT if the call were let in
attempt("io_uring_setup", 1, 0)
attempt("pidfd_getfd", -1, 0, 0)  # EBADF if the call were let in
for protocol in (15, 0):  # NETLINK_KOBJECT_UEVENT (host device events), NETLINK_ROUTE (ip addr)
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol).close()
        print("netlink", protocol, "ok")
    except OSError as exc:
        print("netlink", protocol, exc.strerror)
"""
NUMBERS = {"x86_64": {"unshare": 272, "clone": 56, "clone3": 435, "ptrace": 101, "perf_event_open": 298,
                      "io_uring_setup": 425, "pidfd_getfd": 438},
           "aarch64": {"unshare": 97, "clone": 220, "clone3": 435, "ptrace": 117, "perf_event_open": 241,
                       "io_uring_setup": 425, "pidfd_getfd": 438}}[platform.machine()]  # fmt: skip
"""The kernel's numbers, written out here rather than taken from the filter's own table."""
DENIED = "Operation not permitted"


def test_commands_run_under_i3cores_seccomp_filter(backend):
    """local's filter and docker's profile built from the same list: judged from the host (the mode of a command's
    process) and by what the attempts get (docker's default profile would let the user namespace, ptrace, the
    NULL perf attr and the uevent socket through)."""
    async def go():
        async with await backend.create() as sb:
            task = asyncio.create_task(sb.exec("sleep 30", timeout=30))
            status = ""
            for _ in range(500):  # bounded: about 5 s
                sleepers = [p for p in namespace_members(init_pid(sb)) if _is_sleep_30(p.pid)]
                if sleepers:
                    status = Path(f"/proc/{sleepers[0].pid}/status").read_text()
                    break
                await asyncio.sleep(0.01)
            await sb.reset()
            await task
            assert "Seccomp:\t2" in status, status  # mode 2: a filter, judged from the host
            result = await sb.exec(["python3", "-c", SYSCALL_PROBE.format(nr=NUMBERS)])
            assert result.exit_code == 0, result
            assert result.stdout.splitlines() == [
                f"unshare {DENIED}", f"unshare {DENIED}", f"clone {DENIED}", "clone3 Function not implemented",
                f"ptrace {DENIED}", f"perf_event_open {DENIED}", f"io_uring_setup {DENIED}", f"pidfd_getfd {DENIED}",
                f"netlink 15 {DENIED}", "netlink 0 ok"], result.stdout  # fmt: skip
            fork = await sb.exec("echo a | cat")  # clone without namespace flags still forks
            assert (fork.exit_code, fork.stdout) == (0, "a\n"), fork

    run(go())


FOREIGN_TABLE = r"""
import ctypes, mmap, sys
code = {"i386": b"\xb8\x14\x00\x00\x00\xcd\x80\xc3",  # mov eax, 20 (getpid); int 0x80; ret
        "x32": b"\xb8\x27\x00\x00\x40\x0f\x05\xc3"}[sys.argv[1]]  # mov eax, 39 | X32_SYSCALL_BIT; syscall; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
print(ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the 32-bit and x32 tables are x86_64's")
def test_system_calls_of_other_tables(backend):
    """A 32-bit call kills the process under both; an x32 one gets EPERM from local's raw filter and
    libseccomp's bad-architecture kill under docker's profile (docs/sandboxes.md says so)."""
    async def go():
        async with await backend.create() as sb:
            i386 = await sb.exec(["python3", "-c", FOREIGN_TABLE, "i386"])
            assert i386.exit_code == -31 and i386.stdout == "", i386  # SIGSYS
            x32 = await sb.exec(["python3", "-c", FOREIGN_TABLE, "x32"])
            if hasattr(sb, "_jail"):
                assert (x32.exit_code, x32.stdout) == (0, "-1\n"), x32
            else:
                assert x32.exit_code == -31 and x32.stdout == "", x32

    run(go())


def test_local_refuses_unshare_from_its_own_tool(tmp_path):
    """The host's unshare(1), as a model would reach for it (docker's test image has no util-linux)."""
    backend = backend_for("local", tmp_path)

    async def go():
        async with await backend.create() as sb:
            for attempt in ("unshare -U true", "unshare -r true", "unshare -m true"):
                result = await sb.exec(attempt)
                assert result.exit_code != 0 and "Operation not permitted" in result.stderr, (attempt, result)

    try:
        run(go())
    finally:
        asyncio.run(backend.aclose())


def _is_sleep_30(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x0030\x00"
    except OSError:
        return False


TCP_FLOOD = """
import socket
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(64)
pairs, sent = [], 0
for _ in range(48):
    client = socket.create_connection(server.getsockname()); peer, _ = server.accept()
    client.setblocking(False); pairs.append((client, peer))
    try:
        while True: sent += client.send(b"x" * 65536)
    except (BlockingIOError, OSError):
        pass
print(sent >> 20)
"""


def test_socket_buffers_are_charged_to_the_sandbox(backend):
    """Unread loopback TCP data sits in kernel buffers: the sandbox's memory cgroup counts it and caps it at
    memory_mb (else 48 connections hold hundreds of MB of the host's memory)."""
    async def go():
        async with await backend.create() as sb:
            result = await sb.exec(["python3", "-c", TCP_FLOOD], timeout=60)
            memory = _memory_cgroup(sb)
            used = int((memory / "memory.kmem.tcp.max_usage_in_bytes").read_text())
            limit = int((memory / "memory.kmem.tcp.limit_in_bytes").read_text())
            assert limit <= backend.config.memory_mb << 20, limit
            assert 0 < used <= limit * 1.25, (used, limit, result)  # the kernel lets TCP overshoot a little
            assert result.exit_code == 0 and int(result.stdout) <= backend.config.memory_mb * 1.25, result

    run(go())


def _memory_cgroup(sb) -> Path:
    if hasattr(sb, "_jail"):
        if sb._jail.cgroup is None or not sb._jail.cgroup.has_memory:
            pytest.skip("no memory cgroup on this host")
        return sb._jail.cgroup.dirs["memory"]
    if sb._cgroup.memory is None:
        pytest.skip("no cgroup v1 memory hierarchy for the container")
    return sb._cgroup.memory
