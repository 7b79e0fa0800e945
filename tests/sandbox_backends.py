"""Which sandbox backends the tests run over here, how each is built for a test, and how a test finds the
processes of a sandbox.

``local`` always runs (these machines are root with namespaces). ``docker``
runs where a Docker engine answers; with ``I3CORE_REQUIRE_DOCKER=1`` (set by
.ci/run, which starts dockerd) a missing engine fails instead of skipping.
"""

import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path

import psutil
import pytest

from i3core.testing import make_component

REQUIRE_DOCKER = os.environ.get("I3CORE_REQUIRE_DOCKER", "") not in ("", "0")


def docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:
        return False


SANDBOX_BACKENDS = [
    "local",
    pytest.param("docker", marks=pytest.mark.skipif(not (REQUIRE_DOCKER or docker_available()),
                                                    reason="no Docker engine answers here")),
]  # fmt: skip


def backend_for(name: str, tmp_path: Path, **options):
    """A sandbox backend component for one test, with ``options`` on top of its defaults."""
    if name == "local":
        return make_component("sandbox", "local", root_dir=str(tmp_path / "sandboxes"), **options)
    if name == "docker":
        from tests.docker_image import test_image

        return make_component("sandbox", "docker", image=test_image(), **options)
    raise ValueError(name)


def namespace_members(pid: int) -> list[psutil.Process]:
    """Every process in the pid namespace of ``pid`` (psutil handles: safe against pid reuse)."""
    ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
    members = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/pid").st_ino == ns:
                members.append(proc)
        except OSError:
            pass
    return members


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def sleep_in_flight(call: Coroutine, target_pid: int) -> tuple[asyncio.Task, list[psutil.Process]]:
    """``call`` (which runs a ``sleep`` command in the namespaces of ``target_pid``) started as a task, once that
    command runs; (the task, every process of that pid namespace then)."""
    task = asyncio.create_task(call)
    for _ in range(1000):  # bounded: about 10 s
        members = namespace_members(target_pid)
        if any(p.name() == "sleep" and p.pid != target_pid for p in members):
            return task, members
        await asyncio.sleep(0.01)
    task.cancel()
    raise AssertionError("the command never started")


async def all_gone(members: list[psutil.Process]) -> bool:
    """Whether every one of ``members`` has ended within about 10 s (a killed init may still be on its way out)."""
    for _ in range(1000):
        if not [p for p in members if running(p)]:
            return True
        await asyncio.sleep(0.01)
    return False
