"""What only the docker backend does: the container options it sets, bulk removal by label, its errors.

The hostile-code suite (test_sandbox_hostile.py) runs over docker too; these
tests inspect the containers themselves through the Docker SDK.
"""

import asyncio
import sys
import time

import pytest

from i3core.errors import ConfigError, I3Error, SandboxError
from i3core.plugins.sandboxes.docker_sandbox import LABEL
from i3core.testing import make_component
from tests.sandbox_backends import REQUIRE_DOCKER, docker_available

pytestmark = pytest.mark.sandbox
needs_engine = pytest.mark.skipif(not (REQUIRE_DOCKER or docker_available()), reason="no Docker engine answers here")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture
def engine():
    import docker

    client = docker.from_env(timeout=30)
    yield client
    client.close()


@pytest.fixture
def make_backend(engine):
    """Docker backends for one test; each is closed after it and must leave no container behind."""
    from tests.docker_image import test_image

    made = []

    def make(**options):
        backend = make_component("sandbox", "docker", image=test_image(), **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        asyncio.run(backend.aclose())
        assert engine.containers.list(all=True, filters={"label": f"{LABEL}={backend.id}"}) == []


@needs_engine
def test_container_options_are_applied(make_backend, engine, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("from the host")
    backend = make_backend(memory_mb=96, pids=40, cpus=0.5, file_size_mb=1, workdir="/sandbox/work",
                           read_only_mounts={str(shared): "/data"}, labels={"team": "rl"}, env={"GREETING": "hi"})

    async def go():
        async with await backend.create() as sb:
            host = engine.api.inspect_container(sb.container_id)["HostConfig"]
            assert host["NetworkMode"] == "none"
            assert (host["Memory"], host["MemorySwap"]) == (96 << 20, 96 << 20)
            assert (host["PidsLimit"], host["NanoCpus"]) == (40, 500_000_000)
            assert host["CapDrop"] == ["ALL"] and not host["CapAdd"] and not host["Privileged"]
            assert "no-new-privileges" in host["SecurityOpt"]
            assert host["ReadonlyRootfs"] and host["Init"]
            assert set(host["Tmpfs"]) == {"/tmp", "/sandbox/work"}
            assert [(u["Name"], u["Hard"]) for u in host["Ulimits"]] == [("fsize", 1 << 20)]
            labels = engine.api.inspect_container(sb.container_id)["Config"]["Labels"]
            assert labels[LABEL] == backend.id and labels["team"] == "rl"

            result = await sb.exec("id -u; id -g; pwd; echo $GREETING; grep CapEff /proc/self/status; "
                                   "cat /data/data.txt")
            assert result.stdout.split("\n")[:4] == ["65534", "65534", "/sandbox/work", "hi"], result
            assert "0000000000000000" in result.stdout and "from the host" in result.stdout, result
            for attempt in ("touch /i3-root", "touch /data/i3-mount", "ip link 2>/dev/null || ls /sys/class/net"):
                result = await sb.exec(attempt)
                assert result.exit_code != 0 or result.stdout.split() == ["lo"], (attempt, result)
            result = await sb.exec("head -c 2000000 /dev/zero > big")  # over file_size_mb
            assert result.exit_code != 0, result
            assert (await sb.exec("echo tmp > /tmp/t && cat /tmp/t")).stdout == "tmp\n"

    run(go())
    assert not (shared / "i3-mount").exists()


@needs_engine
def test_exit_codes_signals_and_oom(make_backend):
    backend = make_backend(memory_mb=64)

    async def go():
        async with await backend.create() as sb:
            assert (await sb.exec(["sh", "-c", "exit 7"])).exit_code == 7
            result = await sb.exec("kill -TERM $$")
            assert (result.exit_code, result.oom_killed) == (-15, False), result
            result = await sb.exec(["python3", "-c", "b = b'x' * (256 << 20)"])
            assert (result.exit_code, result.oom_killed) == (-9, True), result
            result = await sb.exec(["no-such-program"])
            assert (result.exit_code, result.stdout) == (127, "") and "no-such-program" in result.stderr, result
            result = await sb.exec(["/etc/passwd"])  # not executable
            assert (result.exit_code, result.stdout) == (126, "") and "permission denied" in result.stderr, result
            assert (await sb.exec("exit 126")).exit_code == 126

    run(go())


@needs_engine
def test_timeout_kills_detached_processes_but_keeps_the_sandbox(make_backend):
    backend = make_backend()

    async def go():
        async with await backend.create() as sb:
            await sb.exec("nohup setsid sleep 1000 >/dev/null 2>&1 &")
            result = await sb.exec("sleep 1000", timeout=1)
            assert result.timed_out and result.exit_code is None, result
            assert (await sb.exec(["ps", "-eo", "comm="])).stdout.split() == ["docker-init", "sleep", "ps"]
            assert await sb.alive()

    run(go())


@needs_engine
def test_a_command_that_closes_its_output_still_counts(make_backend):
    backend = make_backend()

    async def go():
        async with await backend.create() as sb:
            result = await sb.exec("echo early; exec >&- 2>&-; sleep 0.5; exit 4", timeout=5)
            assert (result.exit_code, result.stdout, result.timed_out) == (4, "early\n", False), result
            result = await sb.exec("exec >&- 2>&-; sleep 1000", timeout=1)
            assert result.timed_out and result.exit_code is None, result

    run(go())


@needs_engine
def test_timeout_kills_everything_while_the_pids_limit_is_full(make_backend):
    backend = make_backend(pids=16)

    async def go():
        async with await backend.create() as sb:
            result = await sb.exec("for i in $(seq 40); do sleep 1000 & done; wait", timeout=2)
            assert result.timed_out and "fork" in result.stderr.lower(), result  # the limit was reached
            assert (await sb.exec(["ps", "-eo", "comm="])).stdout.split() == ["docker-init", "sleep", "ps"]

    run(go())


@needs_engine
def test_reset_empties_the_work_directory_and_tmp_and_restores_them(make_backend):
    backend = make_backend()

    async def go():
        async with await backend.create() as sb:
            await sb.exec("mkdir -p a/b /tmp/d && touch a/b/c .hidden /tmp/d/e /tmp/f && chmod 000 a/b && chmod 700 . "
                          "&& ln -s / root && ln -s / /tmp/root")  # fmt: skip
            await sb.reset()
            result = await sb.exec("ls -A; ls -A /tmp; stat -c '%u %a' .")
            assert result.stdout == "65534 755\n", result
            await sb.write_file("again.txt", "ok")
            assert await sb.read_file("again.txt") == b"ok"

    run(go())


@needs_engine
def test_aclose_removes_every_labelled_container(make_backend, engine):
    from tests.docker_image import test_image

    backend = make_backend()

    async def go():
        sandboxes = [await backend.create() for _ in range(3)]
        await sandboxes[0].close()
        await sandboxes[0].close()  # idempotent
        assert not await sandboxes[0].alive()
        # a container whose sandbox object was lost still carries the label
        engine.containers.create(test_image(), ["sleep", "infinity"], network_mode="none",
                                 labels={LABEL: backend.id}).start()  # fmt: skip
        assert len(engine.containers.list(all=True, filters={"label": f"{LABEL}={backend.id}"})) == 3
        await backend.aclose()
        assert engine.containers.list(all=True, filters={"label": f"{LABEL}={backend.id}"}) == []
        assert not await sandboxes[1].alive()
        with pytest.raises(SandboxError, match="closed"):
            await sandboxes[1].exec("true")
        await sandboxes[1].close()  # already gone: still fine

    run(go())


@needs_engine
def test_a_container_that_dies_is_a_sandbox_error(make_backend, engine):
    backend = make_backend()

    async def go():
        async with await backend.create() as sb:
            engine.api.kill(sb.container_id)
            assert not await sb.alive()
            with pytest.raises(SandboxError, match=sb.id):
                await sb.exec("true")

    run(go())


@needs_engine
def test_an_engine_that_stops_answering_is_a_sandbox_error(make_backend, tmp_path):
    import docker

    backend = make_backend()

    async def go():
        sb = await backend.create()
        engine, backend._client = backend._client, docker.DockerClient(base_url=f"unix://{tmp_path}/gone.sock",
                                                                        version="1.41")  # fmt: skip
        try:
            for attempt in (sb.exec("true"), sb.close()):
                with pytest.raises(SandboxError, match=sb.id):
                    await attempt
            assert not await sb.alive()
        finally:
            backend._client = engine

    run(go())


@needs_engine
def test_unknown_image_is_a_sandbox_error():
    backend = make_component("sandbox", "docker", image="i3core-no-such-image:0")
    with pytest.raises(SandboxError, match=r"'i3core-no-such-image:0' is not on the engine.*docs/sandboxes.md"):
        run(backend.create())
    run(backend.aclose())


def test_no_engine_is_a_sandbox_error(tmp_path):
    pytest.importorskip("docker")
    backend = make_component("sandbox", "docker", image="any", docker_host=f"unix://{tmp_path}/none.sock")
    with pytest.raises(SandboxError, match="no Docker engine answers at unix://"):
        run(backend.create())
    run(backend.aclose())


@needs_engine
@pytest.mark.slow
def test_sixteen_sandboxes_at_once(make_backend):
    backend = make_backend()

    async def one(i: int) -> str:
        async with await backend.create() as sb:
            await sb.write_file("me.txt", str(i))
            result = await sb.exec("sleep 1; cat me.txt; ls")
            assert result.stdout == f"{i}me.txt\n", result
            return sb.id

    async def go():
        start = time.monotonic()
        ids = await asyncio.gather(*(one(i) for i in range(16)))
        assert len(set(ids)) == 16
        return time.monotonic() - start

    elapsed = run(go())
    assert elapsed < 60, elapsed  # the 1 s sleeps overlap


def test_config_refuses_root_and_mounts_over_the_work_directory():
    for options in ({"user": "0"}, {"user": "0:0"}, {"user": "root"}, {"read_only_mounts": {"/usr": "/work/usr"}},
                    {"read_only_mounts": {"usr": "/usr"}}, {}):  # fmt: skip
        with pytest.raises(ConfigError):
            make_component("sandbox", "docker", **({"image": "x"} if options else {}), **options)


def test_a_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "docker", None)  # import docker -> ImportError
    with pytest.raises(I3Error, match=r"pip install 'i3core\[docker\]'"):
        make_component("sandbox", "docker", image="x")
