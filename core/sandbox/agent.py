"""``i3core sandbox-agent``: one sandbox's HTTP API, served next to it (the Kubernetes sidecar).

The agent runs each command inside a *target* process's namespaces and root
(:mod:`i3core.sandbox.nsexec`): in a Pod with ``shareProcessNamespace`` the target is
the sandbox container's only process, and commands never go through the API
server. The API is the table in docs/sandboxes.md; every route but
``/health`` needs ``Authorization: Bearer <token>``, the token coming from an
environment variable (never a flag: command lines are world-readable).

Threat model: commands run as ``--uid``/``--gid`` (not the target's own user,
so a timeout or ``/reset`` that kills every process of that uid in the
target's pid namespace never touches the target itself), with no
capabilities, no_new_privs, rlimits and a clean environment, in a fresh
network namespace of the agent's own (loopback only): a Pod's network is
shared by its containers, the commands get none of it. Cgroup limits apply
where the agent may make a child cgroup of its own; in a Pod the container's
own limits are the backstop. Not covered: the agent itself holds the
privileges to enter other namespaces, so it must only be reachable by the
orchestrator (a NetworkPolicy, the token). ``/reset`` empties the work
directory and the IPC namespace and removes the commands' own entries (those
of their uid) from the target's /tmp; what they left in another user's
world-writable directory there, and /dev/shm, stay.

Once serving it POSTs ``{"sandbox": <id>, "address": "host:port"}`` with its
token to ``--ready-url`` (bounded retries): readiness is pushed, nobody polls.
"""

import argparse
import asyncio
import hmac
import json
import os
import re
import select
import signal
import time
from dataclasses import asdict
from pathlib import Path, PurePosixPath

import aiohttp
import structlog
from aiohttp import web
from pydantic import ValidationError

from i3core.sandbox import nsexec
from i3core.errors import I3Error, SandboxError, SandboxFileError, SandboxFileNotFound
from i3core.sandbox.nsexec import Cgroup, Jail, NsExec
from i3core.sandbox.base import (
    AGENT_LIMITS, SandboxConfig, argv, empty_dir_fd, exec_timeout, open_dir_beneath, restore_dir,
)

log = structlog.get_logger("i3core.sandbox_agent")

MAX_JSON_BYTES = 4 << 20
"""Largest /exec body; execve itself takes at most 2 MiB of arguments."""
READY_TRIES = 10
READY_BACKOFF_S = (0.25, 5.0)
"""First and largest pause between readiness POST attempts (doubling)."""
READY_TIMEOUT_S = 10.0
TARGET_POLL_S = 0.1


