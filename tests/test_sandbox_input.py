"""Input a model controls, against every sandbox backend that runs here: it gets an exec result or a
SandboxFileError, never a SandboxError of a healthy sandbox nor a raw exception; a tree of any depth is reset and
closed, and the pool reuses its sandbox.
"""

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from i3core.errors import SandboxFileError
from i3core.sandbox.base import MAX_TIMEOUT_S, empty_dir_fd
from i3core.sandbox.pool import SandboxPool
from i3core.types import ExecResult
from tests.sandbox_backends import SANDBOX_BACKENDS, backend_for

pytestmark = pytest.mark.sandbox

DEEP = 3000
"""Deeper than Python's recursion limit: a recursive removal raises RecursionError."""


@pytest.fixture(params=SANDBOX_BACKENDS)
def backend(request, tmp_path):
    backend = backend_for(request.param, tmp_path, memory_mb=128, timeout_s=10.0)
    yield backend
    asyncio.run(backend.aclose())


# Every code point, lone surrogates and NUL included, with the awkward ones often.
awkward_text = st.text(st.one_of(st.sampled_from("\0\ud800\udc80\udfff/.\n \\é\U0001f600"), st.characters()),
                       max_size=12)  # fmt: skip
commands = st.one_of(awkward_text, st.lists(awkward_text, max_size=4), st.integers(), st.none(),
                     st.lists(st.one_of(st.none(), st.integers(), awkward_text), min_size=1, max_size=3))  # fmt: skip
timeouts = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**30),
                     st.sampled_from([1e19, 0, -0.0, True, "1", MAX_TIMEOUT_S * 2]))  # fmt: skip


def test_fuzzed_argv_paths_and_timeouts_are_results_or_file_errors(backend):
    """Hypothesis drives one sandbox: exec gives an ExecResult for anything, files a SandboxFileError at worst, and
    the sandbox stays healthy all along."""
    loop = asyncio.new_event_loop()
    sandbox = loop.run_until_complete(backend.create())

    def run(coro):
        return loop.run_until_complete(asyncio.wait_for(coro, 60))

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(cmd=commands, timeout=timeouts, path=awkward_text, data=st.one_of(awkward_text, st.binary(max_size=8)))
    def one(cmd, timeout, path, data):
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout <= MAX_TIMEOUT_S:
            timeout = min(timeout, 5.0)  # a valid timeout: keep a runaway example short
        result = run(sandbox.exec(cmd, timeout=timeout))
        assert isinstance(result, ExecResult)
        valid_timeout = timeout is None or (not isinstance(timeout, bool) and isinstance(timeout, int | float)
                                            and 0 < timeout <= MAX_TIMEOUT_S and not math.isnan(timeout))  # fmt: skip
        if not valid_timeout:
            assert result.exit_code == 126 and "exec refused" in result.stderr, result
        try:
            run(sandbox.write_file(path, data))
            assert run(sandbox.read_file(path)) == (data.encode() if isinstance(data, str) else data)
        except SandboxFileError:
            pass
        try:
            run(sandbox.read_file(path))
        except SandboxFileError:
            pass

    try:
        one()
        assert run(sandbox.alive())
        assert run(sandbox.exec("echo ok")).stdout == "ok\n"
    finally:
        loop.run_until_complete(sandbox.close())
        loop.close()


DEEP_TREE = f"import os\nfor top in ('/tmp', '.'):\n    os.chdir(top)\n    for _ in range({DEEP}): os.mkdir('d'); os.chdir('d')"


def test_a_deep_tree_is_reset_and_the_pool_reuses_its_sandbox(backend):
    async def go():
        pool = SandboxPool(backend, max_concurrent=1)
        try:
            async with pool.lease() as sb:
                first = sb.id
                result = await sb.exec(["python3", "-c", DEEP_TREE], timeout=60)
                assert result.exit_code == 0, result
            async with pool.lease() as sb:
                assert sb.id == first and pool.stats["failed"] == 0  # reset worked: the same sandbox again
                listing = await sb.exec("ls -A . /tmp")
                assert "d" not in listing.stdout.split(), listing
                await sb.exec(["python3", "-c", DEEP_TREE], timeout=60)
            async with await backend.create() as other:  # closing a deep tree works, and creation goes on
                assert (await other.exec("echo ok")).stdout == "ok\n"
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(go(), 300))


def test_empty_dir_fd_handles_any_depth_and_keeps_the_top(tmp_path):
    import os

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    for index in range(DEEP):  # relative to a descriptor: the whole path is far past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        if index % 500 == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
            os.symlink("/etc", "link", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    (tmp_path / "file").write_text("x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        empty_dir_fd(fd)
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == [] and os.path.isdir("/etc")


FD_CYCLE = """
import os, socket
a, b = socket.socketpair()
print("before", flush=True)
socket.send_fds(a, [b"x"], [a.fileno(), b.fileno(), 1, 2])  # a and b in flight in b's queue: a cycle
a.close(); b.close()
os.close(1); os.close(2)
"""


def test_pipes_held_in_a_descriptor_cycle_end_the_exec_at_its_timeout(backend):
    """No process holds the output pipes any more, only a unix socket in flight that nothing references: the
    exec ends at its timeout (plus a grace), with the output that came, instead of failing long after."""
    async def go():
        async with await backend.create() as sb:
            start = asyncio.get_running_loop().time()
            result = await sb.exec(["python3", "-c", FD_CYCLE], timeout=2)
            took = asyncio.get_running_loop().time() - start
            assert took < 8, took
            assert result.stdout == "before\n", result
            assert await sb.alive() and (await sb.exec("echo ok")).stdout == "ok\n"

    asyncio.run(asyncio.wait_for(go(), 120))


def test_an_output_flood_costs_the_host_little(backend):
    """Past max_output_bytes, output is dropped by the kernel at a bounded pace: the host process spends a small
    fraction of a core on a sandbox that writes as fast as it can."""
    import resource

    async def go():
        async with await backend.create() as sb:
            before = resource.getrusage(resource.RUSAGE_SELF)
            result = await sb.exec("cat /dev/zero", timeout=3)
            after = resource.getrusage(resource.RUSAGE_SELF)
            assert result.timed_out and result.truncated and len(result.stdout) == sb_cap(backend), result.exit_code
            used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            assert used < 0.9, f"the host spent {used:.2f} s of CPU on 3 s of flood"

    asyncio.run(asyncio.wait_for(go(), 120))


def sb_cap(backend) -> int:
    return backend.config.max_output_bytes
