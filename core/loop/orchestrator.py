"""The orchestrator role: one asyncio process that keeps rollouts flowing and feeds the trainer.

Slots: the scheduler says how many rollouts generate at once
(``rollout_slots``), spread evenly over the live servers. A new prompt group
goes to the next server in round robin that has room; its ``group_size``
rollouts take that server's slots as they free up, so a finished rollout's
slot is refilled at once (the ``async`` scheduler) or only for the next batch
(``sync``). Each rollout runs through the env; when a group's last rollout is
back, ``i3_on_group_scored`` may reshape or drop it. A batch is cut from the
first ``groups_per_batch`` finished groups once the scheduler allows, stale
groups are dropped whole, advantages are ``R - mean(R_group)`` (or per turn,
for rollouts with turn-level credit, see :mod:`i3core.loop.packing`), and the
packed batch is written for the trainer.

What the orchestrator asks of an env beyond the :class:`~i3core.protocols.Environment`
protocol, each optional: ``example_stream(rng)`` (the order prompts are drawn
in; default: the dataset, reshuffled every epoch), ``async score_group(rollouts)``
(group-level scoring once a group's last rollout is back, e.g. an env group's
mixing statistics or relative rewards), ``metrics()`` (added to every step's
metrics).

A watcher follows the trainer's published versions, tells every live server
to load them (in flight: running sequences continue under the new version)
and writes each step's metrics.

Client pool: a server that errors or times out is marked down; every rollout
running on it is cancelled and re-queued on the others (a rollout is trained
at most once: only a completed attempt counts), and the server is re-probed
with exponential backoff, brought to the served weights and re-admitted.

Every rollout is in exactly one ledger bucket at every step:
started = trained + dropped_stale + masked + failed + in_flight.
"""

import asyncio
import itertools
import json
import math
import numbers
import random
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from i3core.loop.checkpoint import OrchestratorState
from i3core.loop.doorbell import wait_event
from i3core.errors import EngineFailed, I3Error, RequestRefused, RolloutMasked, ServerError
from i3core.loop.events import end_step, group_kept
from i3core.files import atomic_torch_save
from i3core.loop.packing import assign_advantages, concat, pack, sample_from_rollout
from i3core.sandbox.pool import SandboxPool, check_env_has_sandboxes
from i3core.loop.paths import RunPaths
from i3core.loop import rollouts as rollout_log
from i3core.types import Example, Group, Rollout, TrainBatch

log = structlog.get_logger("i3core.orchestrator")

TRAINER_POLL_S = 0.002
"""How often the orchestrator looks for the trainer's next version (new groups may wait for it: ``max_sample_lag``)
while rollouts run: each look takes the event loop from them and the engine."""
TRAINER_POLL_IDLE_S = 0.0005
"""How often it looks when no rollout runs (an on-policy run waiting for the version its next batch needs): the
wait is all on the critical path, and the look takes nothing from a trainer in another process (a colocated one,
whose interpreter it would take, rings instead: :mod:`i3core.loop.doorbell`)."""
PROBE_FIRST_S = 0.5
"""First re-probe of a server marked down; doubles after every failed probe."""
PROBE_MAX_S = 8.0
ALL_DOWN_TIMEOUT_S = 300.0
"""With every server down this long (none re-admitted), the run fails instead of waiting forever."""
FAILED_IN_A_ROW = 1000
"""Rollouts failed (or refused by their server) or masked one after another, none kept for training between them,
after which the run fails saying why (the last error, the mask reasons): nothing can train (a prompt longer than the
engine's context, weights gone NaN, an env that always raises or always scores NaN), and going on would only burn the
dataset and fill the log. Legitimate masking (a truncated completion, a dead sandbox) comes between trained ones."""
FAILED = "failed"
"""What :meth:`Orchestrator._untrained` counts a failed rollout as (beside the mask reasons)."""
FILTERED = "group_filtered"
"""Masked reason of the rollouts of a group that an ``i3_on_group_scored`` plugin dropped."""
NONFINITE_REWARD = "nonfinite_reward"
"""Masked reason of a rollout whose reward is NaN, infinite or beyond :data:`REWARD_LIMIT` (from the env or a
reshaping plugin)."""
REWARD_LIMIT = 1.7e38
"""Half float32's largest number: any advantage ``R - mean(R)`` of rewards within it fits the batch's float32 (a
reward beyond it, 1e200, is finite in Python and infinite there)."""
NONFINITE_LOGPROB = "nonfinite_logprob"
"""Masked reason of a rollout with a NaN or infinite logprob on a model token (from the server)."""
NO_MODEL_TOKENS = "no_model_tokens"
"""Masked reason of a rollout that ended before the model generated a token (a multi-turn timeout or a full
context before the first turn): nothing to train, and no version to judge its staleness by."""


@dataclass
class Ledger:
    started: int = 0
    trained: int = 0
    dropped_stale: int = 0
    masked: int = 0
    failed: int = 0
    requeued: int = 0
    masked_reasons: Counter = field(default_factory=Counter)

    def unaccounted(self, in_flight: int) -> int:
        """Started rollouts in no bucket (0 unless the accounting is broken); ``in_flight`` is counted, not derived."""
        return self.started - self.trained - self.dropped_stale - self.masked - self.failed - in_flight

    @classmethod
    def resumed(cls, saved: dict) -> "Ledger":
        """The ledger saved in a checkpoint (:meth:`Orchestrator._state`), counting on from there."""
        fields = {k: v for k, v in saved.items() if k != "masked_reasons"}
        return cls(**fields, masked_reasons=Counter(saved.get("masked_reasons", {})))

    def mask(self, reason: str, count: int = 1) -> None:
        self.masked += count
        self.masked_reasons[reason] += count

    def metrics(self, in_flight: int) -> dict[str, float]:
        return {
            "rollouts/started": self.started,
            "rollouts/trained": self.trained,
            "rollouts/dropped_stale": self.dropped_stale,
            "rollouts/masked": self.masked,
            "rollouts/failed": self.failed,
            "rollouts/in_flight": in_flight,
            "rollouts/requeued": self.requeued,
            **{f"rollouts/masked/{reason}": n for reason, n in sorted(self.masked_reasons.items())},
        }


@dataclass(eq=False)
class ClientSlot:
    """One server's client and what the orchestrator knows about it."""

    client: Any
    url: str
    down: bool = False
    errors: int = 0
    running: int = 0
    """Rollouts generating on this server now."""
    assigned: int = 0
    """``running`` plus rollouts queued for this server."""
    probe: asyncio.Task | None = None


@dataclass(eq=False)
class OpenGroup:
    """A prompt group whose rollouts are not all back yet."""

    example: Example
    slot: ClientSlot
    outstanding: int
    position: int
    """Where the example was in the prompt stream (what a resumed run draws again)."""
    rollouts: list[Rollout] = field(default_factory=list)


@dataclass(eq=False)
class Job:
    """One rollout of an open group; ``started`` once it first took a slot (re-queues keep it)."""

    group: OpenGroup
    slot: ClientSlot
    started: bool = False


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
    sandbox_backend: Any = None
    """The ``[sandbox]`` component, if any: :meth:`run` keeps a pool of its sandboxes for the env's rollouts."""
    all_down_timeout_s: float = ALL_DOWN_TIMEOUT_S
    ledger: Ledger = field(default_factory=Ledger)
    resume: OrchestratorState | None = None
    """The state saved with the checkpoint a resumed run continues from (:mod:`i3core.loop.checkpoint`)."""
    model: Any = None
    """The ``[model]`` component: batches are packed as prefix trees if it trains them (``prefix_trees``)."""
    before_cut: Any = None
    """Called before each batch is written; raises to stop the run (a role following its trainer's attempt)."""
    doorbell: Any = None
    """A colocated trainer's :class:`~i3core.loop.doorbell.Doorbell`: rung at each batch, waited on for its
    versions and metrics instead of looking every half millisecond."""

    def __post_init__(self):
        self.share_prompts = bool(getattr(self.model, "prefix_trees", False) and self.config.trainer.share_prompts)
        self.paths = RunPaths(self.config.run.out)
        run = self.config.run
        self.rollout_log = rollout_log.RolloutLog(run.out, run.keep_rollouts, int(run.rollouts_max_mb * 2**20))
        self._env_name = self.config.get("env").name if self.config.get("env") is not None else ""
        self._tokenizer = self.model.tokenizer() if self.model is not None else None
        self._samples: dict[int, list[dict]] = {}
        """Each step's rollout lines, until its metrics are written (the sinks' sample tables)."""
        self.max_steps = self.config.run.max_steps
        self.served_version = 0
        self.step = 1
        if self.resume is not None:
            self.served_version = self.step = self.resume.step
            self.step += 1
            self.ledger = Ledger.resumed(self.resume.ledger)
        self._rr = itertools.count()
        self._batch_metrics: dict[int, dict[str, float]] = {}
        self._pending: deque[Job] = deque()
        self._running: dict[asyncio.Task, Job] = {}
        self._requeue_on_cancel: set[asyncio.Task] = set()
        self._open: set[OpenGroup] = set()
        self._scoring: dict[asyncio.Task, OpenGroup] = {}
        self._ready: list[Group] = []
        self._streamed: list[Group] = []
        """Groups of the batch of ``self.step`` already handed to the trainer as parts (``stream_groups``)."""
        self._parts: list[TrainBatch] = []
        """Those parts, in the order they were written."""
        self._to_redraw: set[int] = set() if self.resume is None else set(self.resume.redraw)
        """Positions a resumed run has still to draw again (saved again if it is checkpointed before)."""
        self._next_position = 0 if self.resume is None else self.resume.next_position
        """Prompts drawn from the stream so far (the position of the next new one)."""
        self._ready_at: dict[int, tuple[int, int]] = {}
        """Per finished group in ``_ready`` (by ``id(group)``): its stream position and the oldest policy version
        of its tokens (what :meth:`_cut_batch` checks for staleness at every try, counted once)."""
        self._untrained_in_a_row: Counter = Counter()
        """Rollouts neither trained nor in flight since the last one kept for training, by mask reason or
        :data:`FAILED` (:data:`FAILED_IN_A_ROW`)."""
        self._last_failure = ""
        self._dropped_metrics: set[str] = set()
        """Rollout metrics dropped as not numbers (each warned about once)."""
        self._wake = asyncio.Event()
        self._cut = asyncio.Event()
        """Set whenever a batch is cut (``self.step`` moved on)."""
        self._started = time.perf_counter()
        self._all_down_since: float | None = None
        self._examples = self._example_stream()
        self.sandboxes = None
        check_env_has_sandboxes(self.env, self.sandbox_backend, self.config)

    # -- the client pool -----------------------------------------------------

    def _live(self) -> list[ClientSlot]:
        return [c for c in self.clients if not c.down]

    def _capacity(self, live: list[ClientSlot]) -> int:
        return math.ceil(self.scheduler.rollout_slots / len(live))

    def _next_client(self, capacity: int) -> ClientSlot | None:
        """The next live server in round robin with room for more rollouts."""
        for _ in range(len(self.clients)):
            slot = self.clients[next(self._rr) % len(self.clients)]
            if not slot.down and slot.assigned < capacity:
                return slot
        return None

    def _mark_down(self, slot: ClientSlot, error: BaseException) -> None:
        slot.errors += 1
        if slot.down:
            return
        slot.down = True
        log.warning("inference server marked down", url=slot.url, error=str(error))
        for task, job in self._running.items():
            if job.slot is slot and not task.done():
                self._requeue_on_cancel.add(task)
                task.cancel()
        slot.probe = asyncio.create_task(self._probe(slot))

    async def _probe(self, slot: ClientSlot) -> None:
        """Re-probe a down server with backoff; bring it to the served weights, then re-admit it."""
        delay = PROBE_FIRST_S
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, PROBE_MAX_S)
            version = self.served_version
            try:
                health = await slot.client.health()
                if health.get("version") != version:
                    await slot.client.update_weights(self._weights_path(version), version)
            except ServerError as exc:
                log.debug("inference server still down", url=slot.url, error=str(exc))
                continue
            if version != self.served_version:  # a new version landed meanwhile: load that one first
                delay = 0.0
                continue
            slot.down = False
            slot.probe = None
            log.info("inference server re-admitted", url=slot.url, version=version)
            self._wake.set()
            return

    # -- rollouts ---------------------------------------------------------------

    def _fill(self) -> None:
        """Start queued rollouts where their server has a free slot, then new prompt groups while there is room."""
        live = self._live()
        if not live:
            return
        capacity = self._capacity(live)
        for job in list(self._pending):
            if job.slot.down:
                job.slot.assigned -= 1
                job.slot = min(live, key=lambda c: c.assigned)
                job.slot.assigned += 1
            if job.slot.running < capacity:
                self._pending.remove(job)
                self._start(job)
        size = self.scheduler.group_size
        while len(self._running) + len(self._pending) < self.scheduler.rollout_slots and self.scheduler.may_start_group(
            self.step, self.served_version, len(self._open) + len(self._ready) + len(self._streamed)
        ):
            slot = self._next_client(capacity)
            if slot is None:
                break
            position, example = next(self._examples)
            self._next_position = max(self._next_position, position + 1)
            group = OpenGroup(example, slot, outstanding=size, position=position)
            self._open.add(group)
            for _ in range(size):
                job = Job(group, slot)
                slot.assigned += 1
                if slot.running < capacity:
                    self._start(job)
                else:
                    self._pending.append(job)

    def _start(self, job: Job) -> None:
        if not job.started:
            job.started = True
            self.ledger.started += 1
        job.slot.running += 1
        task = asyncio.create_task(_contained(self.env.rollout(job.slot.client, job.group.example)))
        task.add_done_callback(lambda _: self._wake.set())
        self._running[task] = job

    def _collect(self) -> None:
        """Account every finished rollout task; close groups whose last rollout is back."""
        for task in [t for t in self._running if t.done()]:
            job = self._running.pop(task)
            job.slot.running -= 1
            requeue = task in self._requeue_on_cancel
            self._requeue_on_cancel.discard(task)
            error = None if task.cancelled() else task.exception()
            if isinstance(error, EngineFailed):  # the in-process engine broke: nothing can generate any more
                raise error
            if requeue or (isinstance(error, ServerError) and not isinstance(error, RequestRefused)):
                if error is not None:
                    self._mark_down(job.slot, error)
                self.ledger.requeued += 1
                self._pending.appendleft(job)
                continue
            job.slot.assigned -= 1
            group = job.group
            group.outstanding -= 1
            if task.cancelled():  # the orchestrator's own cancels re-queue (above): the env cancelled itself
                self._fail(group.example, "cancelled by the env")
            elif isinstance(error, RolloutMasked):
                self.ledger.mask(error.reason)
                self._log_unscored(group.example, rollout_log.MASKED.format(reason=error.reason), error.detail)
                log.info("rollout masked", example=group.example.id, reason=error.reason, detail=error.detail)
                self._untrained(error.reason)
            elif isinstance(error, Exception):  # the env failed on this rollout: counted, the run goes on
                self._fail(group.example, f"{type(error).__name__}: {error}")
            elif error is not None:
                raise error
            elif (problem := self._malformed(task.result())) is not None:  # the env's bug, this rollout's alone
                self._fail(group.example, f"env '{self._env_label()}' returned {problem}")
            else:
                rollout = task.result()
                self.plugins.call("i3_on_rollout_finished", rollout=rollout)
                group.rollouts.append(rollout)
            if group.outstanding == 0:
                self._score_group(group)
        for task in [t for t in self._scoring if t.done()]:
            group = self._scoring.pop(task)
            self._open.discard(group)
            error = asyncio.CancelledError("group scoring was cancelled") if task.cancelled() else task.exception()
            if error is None:
                self._close_group(Group(group.example, group.rollouts), group.position)
            elif isinstance(error, Exception | asyncio.CancelledError):  # counted as failed, the run goes on
                why = f"group scoring: {type(error).__name__}: {error}"
                self.ledger.failed += len(group.rollouts)
                for rollout in group.rollouts:
                    self._log(rollout, rollout_log.FAILED, error=why)
                log.warning("group scoring failed", example=group.example.id, error=f"{type(error).__name__}: {error}")
                self._untrained(FAILED, len(group.rollouts), why)
            else:
                raise error

    def _score_group(self, group: OpenGroup) -> None:
        """Close a group whose last rollout is back, after the env's group-level scoring when it has one."""
        score_group = getattr(self.env, "score_group", None)
        if score_group is None or not group.rollouts:
            self._open.discard(group)
            self._close_group(Group(group.example, group.rollouts), group.position)
            return
        task = asyncio.create_task(_contained(score_group(group.rollouts)))
        task.add_done_callback(lambda _: self._wake.set())
        self._scoring[task] = group

    def _close_group(self, group: Group, position: int) -> None:
        if not group.rollouts:
            return
        scored = list(group.rollouts)
        if not group_kept(self.plugins, group):
            self._mask_filtered(scored)
            return
        self._mask_filtered([r for r in scored if not any(r is k for k in group.rollouts)])  # a plugin removed them
        kept = []
        for rollout in group.rollouts:  # after every plugin had its say: nothing untrainable reaches a batch
            if (problem := self._malformed(rollout)) is not None:
                self._fail(group.example, f"after group scoring: {problem}")
            elif (reason := _untrainable(rollout)) is not None:
                self.ledger.mask(reason)
                self._log(rollout, rollout_log.MASKED.format(reason=reason))
                log.warning("rollout masked", example=group.example.id, reason=reason)
                self._untrained(reason)
            else:
                kept.append(rollout)
        group.rollouts[:] = kept
        if kept:
            self._untrained_in_a_row.clear()
            self._ready.append(group)
            self._ready_at[id(group)] = position, min(r.oldest_version for r in group.rollouts)

    def _mask_filtered(self, rollouts: list[Rollout]) -> None:
        """Count ``rollouts``, dropped by an ``i3_on_group_scored`` plugin, as masked (:data:`FILTERED`)."""
        if not rollouts:
            return
        self.ledger.mask(FILTERED, len(rollouts))
        for rollout in rollouts:
            self._log(rollout, rollout_log.MASKED.format(reason=FILTERED))
        self._untrained(FILTERED, len(rollouts))

    def _fail(self, example: Example, error: str) -> None:
        """Count one rollout of ``example`` that ended without a rollout to train as failed, with ``error``."""
        self.ledger.failed += 1
        self._log_unscored(example, rollout_log.FAILED, error)
        log.warning("rollout failed", example=example.id, error=error)
        self._untrained(FAILED, error=error)

    def _untrained(self, why: str, count: int = 1, error: str | None = None) -> None:
        """Count ``count`` rollouts that will not be trained (``why``: a mask reason, or :data:`FAILED` with its
        ``error``); stop the run once :data:`FAILED_IN_A_ROW` came one after another, none kept between them."""
        self._untrained_in_a_row[why] += count
        if error is not None:
            self._last_failure = error
        total = sum(self._untrained_in_a_row.values())
        if total < FAILED_IN_A_ROW:
            return
        failed = self._untrained_in_a_row[FAILED]
        if failed == total:
            raise I3Error(f"{total} rollouts in a row failed, none succeeded between them; "
                          f"the last: {self._last_failure}")
        masked = [(reason, n) for reason, n in self._untrained_in_a_row.most_common() if reason != FAILED]
        reasons = masked[0][0] if len(masked) == 1 else ", ".join(f"{reason} {n}" for reason, n in masked)
        failures = f" or failed ({failed}, the last: {self._last_failure})" if failed else ""
        raise I3Error(f"every rollout of the last {total} was masked ({reasons}){failures}; nothing can be trained")

    def _malformed(self, rollout: Any) -> str | None:
        """What makes ``rollout`` (from the env, or reshaped by a plugin) unfit to account, or None.

        Called where a rollout comes back from the env and again once plugins had their say on its group. Numbers of
        any real type (numpy, a 0-d tensor) become Python floats in place, so advantages, metrics and the saved state
        see floats; a metric that is not a number is dropped (metrics are logged, never trained on), warned once per
        name. A rollout that is not a :class:`Rollout`, a reward that is not a number, or token lists of different
        lengths make the rollout fail.
        """
        if not isinstance(rollout, Rollout):
            return f"{type(rollout).__name__}, not a Rollout"
        reward = _real(rollout.reward)
        if reward is None:
            return f"a reward that is not a number: {rollout.reward!r}"
        turn_rewards = [_real(r) for r in rollout.turn_rewards]
        if None in turn_rewards:
            return f"a turn reward that is not a number: {rollout.turn_rewards!r}"
        names = ["completion_ids", "completion_logprobs", "completion_versions", "completion_mask"]
        if rollout.completion_turns:
            names.append("completion_turns")
        lengths = {name: len(getattr(rollout, name)) for name in names}
        if len(set(lengths.values())) > 1:
            return "token lists of different lengths (" + ", ".join(f"{k} {n}" for k, n in lengths.items()) + ")"
        rollout.reward, rollout.turn_rewards = reward, turn_rewards
        metrics = {}
        for name, value in rollout.metrics.items():
            number = _real(value)
            if number is not None:
                metrics[name] = number
            elif name not in self._dropped_metrics:
                self._dropped_metrics.add(name)
                log.warning("rollout metric dropped: not a number", env=self._env_label(), metric=name,
                            value=repr(value)[:100])
        rollout.metrics = metrics
        return None

    def _env_label(self) -> str:
        """The env's name in the run's config (its class name where there is none), for error lines."""
        return self._env_name or type(self.env).__name__

    def _log(self, rollout: Rollout, outcome: str, error: str | None = None) -> None:
        """Keep ``rollout``'s line for the next step's ``rollouts/step_N.jsonl`` (:mod:`i3core.loop.rollouts`)."""
        line = rollout_log.record(rollout, outcome, self._env_name, self._tokenizer)
        self.rollout_log.add(line if error is None else {**line, "error": error})

    def _log_unscored(self, example: Example, outcome: str, error: str | None) -> None:
        self.rollout_log.add(rollout_log.unscored(example, outcome, self._env_name, error))

    def _in_flight(self) -> int:
        """Started rollouts not yet trained, dropped, masked or failed, counted where they are."""
        running = len(self._running)
        requeued = sum(1 for job in self._pending if job.started)
        finished = sum(len(g.rollouts) for groups in (self._open, self._ready, self._streamed) for g in groups)
        return running + requeued + finished

    def _example_stream(self):
        """``(position, example)`` in the order prompts are drawn; a resumed run first draws again the positions
        its checkpoint had not accounted for, then goes on from where the stream was."""
        positions = enumerate(self._examples_in_order())
        if self.resume is None:
            yield from positions
            return
        next_position = self.resume.next_position
        for position, example in positions:
            if position >= next_position or position in self._to_redraw:
                self._to_redraw.discard(position)
                yield position, example

    def _examples_in_order(self):
        rng = random.Random(self.config.run.seed)
        stream = getattr(self.env, "example_stream", None)
        if stream is not None:
            yield from stream(rng)
            raise I3Error(f"env '{self._env_label()}': its example_stream ended; it must yield prompts endlessly")
        examples = list(self.env.examples())
        if not examples:
            raise I3Error(f"env '{self._env_label()}' has no examples: its dataset is empty")
        while True:
            rng.shuffle(examples)
            yield from examples

    # -- batches ---------------------------------------------------------------

    def _cut_batch(self, step: int) -> bool:
        """Cut the batch of ``step`` from the finished groups (dropping stale ones); False if too few are left.

        With ``[trainer] stream_groups``, finished groups that do not complete the batch yet are handed over at
        once as a part (:meth:`_write_part`); the batch, when whole, holds the parts' rows first
        (``streamed_rows``) and the rest after them.
        """
        ready = self._ready
        fresh = []
        for group in ready:
            if self.scheduler.is_stale(self._ready_at[id(group)][1], step):
                self.ledger.dropped_stale += len(group.rollouts)
                for rollout in group.rollouts:
                    self._log(rollout, rollout_log.DROPPED)
                del self._ready_at[id(group)]
            else:
                fresh.append(group)
        ready[:] = fresh
        need = self.scheduler.groups_per_batch - len(self._streamed)
        if len(ready) < need:
            if ready and self.config.trainer.streams_groups:
                self._write_part(step)
            return False
        groups, ready[:] = ready[:need], ready[need:]
        batch = self._pack(groups)
        if self._parts:
            streamed_rows = sum(part.input_ids.shape[0] for part in self._parts)
            batch = concat([*self._parts, batch])
            batch.streamed_rows = streamed_rows
            groups = self._streamed + groups
            self._streamed, self._parts = [], []
        rollouts = [r for g in groups for r in g.rollouts]
        self.plugins.call("i3_on_batch", batch=batch, step=step)
        if self.before_cut is not None:
            self.before_cut()
        self.ledger.trained += len(rollouts)
        self._batch_metrics[step] = _batch_metrics(rollouts, trained_version=step - 1)
        # Saved before the batch: when the trainer checkpoints this step, the state it copies exists.
        state = self._state(step, [self._ready_at.pop(id(g))[0] for g in groups], self._batch_metrics[step])
        state.save(self.paths.orchestrator_state(step))
        atomic_torch_save(batch, self.paths.batch(step))
        if self.doorbell is not None:
            self.doorbell.ring_trainer()
        for rollout in rollouts:  # after the batch: the trainer is on it meanwhile
            self._log(rollout, rollout_log.TRAINED)
        self._samples[step] = self.rollout_log.write(step)
        return True

    def _pack(self, groups: list[Group]) -> TrainBatch:
        for group in groups:
            assign_advantages(group.rollouts)
        samples = [sample_from_rollout(r) for g in groups for r in g.rollouts]
        return pack(samples, self.config.trainer.seq_len, self.share_prompts)

    def _write_part(self, step: int) -> None:
        """Hand every finished group to the trainer as the next part of the batch of ``step``: it trains them
        while the rest of the batch generates. They count in the batch (ledger, log, metrics) when it is cut."""
        part = self._pack(self._ready)
        if self.before_cut is not None:
            self.before_cut()
        atomic_torch_save(part, self.paths.batch_part(step, len(self._parts)))
        if self.doorbell is not None:
            self.doorbell.ring_trainer()
        self._streamed += self._ready
        self._ready.clear()
        self._parts.append(part)

    def _state(self, step: int, batch_positions: list[int], batch_metrics: dict | None = None) -> OrchestratorState:
        """What a run resumed from the checkpoint of ``step`` continues with: groups not in a batch yet are
        drawn again, so their rollouts leave the ledger (``started`` counts only accounted ones)."""
        ready = [position for position, _ in self._ready_at.values()]
        redraw = sorted([g.position for g in self._open] + ready + list(self._to_redraw))
        accounted = self.ledger.started - self._in_flight()
        ledger = {**asdict(self.ledger), "started": accounted, "masked_reasons": dict(self.ledger.masked_reasons)}
        return OrchestratorState(step=step, next_position=self._next_position, redraw=redraw, ledger=ledger,
                                 batch_positions=batch_positions, batch_metrics=batch_metrics or {})

    # -- trainer watch -----------------------------------------------------------

    async def _watch_trainer(self) -> None:
        step = self.step  # 1, or the first step after the checkpoint a resumed run continues from
        while step <= self.max_steps:
            while self.step <= step:  # no step ends before its batch is cut: no polling while it generates
                self._cut.clear()
                await self._cut.wait()
            await self._until_trainer(lambda: self.weight_sync.is_ready(self.paths.broadcasts, step))
            served = step - self.scheduler.weight_update_lag
            if served > self.served_version:  # at once: the trainer writes its metrics meanwhile
                await self._update_servers(served)
            metrics_path = self.paths.trainer_metrics(step)  # built once a step, polled
            await self._until_trainer(metrics_path.exists)
            trainer_metrics = json.loads(metrics_path.read_text())
            if self.config.trainer.streams_groups:
                self._remove_parts(step)
            in_flight = self._in_flight()
            if unaccounted := self.ledger.unaccounted(in_flight):
                log.error("rollout ledger does not add up", step=step, unaccounted=unaccounted)
            metrics = {**self._batch_metrics.pop(step, {}), **trainer_metrics, **self.ledger.metrics(in_flight)}
            metrics["weights/version"] = step
            metrics["weights/served_version"] = self.served_version
            metrics["servers/live"] = len(self._live())
            metrics["time/elapsed_s"] = time.perf_counter() - self._started
            if self.sandboxes is not None:
                metrics.update({f"sandboxes/{k}": n for k, n in sorted(self.sandboxes.stats.items())})
            env_metrics = getattr(self.env, "metrics", None)
            if env_metrics is not None:
                metrics.update(env_metrics())
            end_step(self.plugins, self.sinks, step, metrics, self._samples.pop(step, []))
            if self.progress is not None:
                self.progress(step, metrics)
            step += 1

    async def _until_trainer(self, done) -> None:
        """Until ``done()`` (what the trainer writes): looked at every :data:`TRAINER_POLL_S` (while no rollout
        runs :data:`TRAINER_POLL_IDLE_S`), or, beside a colocated trainer, whenever it rings."""
        bell = self.doorbell
        while True:
            if bell is not None:
                bell.orchestrator_clear()  # before the look: a ring from here on ends the wait below
            if done():
                return
            if bell is not None:
                await bell.orchestrator_wait()
            else:
                await asyncio.sleep(TRAINER_POLL_S if self._running else TRAINER_POLL_IDLE_S)

    def _remove_parts(self, step: int) -> None:
        """The parts of the batch of ``step`` (trained, and held whole in that batch)."""
        for part in itertools.count():
            path = self.paths.batch_part(step, part)
            if not path.exists():
                return
            path.unlink()

    def _weights_path(self, version: int) -> str | None:
        """Where a server loads ``version`` from; None when the weight sync delivers it (broadcast)."""
        location = self.weight_sync.location(self.paths.broadcasts, version)
        return None if location is None else str(location)

    async def _update_servers(self, version: int) -> None:
        live = self._live()
        path = self._weights_path(version)
        results = await asyncio.gather(*(c.client.update_weights(path, version) for c in live),
                                       return_exceptions=True)
        for slot, result in zip(live, results):
            if isinstance(result, BaseException):
                self._mark_down(slot, result)
        self.served_version = version
        self._wake.set()
        self.plugins.call("i3_on_weights_updated", version=version)

    # -- main loop -----------------------------------------------------------------

    async def run(self) -> None:
        """Run to ``max_steps``; the sandbox pool, when there is one, lives exactly as long as this call."""
        if self.sandbox_backend is not None:
            self.sandboxes = SandboxPool.for_backend(self.sandbox_backend)
            try:
                await self.sandboxes.start()
            except BaseException:
                await self.sandboxes.close()
                raise
            bind = getattr(self.env, "bind_sandboxes", None)
            if bind is not None:
                bind(self.sandboxes)
        if self.doorbell is not None:
            self.doorbell.bind()
        watcher = asyncio.create_task(self._watch_trainer())
        watcher.add_done_callback(lambda _: self._wake.set())
        try:
            while self.step <= self.max_steps:
                if watcher.done():
                    watcher.result()  # re-raise a failure of the watcher
                self._collect()
                while self.step <= self.max_steps and self.scheduler.may_cut(self.step, self.served_version):
                    if not self._cut_batch(self.step):
                        break
                    self.step += 1
                    self._cut.set()
                self._fill()
                self._check_servers()
                self._wake.clear()
                await wait_event(self._wake, 0.5)
            await watcher
        finally:
            watcher.cancel()
            tasks = [*self._running, *self._scoring, *(c.probe for c in self.clients if c.probe is not None)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(watcher, *tasks, return_exceptions=True)
            if self.sandboxes is not None:
                await self.sandboxes.close()

    def _check_servers(self) -> None:
        for slot in self.clients:
            if slot.probe is not None and slot.probe.done() and not slot.probe.cancelled():
                slot.probe.result()  # a probe that died of something else than a server error: raise it
        if self._live():
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
            log.warning("every inference server is down; waiting for one to come back")
        elif now - self._all_down_since > self.all_down_timeout_s:
            raise I3Error(f"every inference server has been down for {self.all_down_timeout_s:.0f}s")


def _untrainable(rollout: Rollout) -> str | None:
    """Why ``rollout`` must not be trained on (a NaN/inf reward or model-token logprob, a reward beyond
    :data:`REWARD_LIMIT`, no model token), or None."""
    if not rollout.model_versions:
        return NO_MODEL_TOKENS
    if not all(math.isfinite(r) and abs(r) <= REWARD_LIMIT for r in [rollout.reward, *rollout.turn_rewards]):
        return NONFINITE_REWARD
    if any(m and not math.isfinite(lp) for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask)):
        return NONFINITE_LOGPROB
    return None


