"""The fork server behind :mod:`i3core.sandbox.nsexec`: forks into other processes' namespaces. Standard library only.

It runs as its own small, single-threaded process (``python -I nsfork.py FD``)
so that forking is safe and cheap: the asyncio process that uses it
(the local backend, the sandbox agent) may hold threads and a large heap,
and forking that is neither. Requests arrive as JSON datagrams on a
``SOCK_SEQPACKET`` socket with the file descriptors they need attached
(``SCM_RIGHTS``); every answer goes back through a *status pipe* the
requester passes in, one line: ``P<pid> <uid>`` (a sandbox init started),
``X<wait status>`` (a command or a kill finished), ``E<message>`` (it could
not be done), ``O<json>`` (a probe). The server never writes to the socket,
and it exits when the requester closes its end.

Operations (``op``):

- ``create``: a new sandbox init, forked straight into a new pid namespace
  (the server unshares one for that fork and returns to its own): pid 1 of
  fresh pid, mount, net, ipc and uts namespaces, with a private read-only
  root (see the local backend's module docstring), a fresh /proc, a minimal
  /dev, and one size-limited tmpfs (its disk) bound at /tmp, /dev/shm and the
  work directory; then it
  execs ``sleep`` (a 1 MB process, not a copy of this server). Its uid for
  commands is ``uid_base + its host pid`` (unique among live sandboxes). It
  lives until it is killed, or until this server (and so the requester) dies
  (a parent-death SIGKILL).
- ``exec``: run ``argv`` inside the target's pid, mount, ipc and uts
  namespaces (and net, unless the server made its own fresh one), chrooted to
  its root, in ``cwd``, as ``uid``/``gid`` with no capabilities, no_new_privs,
  a new empty session keyring, rlimits, a clean environment and the seccomp
  filter (``DENIED_SYSCALLS``); stdin is /dev/null. Moves itself into the
  given cgroups first. One fork: the server enters the target's pid namespace
  for its children (``setns`` on the requester's pidfd of the target, sent
  as the request's first fd: a dead target's pid, even reused, is never
  entered), forks, and returns to its own; the
  child joins the rest and execs. The server, its parent, reaps it and writes
  its wait status.
- ``kill``: ``kill(-1, SIGKILL)`` as ``uid`` inside the target's pid
  namespace (joined through the request's pidfd, as for ``exec``), until nothing is left: every process of the sandbox but its init
  (which runs as root) dies, and nothing else can. With ``clean`` (a reset), then empty what outlives
  processes: the target's IPC namespace and the uid's user keyrings.
- ``clean``: empty the IPC namespace of the target (given by a pidfd) whose processes the requester killed.
- ``probe``: whether this host lets us make the namespaces.
"""

import array  # noqa: F401  (socket.recv_fds imports it on first use, after imports are refused)
import base64
import ctypes
import errno
import fcntl
import json
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SANDBOX_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())

# --- the seccomp filter of every command ----------------------------------------------------------

ARCH = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}.get(platform.machine())
"""(AUDIT_ARCH of this machine, index into each syscall's numbers below)."""
DENIED_SYSCALLS = {
    # kernel keyrings: a sandbox never reaches the host's keys, nor leaves keys for a later one
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    # namespaces (user namespaces and the kernel surface they unlock), mounts, root changes
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "move_mount": (429, 429), "open_tree": (428, 428), "mount_setattr": (442, 442),
    # other processes' memory, tracing, BPF, perf, io_uring, userfaultfd
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "fanotify_init": (300, 262),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "lookup_dcookie": (212, 18),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    # the machine itself: kernels, modules, reboot, swap, clocks, accounting, the kernel log, quotas
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60), "vhangup": (153, 58),
}  # fmt: skip
"""Syscalls code under test never needs, each denied with EPERM (x86_64 and aarch64 numbers). Also: ``clone``
with any namespace flag (EPERM), ``clone3`` (ENOSYS, so libc falls back to ``clone``, whose flags a filter can
read), ``socket(AF_NETLINK, ...)`` of any family but NETLINK_ROUTE (no uevents of host devices, no audit,
no netfilter), the 32-bit and x32 system call tables (the process is killed / EPERM)."""
SYS_CLONE, SYS_CLONE3, SYS_SOCKET = (56, 220), (435, 435), (41, 198)
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME."""
AF_NETLINK, NETLINK_ROUTE = 16, 0
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def seccomp_program() -> bytes:
    """The filter as ``struct sock_filter[]``: a tiny assembler, jumps by label (see ``DENIED_SYSCALLS``)."""
    arch, which = ARCH
    code: list[tuple] = [(LD_ABS_W, None, None, 4), (JEQ, "nr", "kill", arch), ("nr",), (LD_ABS_W, None, None, 0)]
    if which == 0:
        code.append((JGE, "eperm", None, X32_SYSCALL_BIT))
    for numbers in DENIED_SYSCALLS.values():
        code.append((JEQ, "eperm", None, numbers[which]))
    code += [(JEQ, "enosys", None, SYS_CLONE3[which]), (JEQ, "clone", None, SYS_CLONE[which]),
             (JEQ, "socket", None, SYS_SOCKET[which]), (RET, None, None, RET_ALLOW),
             ("clone",), (LD_ABS_W, None, None, 16), (JSET, "eperm", "allow", NAMESPACE_FLAGS),
             ("socket",), (LD_ABS_W, None, None, 16), (JEQ, None, "allow", AF_NETLINK), (LD_ABS_W, None, None, 32),
             (JEQ, "allow", "eperm", NETLINK_ROUTE),
             ("eperm",), (RET, None, None, RET_ERRNO | errno.EPERM), ("enosys",), (RET, None, None, RET_ERRNO | errno.ENOSYS),
             ("allow",), (RET, None, None, RET_ALLOW), ("kill",), (RET, None, None, RET_KILL_PROCESS)]  # fmt: skip
    labels, program = {}, []
    for item in code:
        if len(item) == 1:
            labels[item[0]] = len(program)
        else:
            program.append(item)
    out = bytearray()
    for index, (op, true, false, k) in enumerate(program):
        jumps = [0 if label is None else labels[label] - index - 1 for label in (true, false)]
        assert all(0 <= jump < 256 for jump in jumps), (index, jumps)
        out += struct.pack("=HBBI", op, jumps[0], jumps[1], k)
    return bytes(out)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


SECCOMP_FILTER = ctypes.create_string_buffer(seccomp_program()) if ARCH else None
SECCOMP_FPROG = SockFprog(len(SECCOMP_FILTER.raw) // 8, ctypes.addressof(SECCOMP_FILTER)) if ARCH else None


def install_seccomp() -> None:
    """The filter on this process (no_new_privs set already); it stays across execve and fork."""
    if SECCOMP_FPROG is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(SECCOMP_FPROG), 0, 0), "seccomp")


SCMP_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}


def seccomp_profile() -> dict:
    """The same filter as a seccomp profile in the JSON format of Docker (``security_opt=["seccomp=<json>"]``), built
    from the same lists: every system call allowed but ``DENIED_SYSCALLS`` (EPERM), ``clone`` with any namespace
    flag (EPERM: one rule per flag, as the format ANDs a rule's conditions and has no "any of these bits"),
    ``clone3`` (ENOSYS) and ``socket(AF_NETLINK, *, protocol != NETLINK_ROUTE)`` (EPERM). Only this machine's
    architecture is listed: a system call of another table (32-bit, x32) gets libseccomp's bad-architecture action
    (the process is killed), where the raw filter gives x32 EPERM."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    flags = [1 << bit for bit in range(32) if NAMESPACE_FLAGS >> bit & 1]
    rules = [{"names": sorted(DENIED_SYSCALLS), **eperm}]
    rules += [{"names": ["clone"], **eperm, "args": [{"index": 0, "value": flag, "valueTwo": flag,
                                                     "op": "SCMP_CMP_MASKED_EQ"}]} for flag in flags]  # fmt: skip
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    rules.append({"names": ["socket"], **eperm, "args": [
        {"index": 0, "value": AF_NETLINK, "valueTwo": 0, "op": "SCMP_CMP_EQ"},
        {"index": 2, "value": NETLINK_ROUTE, "valueTwo": 0, "op": "SCMP_CMP_NE"}]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [SCMP_ARCH[platform.machine()]], "syscalls": rules}


# --- kernel keyrings ------------------------------------------------------------------------------

SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 0, 1, 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def keyctl(operation: int, *args: int) -> int:
    return libc.syscall(SYS_KEYCTL, ctypes.c_long(operation), *(ctypes.c_long(a) for a in args))


def new_session_keyring() -> None:
    """Leave the session keyring inherited from whoever started the backend (a systemd service's, an ssh login's)
    for a new, empty, anonymous one: a command never holds a reference to the host's keys. Kernels without keyrings
    (ENOSYS) have nothing to leave."""
    if libc.syscall(SYS_KEYCTL, ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)) == -1:
        code = ctypes.get_errno()
        if code != errno.ENOSYS:
            raise OSError(code, f"join a new session keyring: {os.strerror(code)}")


def clear_user_keyrings() -> None:
    """As the sandbox's uid: empty its user and user-session keyrings, if they exist (they outlive processes)."""
    for spec in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
        serial = keyctl(KEYCTL_GET_KEYRING_ID, spec, 0)
        if serial > 0:
            keyctl(KEYCTL_CLEAR, serial)


MAX_REQUEST_BYTES = 4 << 20
"""Largest request datagram (argv and environment); execve's own limit is 2 MiB of arguments."""
MAX_FDS = 8
KILL_DEADLINE_S = 30.0
"""How long kill(-1) rounds go on before giving up; the first normally suffices (a killed process takes a moment
to die, longer on loaded cores)."""
KILL_PAUSE_S = 0.005

SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Host directories bound read-only into a sandbox root (symlinks, as on merged-/usr systems, are copied)."""
ETC_SHARED = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "os-release",
              "debian_version", "mime.types", "nsswitch.conf", "host.conf", "protocols", "services",
              "ssl/certs", "ca-certificates.conf")  # fmt: skip
"""The host /etc entries a sandbox sees (read-only): what the loader, Python and TLS clients read; no secrets."""
INIT = ("/bin/sleep", "2147483647")
"""What a sandbox's init becomes once its root is built: the smallest process that just stays (SIGCHLD is ignored,
so the kernel reaps orphans for it), not a copy of this server."""
DISK_MOUNT = ".i3core-disk"
"""Where the sandbox's disk tmpfs is first mounted in its new root, to bind its three directories from; unmounted
and removed before the pivot."""
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)
"""Signals Python (or this server) changed that a command must start with at their defaults."""

libc = ctypes.CDLL(None, use_errno=True)
_str, _int, _long = ctypes.c_char_p, ctypes.c_int, ctypes.c_ulong
for _name, _args in (("mount", [_str, _str, _str, _long, _str]), ("umount2", [_str, _int]), ("unshare", [_int]),
                     ("setns", [_int, _int]), ("prctl", [_int, _long, _long, _long, _long])):  # fmt: skip
    getattr(libc, _name).argtypes = _args


def _check(result: int, what: str) -> int:
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _b(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


def unshare(flags: int) -> None:
    _check(libc.unshare(flags), "unshare")


def setns(fd: int, flags: int) -> None:
    _check(libc.setns(fd, flags), "setns")


def loopback_up() -> None:
    """Bring ``lo`` up in the current (fresh) network namespace: 127.0.0.1 inside, nothing outside."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def report(status_fd: int, line: str) -> None:
    try:
        os.write(status_fd, (line.replace("\n", " ") + "\n").encode())
    except OSError:
        pass


