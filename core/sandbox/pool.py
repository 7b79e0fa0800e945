"""Sandboxes for rollouts: pre-warmed, capped in number, reused after a reset.

``async with pool.lease() as sb`` hands one sandbox to one rollout. When the
sandbox fails while leased (a :class:`~i3core.errors.SandboxError` out of the
block, or ``alive()`` turning false while the rollout is waiting on anything,
its generation included), the rollout is masked: the leasing task is
cancelled (which cancels the generation request it was awaiting) and
:class:`~i3core.errors.RolloutMasked` with reason ``sandbox_failed`` is
raised in place of the cancellation, for the orchestrator's ledger. A failed
sandbox is closed, never handed out again.
"""

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import structlog

from i3core.errors import I3Error, RolloutMasked, SandboxError
from i3core.protocols import Sandbox, SandboxBackend

log = structlog.get_logger("i3core.sandbox")

SANDBOX_FAILED = "sandbox_failed"
"""The ledger's masked reason for a rollout whose sandbox failed."""


def check_env_has_sandboxes(env, backend, config) -> None:
    """Refuse an env that runs code (``requires_sandbox``) in a run (``config``) without a ``[sandbox]`` backend."""
    if getattr(env, "requires_sandbox", False) and backend is None:
        raise I3Error(f"env {config.get('env').name!r} runs code: add a [sandbox] section (use = \"local\", \"docker\" or \"k8s\")")


class SandboxPool:
    """Leases sandboxes of one backend to rollouts.

    :param warm: sandboxes kept created and idle ahead of demand (cold starts
        leave the rollout's critical path).
    :param max_concurrent: most sandboxes leased (or being reset after a lease) at once; further leases wait.
    :param reuse: reset a sandbox after a lease and hand it out again (else
        close it).
    :param health_interval_s: how often a leased sandbox's ``alive()`` is polled.
    """

    def __init__(self, backend: SandboxBackend, *, warm: int = 0, max_concurrent: int = 64, reuse: bool = True,
                 health_interval_s: float = 1.0):  # fmt: skip
        self.backend = backend
        self.warm = warm
        self.reuse = reuse
        self.health_interval_s = health_interval_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._idle: list[Sandbox] = []
        self._background: set[asyncio.Task] = set()
        self._refilling = 0
        self._closed = False
        self.stats: Counter = Counter()
        """Counts for metrics: ``created``, ``reset`` (for reuse), ``failed``, and ``leased`` now."""

    @classmethod
    def for_backend(cls, backend) -> "SandboxPool":
        """A pool configured from the backend's ``Config`` (``warm``, ``max_concurrent``, ``reuse``, ...)."""
        c = backend.config
        return cls(backend, warm=c.warm, max_concurrent=c.max_concurrent, reuse=c.reuse,
                   health_interval_s=c.health_interval_s)  # fmt: skip

    async def start(self) -> None:
        """Create the ``warm`` sandboxes (concurrently); a backend that cannot start one raises SandboxError."""
        made = await asyncio.gather(*(self._create() for _ in range(self.warm)), return_exceptions=True)
        errors = [m for m in made if isinstance(m, BaseException)]
        self._idle.extend(m for m in made if not isinstance(m, BaseException))
        if errors:
            await self.close()
            raise errors[0]

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Sandbox]:
        """One sandbox for the block; a sandbox failure inside it becomes ``RolloutMasked('sandbox_failed')``."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        await self._slots.acquire()  # released once the sandbox is back: reset (or closed) after the lease
        try:
            sandbox = await self._take()
        except BaseException as exc:
            self._slots.release()
            if isinstance(exc, SandboxError):
                self.stats["failed"] += 1
                raise RolloutMasked(SANDBOX_FAILED, f"no sandbox could be started: {exc}") from None
            raise
        task = asyncio.current_task()
        dead = asyncio.Event()
        watcher = asyncio.create_task(self._watch(sandbox, task, dead))
        self.stats["leased"] += 1
        failed = False
        try:
            yield sandbox
        except SandboxError as exc:
            failed = True
            # the watcher's cancel turned into this error on its way out; a cancel besides it (the run stopping) stands
            if dead.is_set() and task.uncancel():
                raise asyncio.CancelledError from None
            raise RolloutMasked(SANDBOX_FAILED, str(exc)) from None
        except asyncio.CancelledError:
            if not dead.is_set() or task.uncancel():  # not the watcher's alone: the run is stopping
                raise
            failed = True
            raise RolloutMasked(SANDBOX_FAILED, f"sandbox {sandbox.id} died during the rollout") from None
        finally:
            self.stats["leased"] -= 1
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            failed = failed or dead.is_set()
            if failed:
                self.stats["failed"] += 1
                log.warning("sandbox failed during a rollout", sandbox=sandbox.id)
            self._give_back(sandbox, failed)

    async def close(self) -> None:
        """Close every idle sandbox, stop refilling, and close the backend (which closes any still leased)."""
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(sb.close() for sb in idle), return_exceptions=True)
        await self.backend.aclose()

    # -- internals ----------------------------------------------------------------

    async def _create(self) -> Sandbox:
        sandbox = await self.backend.create()
        self.stats["created"] += 1
        return sandbox

    async def _take(self) -> Sandbox:
        if self._idle:
            sandbox = self._idle.pop()
        else:
            sandbox = await self._create()
        self._refill()
        return sandbox

    def _refill(self) -> None:
        """Start creating sandboxes until ``warm`` are idle or on their way."""
        while not self._closed and len(self._idle) + self._refilling < self.warm:
            self._refilling += 1
            self._spawn(self._refill_one())

    async def _refill_one(self) -> None:
        try:
            self._idle.append(await self._create())
        except SandboxError as exc:
            log.warning("could not pre-warm a sandbox", error=str(exc))
        finally:
            self._refilling -= 1

    def _give_back(self, sandbox: Sandbox, failed: bool) -> None:
        """Reset (or close) ``sandbox`` in the background; its lease slot is freed when that is done, so at most
        ``max_concurrent`` sandboxes are ever leased or being reset, and ``warm`` more idle."""

        async def give_back():
            try:
                if failed or not self.reuse or self._closed:
                    await _close_quietly(sandbox)
                else:
                    await self._reset(sandbox)
            finally:
                self._slots.release()

        self._spawn(give_back())

    async def _reset(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.reset()
        except Exception as exc:  # a SandboxError, or a backend's bug: either way never handed out, never leaked
            log.warning("sandbox reset failed; closing it", sandbox=sandbox.id, error=f"{type(exc).__name__}: {exc}")
            self.stats["failed"] += 1
            await _close_quietly(sandbox)
            return
        if self._closed:
            await _close_quietly(sandbox)
            return
        self.stats["reset"] += 1
        self._idle.append(sandbox)

    async def _watch(self, sandbox: Sandbox, task: asyncio.Task, dead: asyncio.Event) -> None:
        """Poll ``alive()``; when it turns false (or raises), cancel the leasing task."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                alive = await sandbox.alive()
            except Exception:
                alive = False
            if not alive:
                dead.set()
                task.cancel()
                return

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:  # a sandbox that cannot even close is logged; the backend's aclose sweeps it
        log.warning("sandbox close failed", sandbox=sandbox.id, error=f"{type(exc).__name__}: {exc}")