def _batch_metrics(rollouts: list[Rollout], trained_version: int) -> dict[str, float]:
    """Reward, staleness (per rollout: its oldest token), a histogram of trained tokens' off-policy steps,
    the mean of every rollout metric, and per task (env group member) its reward, share and metrics."""
    rewards = [r.reward for r in rollouts]
    staleness = [trained_version - r.oldest_version for r in rollouts]
    tokens = Counter(trained_version - v for r in rollouts for v in r.model_versions)
    tasks: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        if rollout.example.task:
            tasks.setdefault(rollout.example.task, []).append(rollout)
    per_task = {}
    for task, members in sorted(tasks.items()):
        per_task[f"env/{task}/reward/mean"] = sum(r.reward for r in members) / len(members)
        per_task[f"env/{task}/share"] = len(members) / len(rollouts)
        per_task.update({f"env/{task}/{k}": v for k, v in _metric_means(members).items()})
    return {
        **_metric_means(rollouts),
        **per_task,
        "reward/mean": sum(rewards) / len(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "off_policy/mean_steps": sum(staleness) / len(staleness),
        "off_policy/max_steps": max(staleness),
        **{f"off_policy/tokens_at_{k}": n for k, n in sorted(tokens.items())},
        "completion/mean_tokens": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
    }


def _metric_means(rollouts: list[Rollout]) -> dict[str, float]:
    """``metrics/<name>``: the mean of each rollout metric over the rollouts that report it."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for key, value in rollout.metrics.items():
            values.setdefault(key, []).append(float(value))
    return {f"metrics/{key}": sum(v) / len(v) for key, v in sorted(values.items())}


async def _contained(work):
    """``await work`` (an env's rollout or group scoring) with a ``sys.exit()`` in it (a plugin's score, a tool)
    its failure: asyncio lets SystemExit out of the loop, and the run ended with the plugin's exit code and no
    line."""
    try:
        return await work
    except SystemExit as exc:
        raise RuntimeError(f"the env called sys.exit({exc.code!r})") from None


def _real(value: Any) -> float | None:
    """``value`` as a Python float if it is one real number (Python, numpy, a 0-d tensor), else None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else None