def child_prelude(server_pid: int) -> None:
    """First steps of a forked child that stays in our pid namespace: die with the server, SIGCHLD as usual."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


# --- create: a sandbox init ---------------------------------------------------------------------


def _bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _share(source: str, target: str) -> None:
    """``source`` from the host at ``target``, read-only; a symlink is copied as a symlink; absent: skipped."""
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
    elif os.path.exists(source):
        _bind(source, target, read_only=True)


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def setup_root(new: str, workdir: str, uid: int, disk_mb: int) -> None:
    """Build the sandbox's root on a tmpfs at ``new`` and pivot into it (we are pid 1 of fresh namespaces). Its
    disk is one tmpfs of ``disk_mb``, bound at /tmp, /dev/shm and ``workdir``: together they hold at most that."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=2m,mode=755")
    for name in SYSTEM_DIRS:
        _share(f"/{name}", f"{new}/{name}")
    os.mkdir(f"{new}/etc", 0o755)
    for name in ETC_SHARED + tuple(n for n in sorted(os.listdir("/etc")) if n.startswith("python3")):
        _share(f"/etc/{name}", f"{new}/etc/{name}")
    _write(f"{new}/etc/passwd", "root:x:0:0:root:/root:/usr/sbin/nologin\n"
           f"sandbox:x:{uid}:{uid}:sandbox:{workdir}:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    _write(f"{new}/etc/group", f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
    _write(f"{new}/etc/hosts", "127.0.0.1 localhost\n::1 localhost\n")
    _write(f"{new}/etc/hostname", "sandbox\n")
    os.mkdir(f"{new}/proc")
    mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(f"{new}/dev")
    mount("tmpfs", f"{new}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        _bind(f"/dev/{name}", f"{new}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{new}/dev/{name}")
    disk = f"{new}/{DISK_MOUNT}"
    os.mkdir(disk)
    mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=755")
    for name, target, mode in (("tmp", "/tmp", 0o1777), ("shm", "/dev/shm", 0o1777), ("work", workdir, 0o755)):
        os.mkdir(f"{disk}/{name}", mode)
        os.chmod(f"{disk}/{name}", mode)  # past the umask
        os.makedirs(new + target, exist_ok=True)
        mount(f"{disk}/{name}", new + target, None, MS_BIND)
        mount(None, new + target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV)
    os.chown(f"{disk}/work", uid, uid)
    _check(libc.umount2(_b(disk), MNT_DETACH), "umount the disk's first mount")  # its three binds keep it
    os.rmdir(disk)
    os.chdir(new)
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(None, "/dev", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def op_create(req: dict, fds: list[int]) -> None:
    """In the server's child born as pid 1 of a new pid namespace: build the sandbox, then become its init."""
    status = fds[0]
    signal.set_wakeup_fd(-1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the server is our parent
    unshare(SANDBOX_NAMESPACES & ~CLONE_NEWPID)
    host_pid = int(os.readlink("/proc/self"))  # the host's /proc is still mounted here
    uid = req["uid_base"] + host_pid
    setup_root(req["root"], req["workdir"], uid, req["disk_mb"])
    socket.sethostname("sandbox")
    loopback_up()
    report(status, f"P{host_pid} {uid}")
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, status)
    os.closerange(status + 1, 1 << 16)  # the status pipe closes on execve: the requester's EOF
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # kept across execve: the kernel reaps orphans for this init
    os.execve(INIT[0], list(INIT), {})


# --- exec and kill: join a target's namespaces --------------------------------------------------


def enter(target: int, flags: int, chroot: bool, pidfd: int) -> None:
    """Join ``target``'s namespaces (``flags``) through ``pidfd`` (the caller's pidfd of it; closed here) and, with
    ``chroot``, its root directory. The root is opened by pid before the setns on the pidfd: that setns fails once
    the target is dead, so when it succeeds the root opened was the target's, never a reused pid's."""
    root = os.open(f"/proc/{target}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if chroot else -1
    try:
        setns(pidfd, flags)
        if chroot:
            os.fchdir(root)
            os.chroot(".")
    finally:
        os.close(pidfd)
        if root != -1:
            os.close(root)


CAP_LAST = int(open("/proc/sys/kernel/cap_last_cap").read())
"""The highest capability number this kernel knows (read before any chroot)."""


def drop_privileges(uid: int, gid: int) -> None:
    for cap in range(CAP_LAST + 1):
        prctl(PR_CAPBSET_DROP, cap)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # every uid non-zero: the kernel clears the permitted and effective capabilities
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a credential change cleared it


def as_user(uid: int, gid: int, action) -> None:
    """Run ``action()`` in a forked child with the sandbox's uid and gid (no other groups), and wait for it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            action()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def kill_every_process() -> None:
    """SIGKILL every process this uid may signal: atomic with respect to fork, nothing it misses is born after."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(req: dict, out: int, err: int, status: int, cgroup_fds: list[int], devnull: int) -> None:
    """In the forked child inside the target's pid namespace: become the command."""
    for fd in cgroup_fds:
        os.write(fd, b"0")  # "0": the writing process
    os.setsid()
    os.chdir(req["cwd"])
    for name, value in req["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    new_session_keyring()
    drop_privileges(req["uid"], req["gid"])
    install_seccomp()
    for sig in RESTORED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, status)
    os.closerange(status + 1, 1 << 16)
    argv = base64.b64decode(req["argv"]).split(b"\0")
    env = {key.encode(): value.encode() for key, value in req["env"].items()}
    try:
        exec_program(argv, env)
    except OSError as exc:
        os.write(2, argv[0] + f": {exc.strerror}\n".encode())
        os._exit(127 if exc.errno == errno.ENOENT else 126)


def exec_program(argv: list[bytes], env: dict[bytes, bytes]) -> None:
    """``execve`` ``argv[0]``, looked up in the command's own ``PATH`` when it holds no slash, as a shell does.

    Only ``os.execve``: ``os.execvpe`` imports ``warnings`` on its way, from the host interpreter's standard
    library, which the sandbox's root does not hold (pyenv, uv, conda). :raises OSError: no candidate ran (ENOENT
    if none exists, else the first other error, as ``execvp``).
    """
    name = argv[0]
    if not name:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
    if b"/" in name:
        os.execve(name, argv, env)
    first_error = None
    for directory in env.get(b"PATH", b"").split(b":"):
        try:
            os.execve((directory or b".") + b"/" + name, argv, env)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR) and first_error is None:
                first_error = exc
    raise first_error or OSError(errno.ENOENT, os.strerror(errno.ENOENT))


def op_exec(req: dict, fds: list[int], devnull: int, own_netns: bool, pidfd: int) -> None:
    """In the server's child born in the target's pid namespace: join the rest of its namespaces, become the
    command. The server reports the exit status (it is our parent)."""
    out, err, status = fds[-3:]
    signal.set_wakeup_fd(-1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in req["cgroup_procs"]]
    flags = SANDBOX_NAMESPACES & ~CLONE_NEWPID & ~(CLONE_NEWNET if own_netns else 0)
    enter(req["target"], flags, chroot=True, pidfd=pidfd)
    run_command(req, out, err, status, cgroup_fds, devnull)


def live_processes(pidns: int, uid: int) -> list[int]:
    """Host pids of the processes of ``uid`` in pid namespace ``pidns`` that are not zombies (seen from the host)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}/ns/pid").st_ino != pidns:
                continue
            with open(f"/proc/{name}/status") as file:
                status = dict(line.split(":", 1) for line in file.read().splitlines() if ":" in line)
        except OSError:
            continue
        if status["State"].split()[0] not in ("Z", "X") and int(status["Uid"].split()[0]) == uid:
            found.append(int(name))
    return found


def op_kill(req: dict, fds: list[int], server_pid: int) -> None:
    """Kill rounds until no live process of the uid is left; zombies are fine (their parent or init reaps them)."""
    status = fds[-1]
    child_prelude(server_pid)
    uid, gid = req["uid"], req["gid"]
    enter(req["target"], CLONE_NEWPID, chroot=False, pidfd=os.dup(fds[0]))
    pidns = os.stat("/proc/self/ns/pid_for_children").st_ino  # the target's, joined through its pidfd
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        as_user(uid, gid, kill_every_process)
        if not live_processes(pidns, uid):
            if req.get("clean"):
                clean(fds[0], uid, gid, keyrings=True)
            report(status, "X0")
            return
        time.sleep(KILL_PAUSE_S)
    report(status, f"X{1 << 8}")


IPC_RMID = 0
SYSV_IPC = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))
MQUEUE_MOUNT = "/tmp"
"""Where a private mount namespace of ours shows the sandbox's POSIX message queues (any directory will do)."""


def clean(pidfd: int, uid: int, gid: int, keyrings: bool) -> None:
    """With every process of the sandbox dead: empty what outlives processes. Its IPC namespace (System V shared
    memory, message queues, semaphores; POSIX message queues) and, with ``keyrings``, its uid's user keyrings
    (only for a uid no one else has)."""
    if keyrings:
        as_user(uid, gid, clear_user_keyrings)
    setns(os.dup(pidfd), CLONE_NEWIPC)  # /proc/sysvipc and mqueue mounts show the ipc namespace of the reader
    for kind, call in SYSV_IPC:
        with open(f"/proc/sysvipc/{kind}") as file:
            ids = [int(line.split()[1]) for line in file.read().splitlines()[1:] if line.strip()]
        for ipc_id in ids:
            getattr(libc, call)(ipc_id, IPC_RMID, 0) if kind == "sem" else getattr(libc, call)(ipc_id, IPC_RMID, None)
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("mqueue", MQUEUE_MOUNT, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in os.listdir(MQUEUE_MOUNT):
        os.unlink(f"{MQUEUE_MOUNT}/{name}")


def op_clean(req: dict, fds: list[int], server_pid: int) -> None:
    """``clean`` alone, for a sandbox whose processes someone else killed (the docker backend's reset)."""
    child_prelude(server_pid)
    clean(fds[0], 0, 0, keyrings=False)
    report(fds[-1], "X0")


def op_probe(req: dict, fds: list[int], server_pid: int) -> None:
    status = fds[0]
    child_prelude(server_pid)
    problems = {}
    try:
        unshare(SANDBOX_NAMESPACES)
    except OSError as exc:
        problems["namespaces"] = str(exc)
    if SYS_PIVOT_ROOT is None:
        problems["pivot_root"] = f"unknown syscall number on {platform.machine()}"
    if not hasattr(os, "pidfd_open"):
        problems["pidfd"] = "os.pidfd_open is missing"
    report(status, "O" + json.dumps(problems))


def restore_pid_namespace(own_pidns: int) -> None:
    """Make our later children ours again after a create; if we cannot, stop (the requester sees us gone)."""
    try:
        setns(own_pidns, CLONE_NEWPID)
    except OSError as exc:
        print(f"i3core.sandbox.nsfork: cannot return to our pid namespace: {exc}", file=sys.stderr)
        os._exit(1)


def serve(sock: socket.socket, own_netns: bool) -> None:
    server_pid = os.getpid()
    devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    if own_netns:
        unshare(CLONE_NEWNET)
        loopback_up()
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)  # one wake-up reaps every child that ended
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through wake_w
    waiting: dict[int, int] = {}
    """exec children -> their status pipe: we are their parent, so we report how they ended."""
    ops = {"create": op_create, "kill": lambda r, f: op_kill(r, f, server_pid),
           "exec": lambda r, f: op_exec(r, f, devnull, own_netns, target_fd),
           "probe": lambda r, f: op_probe(r, f, server_pid), "clean": lambda r, f: op_clean(r, f, server_pid)}  # fmt: skip
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
            reap(waiting)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, MAX_FDS)
        if not data and not fds:
            return  # the requester closed its end
        for fd in fds:
            os.set_inheritable(fd, False)
        try:
            req = json.loads(data)
            handler = ops[req["op"]]
            target_fd = -1
            if req["op"] == "create":
                unshare(CLONE_NEWPID)  # our next child is pid 1 of a new pid namespace
            elif req["op"] == "exec":
                target_fd = os.dup(fds[0])  # the caller's pidfd of the target: setns fails once it died
                try:
                    setns(target_fd, CLONE_NEWPID)  # our next child is born in the target's pid namespace
                except BaseException:
                    os.close(target_fd)
                    raise
            pid = -1
            try:
                pid = os.fork()
            finally:
                if pid != 0:  # the server (forked or not); never the child, whatever its pid
                    if req["op"] in ("create", "exec"):
                        restore_pid_namespace(own_pidns)
                    if target_fd != -1:
                        os.close(target_fd)
            if pid == 0:
                try:
                    sock.close()
                    handler(req, fds)
                except BaseException as exc:
                    if fds:
                        report(fds[-1], f"E{exc}")
                finally:
                    os._exit(127)
            if req["op"] == "exec":
                waiting[pid] = os.dup(fds[-1])
        except Exception as exc:  # a malformed request: answer on its status pipe, keep serving
            if fds:
                report(fds[-1], f"E{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)


def reap(waiting: dict[int, int]) -> None:
    """Collect every child that ended; tell an exec's requester how its command ended."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = waiting.pop(pid, None)
        if status is not None:
            report(status, f"X{wait_status}")
            os.close(status)


class NoImports:
    """A meta path finder that refuses every import: after start the server and its children import nothing, so no
    child ever reads the host interpreter's library after entering a sandbox's root (tests fail loudly if one
    tries, on any interpreter)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        raise ImportError(f"i3core.sandbox.nsfork imports nothing once started (tried {name!r})")


def main() -> None:
    sys.meta_path.insert(0, NoImports)
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(sock.fileno(), False)
    serve(sock, own_netns="--own-netns" in sys.argv[2:])


if __name__ == "__main__":
    main()
