"""The orchestrator role: one asyncio process that keeps rollouts flowing and feeds the trainer.

Per prompt group: pick the next example, send the whole group to the next
live server (round robin), run ``group_size`` rollouts through the env, fire
``i3_on_rollout_finished`` and ``i3_on_group_scored``. Finished groups queue
up; a batch is cut from the first ``batch_size / group_size`` of them once the
off-policy bound allows, groups older than ``max_off_policy_steps`` are
dropped whole, advantages are ``R - mean(R_group)``, and the packed batch is
written for the trainer. A watcher follows the trainer's published versions,
tells every server to load them (in flight: running sequences continue under
the new version) and writes each step's metrics.

Every rollout is in exactly one ledger bucket at every step:
started = trained + dropped_stale + masked + failed + in_flight.
"""

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from i3core.errors import ServerError
from i3core.events import end_step, group_kept
from i3core.packing import group_advantages, pack, sample_from_rollout
from i3core.files import atomic_torch_save
from i3core.trainer import RunPaths
from i3core.types import Group

log = structlog.get_logger("i3core.orchestrator")

TRAINER_POLL_S = 0.02


@dataclass
class Ledger:
    started: int = 0
    trained: int = 0
    dropped_stale: int = 0
    masked: int = 0
    failed: int = 0

    @property
    def in_flight(self) -> int:
        return self.started - self.trained - self.dropped_stale - self.masked - self.failed

    def metrics(self) -> dict[str, float]:
        return {
            "rollouts/started": self.started,
            "rollouts/trained": self.trained,
            "rollouts/dropped_stale": self.dropped_stale,
            "rollouts/masked": self.masked,
            "rollouts/failed": self.failed,
            "rollouts/in_flight": self.in_flight,
        }


@dataclass
class ClientSlot:
    client: Any
    url: str
    down: bool = False
    errors: int = 0


@dataclass
class Orchestrator:
    config: Any
    plugins: Any
    env: Any
    scheduler: Any
    weight_sync: Any
    clients: list[ClientSlot]
    sinks: list
    progress: Any = None
    ledger: Ledger = field(default_factory=Ledger)

    def __post_init__(self):
        self.paths = RunPaths(self.config.run.out)
        self.max_steps = self.config.run.max_steps
        self.served_version = 0
        self._rr = itertools.count()
        self._batch_metrics: dict[int, dict[str, float]] = {}
        self._version_event = asyncio.Event()
        self._started = time.perf_counter()

    # -- rollouts ------------------------------------------------------------

    def _next_client(self) -> ClientSlot | None:
        live = [c for c in self.clients if not c.down]
        return live[next(self._rr) % len(live)] if live else None

    async def _run_group(self, example) -> Group:
        slot = self._next_client()
        size = self.scheduler.config.group_size
        self.ledger.started += size
        if slot is None:
            self.ledger.failed += size
            return Group(example, [])
        results = await asyncio.gather(*(self.env.rollout(slot.client, example) for _ in range(size)),
                                       return_exceptions=True)
        rollouts = []
        for result in results:
            if isinstance(result, ServerError):
                self.ledger.failed += 1
                slot.errors += 1
                if not slot.down:
                    slot.down = True
                    log.warning("inference server marked down", url=slot.url, error=str(result))
            elif isinstance(result, Exception):  # the env failed on this rollout: counted, the run goes on
                self.ledger.failed += 1
                log.warning("rollout failed", example=example.id, error=f"{type(result).__name__}: {result}")
            elif isinstance(result, BaseException):
                raise result
            else:
                self.plugins.hook.i3_on_rollout_finished(rollout=result)
                rollouts.append(result)
        return Group(example, rollouts)

    def _examples(self):
        examples = list(self.env.examples())
        rng = random.Random(self.config.run.seed)
        while True:
            rng.shuffle(examples)
            yield from examples

    # -- batches ---------------------------------------------------------------

    def _cut_batch(self, step: int, ready: list[Group]) -> bool:
        """Cut the batch of ``step`` from ``ready`` (dropping stale groups); False if too few are left."""
        fresh = []
        for group in ready:
            oldest = min(r.oldest_version for r in group.rollouts)
            if self.scheduler.is_stale(oldest, step):
                self.ledger.dropped_stale += len(group.rollouts)
            else:
                fresh.append(group)
        ready[:] = fresh
        need = self.scheduler.groups_per_batch
        if len(ready) < need:
            return False
        groups, ready[:] = ready[:need], ready[need:]
        rollouts = [r for g in groups for r in g.rollouts]
        for group in groups:
            for rollout, advantage in zip(group.rollouts, group_advantages(group.rewards())):
                rollout.advantage = advantage
        batch = pack([sample_from_rollout(r) for r in rollouts], self.config.trainer.seq_len)
        self.plugins.hook.i3_on_batch(batch=batch, step=step)
        atomic_torch_save(batch, self.paths.batch(step))
        self.ledger.trained += len(rollouts)
        rewards = [r.reward for r in rollouts]
        staleness = [(step - 1) - r.oldest_version for r in rollouts]
        self._batch_metrics[step] = {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/max": max(rewards),
            "reward/min": min(rewards),
            "off_policy/mean_steps": sum(staleness) / len(staleness),
            "off_policy/max_steps": max(staleness),
            "completion/mean_tokens": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
        }
        return True

    # -- trainer watch -----------------------------------------------------------

    async def _watch_trainer(self) -> None:
        step = 1
        while step <= self.max_steps:
            metrics_path = self.paths.trainer_metrics(step)
            if not (metrics_path.exists() and self.weight_sync.is_ready(self.paths.broadcasts, step)):
                await asyncio.sleep(TRAINER_POLL_S)
                continue
            trainer_metrics = json.loads(metrics_path.read_text())
            served = step - self.scheduler.config.weight_update_lag
            if served > self.served_version:
                await self._update_servers(self.weight_sync.location(self.paths.broadcasts, served), served)
            metrics = {**self._batch_metrics.pop(step, {}), **trainer_metrics, **self.ledger.metrics()}
            metrics["weights/version"] = step
            metrics["weights/served_version"] = self.served_version
            metrics["time/elapsed_s"] = time.perf_counter() - self._started
            end_step(self.plugins.hook, self.sinks, step, metrics)
            if self.progress is not None:
                self.progress(step, metrics)
            step += 1

    async def _update_servers(self, weights: Path, version: int) -> None:
        live = [c for c in self.clients if not c.down]
        results = await asyncio.gather(*(c.client.update_weights(str(weights), version) for c in live),
                                       return_exceptions=True)
        for slot, result in zip(live, results):
            if isinstance(result, BaseException):
                slot.down = True
                log.warning("inference server marked down", url=slot.url, error=str(result))
        self.served_version = version
        self._version_event.set()
        self.plugins.hook.i3_on_weights_updated(version=version)

    # -- main loop -----------------------------------------------------------------

    async def run(self) -> None:
        examples = self._examples()
        watcher = asyncio.create_task(self._watch_trainer())
        running: set[asyncio.Task] = set()
        ready: list[Group] = []
        step = 1
        try:
            while step <= self.max_steps:
                if watcher.done():
                    watcher.result()  # re-raise a failure of the watcher
                while len(running) < self.scheduler.groups_inflight:
                    running.add(asyncio.create_task(self._run_group(next(examples))))
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
                for task in done:
                    group = task.result()
                    if not group.rollouts:
                        continue
                    if group_kept(self.plugins.hook, group):
                        ready.append(group)
                    else:
                        self.ledger.masked += len(group.rollouts)
                if not any(not c.down for c in self.clients):
                    raise RuntimeError("every inference server is down")
                while step <= self.max_steps and step - 1 - self.served_version <= self.scheduler.config.max_async:
                    if not self._cut_batch(step, ready):
                        break
                    step += 1
            await watcher
        finally:
            watcher.cancel()
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
