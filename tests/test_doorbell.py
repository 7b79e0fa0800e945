"""The rings between a colocated trainer and the orchestrator (i3core.loop.doorbell): each wakes its waiter from
another thread at once, a ring before the wait is kept, and a ring nobody can hear is harmless."""

import asyncio
import threading
import time

from i3core.loop.doorbell import Doorbell


def ring_later(ring, delay: float = 0.05) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), ring()))
    thread.start()
    return thread


def test_the_trainer_wakes_at_a_ring_from_another_thread_and_keeps_one_rung_before_its_wait():
    bell = Doorbell()
    bell.trainer_clear()
    started = time.monotonic()
    thread = ring_later(bell.ring_trainer)
    bell.trainer_wait(timeout=30)
    assert time.monotonic() - started < 10
    thread.join()
    bell.trainer_clear()
    bell.ring_trainer()  # between the look and the wait
    started = time.monotonic()
    bell.trainer_wait(timeout=30)
    assert time.monotonic() - started < 1
    bell.trainer_clear()
    started = time.monotonic()
    bell.trainer_wait(timeout=0.05)  # no ring: the long look's timeout
    assert time.monotonic() - started >= 0.05


def test_the_orchestrators_loop_wakes_at_a_ring_from_the_trainers_thread():
    bell = Doorbell()
    bell.ring_orchestrator()  # no loop bound yet: nobody waits, nothing to do

    async def scenario():
        bell.bind()
        bell.orchestrator_clear()
        started = time.monotonic()
        thread = ring_later(bell.ring_orchestrator)
        await bell.orchestrator_wait(timeout=30)
        woke = time.monotonic() - started
        thread.join()
        bell.orchestrator_clear()
        bell.ring_orchestrator()
        await asyncio.sleep(0)  # the ring lands on the loop before the wait
        started = time.monotonic()
        await bell.orchestrator_wait(timeout=30)
        return woke, time.monotonic() - started

    woke, kept = asyncio.run(scenario())
    assert woke < 10 and kept < 1
    bell.ring_orchestrator()  # its loop is closed: harmless
