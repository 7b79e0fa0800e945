"""Wake-ups between a colocated trainer and the orchestrator, instead of their fast looks at files.

Each role looks for what the other writes (the trainer for its batch, the orchestrator for a version and the
trainer's metrics) every half millisecond: from another process a look costs the other role nothing. With
``[trainer] colocate`` both are threads of one process, and every look takes the interpreter lock from the work
of the role it waits for: the quickstart's trainer step measured 29 ms alone and 36 ms beside an event loop looking
every 0.5 ms (2026-12-07, docs/benchmarks.md). So a colocated run rings instead: whoever writes rings the other,
who waits on the ring with a long timeout. The files stay what each role reads, and the long look stays as the
fallback: a ring missed costs a little latency, never a step.
"""

import asyncio
import threading

LOOK_S = 0.05
"""How often a role waiting on a ring still looks for itself (STOP, its run gone, a ring it missed)."""


class Doorbell:
    """Two rings: the trainer's (a batch, a part or STOP is written) and the orchestrator's (a version or the
    trainer's metrics are). Each waiter clears its ring, looks, then waits: a ring between the look and the wait
    is not lost."""

    def __init__(self) -> None:
        self._trainer = threading.Event()
        self._orchestrator = asyncio.Event()  # an event belongs to the loop that first waits on it
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the trainer's side (a thread) ----------------------------------------

    def ring_trainer(self) -> None:
        self._trainer.set()

    def trainer_clear(self) -> None:
        self._trainer.clear()

    def trainer_wait(self, timeout: float = LOOK_S) -> None:
        """Until the trainer's ring (or ``timeout``); call :meth:`trainer_clear` before looking."""
        self._trainer.wait(timeout)

    # -- the orchestrator's side (its event loop) -----------------------------

    def bind(self) -> None:
        """The orchestrator's event loop (the running one) is where its ring sounds; call it before the first wait."""
        self._loop = asyncio.get_running_loop()

    def ring_orchestrator(self) -> None:
        loop = self._loop
        if loop is None:
            return  # no orchestrator waits yet: it looks before its first wait
        try:
            loop.call_soon_threadsafe(self._orchestrator.set)
        except RuntimeError:  # its loop is closed: nobody waits any more
            pass

    def orchestrator_clear(self) -> None:
        self._orchestrator.clear()

    async def orchestrator_wait(self, timeout: float = LOOK_S) -> None:
        """Until the orchestrator's ring (or ``timeout``); call :meth:`orchestrator_clear` before looking."""
        await wait_event(self._orchestrator, timeout)


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Until ``event`` is set or ``timeout`` seconds pass, whichever is first. With asyncio.timeout, not wait_for:
    Python 3.11's wait_for swallows a cancel that arrives as the event is set, and a cancelled run went on."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass
