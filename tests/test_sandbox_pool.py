"""The sandbox pool over real local sandboxes: pre-warming, the concurrency cap, reuse after reset, and a
sandbox failure masking its rollout and cancelling what the rollout was waiting on."""

import asyncio

import pytest

from i3core.errors import RolloutMasked, SandboxError
from i3core.sandbox.pool import SANDBOX_FAILED, SandboxPool
from tests.sandbox_backends import backend_for

pytestmark = pytest.mark.sandbox


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def pool_for(tmp_path, **options) -> SandboxPool:
    return SandboxPool.for_backend(backend_for("local", tmp_path, **options))


def test_warm_sandboxes_are_made_ahead_and_refilled(tmp_path):
    async def go():
        pool = pool_for(tmp_path, warm=2)
        try:
            await pool.start()
            assert pool.stats["created"] == 2
            async with pool.lease() as sb:
                assert pool.stats["created"] == 2  # the lease took a warm one (the refill has not run yet)
                assert (await sb.exec("echo hi")).stdout == "hi\n"
                for _ in range(200):  # the pool refills in the background (bounded wait)
                    if pool.stats["created"] == 3:
                        break
                    await asyncio.sleep(0.05)
                assert pool.stats["created"] == 3
        finally:
            await pool.close()

    run(go())


def test_concurrency_cap(tmp_path):
    async def go():
        pool = pool_for(tmp_path, max_concurrent=2, reuse=False)
        now = peak = 0

        async def rollout():
            nonlocal now, peak
            async with pool.lease() as sb:
                now += 1
                peak = max(peak, now)
                await sb.exec("sleep 0.2")
                now -= 1

        try:
            await asyncio.gather(*(rollout() for _ in range(6)))
        finally:
            await pool.close()
        assert peak == 2
        assert pool.stats["created"] == 6

    run(go())


def test_reuse_after_reset_leaves_nothing_behind(tmp_path):
    async def go():
        pool = pool_for(tmp_path, max_concurrent=1)
        try:
            async with pool.lease() as sb:
                first = sb.id
                await sb.write_file("left.txt", "from the last rollout")
                await sb.exec("nohup python3 -c 'import time; time.sleep(60)' >/dev/null 2>&1 &")
            for _ in range(200):
                if pool.stats["reset"] == 1:
                    break
                await asyncio.sleep(0.05)
            async with pool.lease() as sb:
                assert sb.id == first and pool.stats["created"] == 1
                listing = await sb.exec("ls -A; ps -eo comm=")
                assert "left.txt" not in listing.stdout and "python3" not in listing.stdout, listing
        finally:
            await pool.close()

    run(go())


def test_a_sandbox_error_masks_the_rollout_and_the_sandbox_is_not_reused(tmp_path):
    async def go():
        pool = pool_for(tmp_path, max_concurrent=1)
        try:
            with pytest.raises(RolloutMasked) as masked:
                async with pool.lease() as sb:
                    first = sb.id
                    raise SandboxError("agent stopped answering")
            assert masked.value.reason == SANDBOX_FAILED and "agent stopped" in masked.value.detail
            assert pool.stats["failed"] == 1
            async with pool.lease() as sb:
                assert sb.id != first
        finally:
            await pool.close()

    run(go())


def test_a_sandbox_dying_mid_rollout_cancels_the_generation_and_masks(tmp_path):
    async def go():
        pool = pool_for(tmp_path, health_interval_s=0.1)
        generation_cancelled = asyncio.Event()

        async def generate():
            try:
                await asyncio.sleep(60)  # a long generation request the rollout is waiting on
            except asyncio.CancelledError:
                generation_cancelled.set()
                raise

        async def rollout():
            async with pool.lease() as sb:
                await sb.exec("true")
                asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(sb.close()))
                await generate()

        try:
            start = asyncio.get_running_loop().time()
            with pytest.raises(RolloutMasked) as masked:
                await rollout()
            assert asyncio.get_running_loop().time() - start < 10
            assert masked.value.reason == SANDBOX_FAILED
            assert generation_cancelled.is_set()
            assert not asyncio.current_task().cancelling()  # the cancellation was turned into the mask
        finally:
            await pool.close()

    run(go())


def test_other_cancellations_pass_through(tmp_path):
    async def go():
        pool = pool_for(tmp_path)

        async def rollout():
            async with pool.lease():
                await asyncio.sleep(60)

        try:
            task = asyncio.create_task(rollout())
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.stats["failed"] == 0
        finally:
            await pool.close()

    run(go())


def test_a_run_stopping_as_the_sandbox_dies_stops_the_rollout(tmp_path):
    """Two cancels at once, the pool's watcher's (the sandbox died) and the run's: the rollout ends cancelled, not
    masked (the mask answered the watcher's cancel and dropped the run's), and the sandbox is not reused."""
    async def go():
        pool = pool_for(tmp_path, health_interval_s=0.1)
        task = None

        async def rollout():
            async with pool.lease() as sb:

                async def dies_as_the_run_stops():
                    task.cancel()  # the run stopping, in the moment the watcher finds the sandbox gone
                    return False

                sb.alive = dies_as_the_run_stops
                await asyncio.sleep(60)

        try:
            task = asyncio.create_task(rollout())
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.stats["failed"] == 1
        finally:
            await pool.close()

    run(go())


def test_reuse_keeps_the_number_of_sandboxes_at_the_cap(tmp_path):
    """A slot is freed only once its sandbox is reset, so a busy pool reuses instead of making more."""

    async def go():
        pool = pool_for(tmp_path, max_concurrent=2)

        async def rollout():
            async with pool.lease() as sb:
                await sb.write_file("x", "y")

        try:
            for _ in range(4):
                await asyncio.gather(*(rollout() for _ in range(3)))
        finally:
            await pool.close()
        assert pool.stats["created"] == 2, pool.stats
        assert pool.stats["reset"] >= 10

    run(go())