def find_target(pattern: str, wait_s: float) -> int:
    """The lowest pid whose command line matches ``pattern``, waiting up to ``wait_s``; never ourselves or an
    ancestor (whose command lines may hold the pattern too)."""
    regex = re.compile(pattern)
    skip = set()
    pid = os.getpid()
    while pid > 1:
        skip.add(pid)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    deadline = time.monotonic() + wait_s
    while True:
        for entry in sorted((int(p) for p in os.listdir("/proc") if p.isdigit())):
            if entry in skip:
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline and regex.search(cmdline.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")):
                return entry
        if time.monotonic() > deadline:
            raise I3Error(f"no process matches --target-match {pattern!r} after {wait_s:g}s")
        time.sleep(TARGET_POLL_S)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Agent:
    """The HTTP handlers over one target."""

    def __init__(self, jail: Jail, server: NsExec, pidfd: int, work_fd: int, tmp_fd: int | None, token: str):
        self.jail = jail
        self.server = server
        self.pidfd = pidfd
        self.work_fd = work_fd
        """The work directory, opened once at startup: every file op and reset goes through it, so a command that
        renames the path to it (or plants a symlink there) cannot redirect them onto the agent's own files."""
        self.work_mode = os.fstat(work_fd).st_mode & 0o7777
        """Its mode before any command ran, which every reset restores."""
        self.tmp_fd = tmp_fd
        """The target's /tmp (None: it has none), opened once at startup like the work directory."""
        self.token = token

    def target_alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return _error(401, "missing or wrong bearer token")
        try:
            return await handler(request)
        except web.HTTPException as exc:  # unknown route, wrong method, body too large: JSON like the rest
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason)
        except SandboxFileNotFound as exc:
            return _error(404, str(exc))
        except SandboxFileError as exc:
            return _error(400, str(exc))
        except SandboxError as exc:
            return _error(503, str(exc))

    async def exec(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if len(raw) > MAX_JSON_BYTES:
            return _error(413, f"the body is larger than {MAX_JSON_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict) or "cmd" not in body:
            return _error(400, 'the body must be a JSON object with "cmd" (and optionally "timeout")')
        unknown = set(body) - {"cmd", "timeout"}
        if unknown:
            return _error(400, f"unknown fields: {', '.join(sorted(unknown))}")
        try:
            args = argv(body["cmd"])
            timeout = exec_timeout(body.get("timeout"), self.jail.limits.timeout_s)
        except ValueError as exc:
            return _error(400, str(exc))
        nsexec.check_alive(self.pidfd, "the target")
        try:
            result = await self.server.exec(self.jail, args, timeout)
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response(asdict(result))

    async def put_file(self, request: web.Request) -> web.Response:
        path = request.query.get("path", "")
        data = await request.read()
        if len(data) > self.jail.limits.max_file_bytes:
            return _error(413, f"the file is larger than max_file_bytes ({self.jail.limits.max_file_bytes})")
        nsexec.check_alive(self.pidfd, "the target")
        await nsexec.write_file(self.jail, path, data)
        return web.Response(status=204)

    async def get_file(self, request: web.Request) -> web.Response:
        nsexec.check_alive(self.pidfd, "the target")
        data = await nsexec.read_file(self.jail, request.query.get("path", ""))
        return web.Response(body=data, content_type="application/octet-stream")

    async def reset(self, request: web.Request) -> web.Response:
        nsexec.check_alive(self.pidfd, "the target")
        await self.server.kill_all(self.jail, clean=True)
        await asyncio.to_thread(self._empty)
        return web.Response(status=204)

    def _empty(self) -> None:
        """Empty the work directory and give it back its owner and mode, without its extended attributes; remove
        what the commands left in /tmp."""
        empty_dir_fd(self.work_fd)
        restore_dir(self.work_fd, self.jail.uid, self.jail.gid, self.work_mode)
        if self.tmp_fd is not None:
            work = os.fstat(self.work_fd)
            remove_entries_of(self.tmp_fd, self.jail.uid, keep=(work.st_dev, work.st_ino))

    async def health(self, request: web.Request) -> web.Response:
        if self.target_alive():
            return web.json_response({"ok": True, "target_pid": self.jail.pid})
        return web.json_response({"ok": False, "target_pid": self.jail.pid, "error": "the target process is gone"},
                                 status=503)  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware],
                              client_max_size=max(self.jail.limits.max_file_bytes, MAX_JSON_BYTES) + 1)  # fmt: skip
        app.add_routes([web.post("/exec", self.exec), web.put("/files", self.put_file),
                        web.get("/files", self.get_file), web.post("/reset", self.reset),
                        web.get("/health", self.health)])  # fmt: skip
        return app


async def announce(url: str, token: str, sandbox_id: str, address: str) -> None:
    """POST our readiness to ``url``, retrying with backoff; raises SandboxError once every try failed."""
    pause, largest = READY_BACKOFF_S
    last = ""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        for _ in range(READY_TRIES):
            try:
                async with session.post(url, json={"sandbox": sandbox_id, "address": address},
                                        timeout=aiohttp.ClientTimeout(total=READY_TIMEOUT_S)) as response:  # fmt: skip
                    if response.status < 300:
                        return
                    last = f"HTTP {response.status}: {(await response.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(pause)
            pause = min(pause * 2, largest)
    raise SandboxError(f"readiness POST to {url} failed {READY_TRIES} times; last: {last}")


def remove_entries_of(dir_fd: int, uid: int, keep: tuple[int, int]) -> None:
    """Remove every entry of the directory ``dir_fd`` owned by ``uid``, a directory with all it holds (at any depth,
    never following a symlink), but the directory ``keep`` (st_dev, st_ino: the work directory, which may lie in
    /tmp). Only the commands' own: the target's /tmp may hold its user's files; with every process of ``uid``
    dead, nothing of theirs can change meanwhile."""
    with os.scandir(dir_fd) as entries:
        owned = []
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid == uid and (info.st_dev, info.st_ino) != keep:
                owned.append((entry.name, entry.is_dir(follow_symlinks=False)))
    for name, is_dir in owned:
        if not is_dir:
            os.unlink(name, dir_fd=dir_fd)
            continue
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            empty_dir_fd(fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=dir_fd)


def open_tmp(target: int) -> int | None:
    """The target's /tmp, opened without following a symlink; None if it has none."""
    try:
        return open_dir_beneath(f"/proc/{target}/root", ["tmp"])
    except SandboxFileNotFound:
        return None
    except (OSError, SandboxFileError) as exc:
        raise I3Error(f"/tmp in target pid {target}: {getattr(exc, 'strerror', None) or exc}") from None


def open_workdir(target: int, workdir: str, uid: int, gid: int) -> int:
    """The work directory inside the target, made if missing (no symlink followed) and owned by the command user;
    :return: an fd of it, which the agent keeps for every file op and reset."""
    try:
        fd = open_dir_beneath(f"/proc/{target}/root", PurePosixPath(workdir).parts[1:], create=True)
    except (OSError, SandboxFileError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise I3Error(f"work directory {workdir} in target pid {target}: {why}") from None
    os.fchown(fd, uid, gid)
    return fd


async def serve(args: argparse.Namespace) -> int:
    token = os.environ.get(args.token_env, "")
    if not token:
        raise I3Error(f"no bearer token: set ${args.token_env} (the agent refuses to serve without one)")
    try:
        limits = SandboxConfig(**{name: getattr(args, name) for name in AGENT_LIMITS})
    except ValidationError as exc:
        raise I3Error("; ".join(f"--{e['loc'][0].replace('_', '-')}: {e['msg']}" for e in exc.errors())) from None
    target = args.target_pid if args.target_pid is not None else await asyncio.to_thread(
        find_target, args.target_match, args.target_wait_s)  # fmt: skip
    try:
        pidfd = os.pidfd_open(target)
    except OSError as exc:
        raise I3Error(f"target pid {target}: {exc.strerror}") from None
    work_fd = open_workdir(target, limits.workdir, args.uid, args.gid)
    tmp_fd = open_tmp(target)
    parents, missing = nsexec.cgroup_parents()
    if missing:
        log.warning("sandbox agent runs without: " + "; ".join(f"cgroup {n} ({why})" for n, why in missing.items()))
    nsexec.sweep_stale(list(parents.values()), "agent", Path.rmdir)
    cgroup = Cgroup.create(parents, nsexec.owned_name("agent"), limits) if parents else None
    server = NsExec(own_netns=True)
    server.start()
    jail = Jail(pid=target, uid=args.uid, gid=args.gid, limits=limits, files=Path(f"/proc/self/fd/{work_fd}"),
                pidfd=pidfd, cgroup=cgroup)  # fmt: skip
    agent = Agent(jail, server, pidfd, work_fd, tmp_fd, token)
    runner = web.AppRunner(agent.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        address = args.advertise or f"{args.host}:{port}"
        log.info("sandbox agent serving", address=address, target_pid=target, sandbox=args.sandbox_id)
        if args.ready_url:
            await announce(args.ready_url, token, args.sandbox_id, address)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        if agent.target_alive():
            try:
                await server.kill_all(jail)
            except SandboxError as exc:
                log.warning("could not kill the commands left running", error=str(exc))
        server.close()
        os.close(pidfd)
        os.close(work_fd)
        if tmp_fd is not None:
            os.close(tmp_fd)
        if cgroup is not None:
            await cgroup.remove()
    return 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))
