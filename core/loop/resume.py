"""Resume: how a stopped run continues, for ``i3core run --resume`` and for every role on a cluster.

A run stops: killed, preempted, requeued by its scheduler, a node lost, a full
disk. What it keeps is its newest complete checkpoint N (:mod:`i3core.loop.checkpoint`:
model, optimizer, schedule, RNG, and the orchestrator's state when it cut batch N).
Continuing is four moves, always in this order:

1. **Decide** (:func:`start_step`): N is the newest complete checkpoint that is not damaged
   (newer, damaged ones get a warning each and are set aside at the rewind). With none,
   ``i3core run --resume`` is an error; a role started with ``--resume`` starts the
   run over (a job requeued before its first checkpoint).
2. **Check** (:func:`check_unchanged`): the config is the one the run started with
   (the sections whose state or data order a checkpoint depends on). ``i3core run
   --resume`` also wants N short of ``run.max_steps``; the roles finish such a run
   (the orchestrator writes the rows it had not written, the trainer stops).
3. **Rewind** (:func:`rewind`): undo what the run did after N, before anything reads
   it: the batches the orchestrator cut for later steps with their saved states and
   rollouts, the trainer's metrics of later steps, weight versions N and later (version N is
   published again), rows of later steps in metrics.jsonl (rows up to N that never
   reached it are rebuilt from the saved step states), STOP and RESTART; damaged checkpoints after N are
   renamed ``step_K.damaged``. Steps after N
   are then trained once more, from the checkpoint: a step the trainer had not
   finished is redone once, and no step is trained twice in the model's history.
4. **Start every role from N**: the trainer loads checkpoint N and publishes its
   weights as version N; the servers serve version N; the orchestrator restores its
   state saved with N (the ledger, the prompt stream: prompts drawn but not trained by
   N are drawn again first, then the stream goes on where it was).

Who does what. ``i3core run --resume`` holds every role: it does 1-3 before it opens
the run's files (:func:`prepare`), then starts the trainer with ``--resume N``. On a
cluster the trainer role does 1-3 (rank 0, before any rank reads a batch), publishes
version N, and then writes the **attempt marker** (``ATTEMPT.json`` in output_dir:
the attempt's id and N, :func:`announce`). Servers and the orchestrator started with
``--resume`` wait for the marker of their attempt (``$I3CORE_ATTEMPT``, which the Slurm
job script sets to ``JOBID.RESTARTS``; without it, the newest marker) and start from
its step (:func:`wait_for_attempt`): they never read what the trainer is about to undo.

Roles that restart alone (Kubernetes restarts one failed pod): a trainer that starts a
new attempt under a running orchestrator rewinds the run beneath it. It marks the
attempt as starting first (the marker without a step, :func:`claim`) and gives an older
orchestrator :data:`CLAIM_GRACE_S` to see it before it rewinds; the orchestrator checks
the marker before it cuts each batch, so it writes none the rewind would miss, and exits
with :data:`RESTART_EXIT` to be restarted with ``--resume`` and follow
(:func:`changed_attempt`). An orchestrator restarted while the trainer went on past
the marker's step cannot continue those steps (their batches' state died with it), so
it asks the trainer for a new attempt (:func:`request_restart`): the trainer
checkpoints its last step and exits with :data:`RESTART_EXIT`, to be restarted with
``--resume``.
"""

import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from i3core.config import RunConfig
from i3core.errors import I3Error
from i3core.files import atomic_write_bytes
from i3core.loop import checkpoint
from i3core.loop.checkpoint import OrchestratorState
from i3core.loop.paths import RunPaths

log = structlog.get_logger("i3core.resume")

ATTEMPT_ENV = "I3CORE_ATTEMPT"
"""The id of this attempt of the run, the same for all its roles (the Slurm job script: ``JOBID.RESTARTS``)."""
RESTART_EXIT = 75
"""A role's exit code meaning "restart me with --resume" (EX_TEMPFAIL): the trainer asked by a restarted
orchestrator, or an orchestrator whose trainer started a new attempt."""
CLAIM_GRACE_S = 2.0
"""Between a new attempt's claim and its rewind: an orchestrator of the attempt before notices it (it checks before
every batch it cuts) and stops cutting."""
ATTEMPT_TIMEOUT_S = 3600.0
"""How long a role waits for its attempt's marker (the trainer may still be queued, loading, or in its SFT)."""
POLL_S = 0.5
RESUME_FIXED = ("model", "trainer", "optimizer", "loss", "env", "scheduler", "weight_sync")
"""Sections a resumed run must keep as the run started with them (their state or the data order depend on them)."""
RESUME_FREE = {"trainer": {"checkpoint_every", "keep_checkpoints", "threads", "micro_batch_threads", "colocate"}}
"""Keys of those sections that may change on resume."""


# -- 1. decide ----------------------------------------------------------------------------------------------


def start_step(out: Path, required: bool) -> int | None:
    """The step the run in ``out`` continues from: its newest complete checkpoint that is not damaged (one warning
    for each newer, damaged one: :func:`rewind` sets those aside); None to start over.

    :param required: a run without a checkpoint is an error (``i3core run --resume``), not a start over.
    :raises I3Error: every checkpoint is damaged (the run is not started over on top of its history).
    """
    root = out / "checkpoints"
    steps = checkpoint.complete_steps(root)
    if not steps and required:
        metrics = out / "metrics.jsonl"
        start = "start over in another run.output_dir, or delete that directory" if metrics.exists() and \
            metrics.stat().st_size else "run without --resume to start"  # a plain run would refuse those steps
        raise I3Error(f"nothing to resume: no complete checkpoint under {root} ({start}; set "
                      "trainer.checkpoint_every to write them)")
    damaged = []
    for step in reversed(steps):
        why = checkpoint.damage(root, step)
        if why is None:
            for newer, reason in damaged:
                log.warning("a damaged checkpoint is skipped", checkpoint=f"step_{newer}", resume_from=f"step_{step}",
                            reason=reason)
            return step
        damaged.append((step, why))
    if damaged:
        raise I3Error(f"no checkpoint to resume from: {damaged[0][1]}"
                      + (f" (and the {len(damaged) - 1} older ones are damaged too)" if len(damaged) > 1 else ""))
    return None


def refuse_fresh_start_over(out: Path) -> None:
    """A run started without ``--resume`` must not append to, or overwrite, an earlier run's steps in ``out``."""
    metrics = out / "metrics.jsonl"
    steps = checkpoint.complete_steps(out / "checkpoints")
    if steps or (metrics.exists() and metrics.stat().st_size):
        held = f"checkpoint step_{steps[-1]}" if steps else "metrics.jsonl"
        raise I3Error(f"{out} holds an earlier run ({held}): continue it with --resume, or set another "
                      "run.output_dir (or delete that directory)")


# -- 2. check -----------------------------------------------------------------------------------------------


def check_unchanged(config: RunConfig) -> None:
    """The sections of :data:`RESUME_FIXED` and ``run.seed`` as the run started (its ``config.resolved.json``);
    ``run.max_steps`` only with a constant learning rate after warm-up (a decay's horizon is ``max_steps``)."""
    saved = config.run.out / "config.resolved.json"
    if not saved.exists():
        return
    before, now = _started_with(saved), config.to_dict()
    changed = [f"run.{k}" for k in ("seed",) if before.get("run", {}).get(k) != now.get("run", {}).get(k)]
    for section in RESUME_FIXED:
        old, new = before.get(section) or {}, now.get(section) or {}
        free = RESUME_FREE.get(section, set())
        changed += [f"{section}.{k}" for k in sorted({*old, *new} - free) if old.get(k) != new.get(k)]
    if changed:
        raise I3Error("--resume continues the run as it was started; changed: " + ", ".join(changed))
    decay = now.get("trainer", {}).get("lr_decay", "constant")
    if decay != "constant" and before.get("run", {}).get("max_steps") != config.run.max_steps:
        raise I3Error(f"run.max_steps cannot change on resume with trainer.lr_decay = {decay!r} (the decay ends at "
                      "max_steps); keep it, or start a new run")


def _started_with(saved: Path) -> dict:
    """The run's config as it started (``config.resolved.json``: a JSON object of sections).

    :raises I3Error: the file is not that; the line says how to go on without the check.
    """
    try:
        before = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # a UnicodeDecodeError is a ValueError
        problem = f"cannot be read ({exc})"
    else:
        sections = ("run", *RESUME_FIXED)
        if isinstance(before, dict) and all(isinstance(before.get(s) or {}, dict) for s in sections):
            return before
        problem = "is not a JSON object of config sections"
    raise I3Error(f"{saved} {problem}: it records the config the run started with, which --resume checks; restore "
                  "it, or delete it to resume without that check")


# -- 3. rewind ----------------------------------------------------------------------------------------------


def rewind(out: Path, step: int) -> None:
    """Undo what the run in ``out`` did after ``step`` (0: everything), so that nothing reads it again.

    A batch is undone only if the orchestrator cut it (its state ``orchestrator/step_K.json`` is saved before the
    batch): batches a trainer was given otherwise are its input, not the run's history. Idempotent, and
    metrics.jsonl is rewritten only when it holds a row to undo (a sink may have it open).
    """
    paths = RunPaths(out)
    cut = {_step_of(p) for p in paths.orchestrator.glob("step_*.json")} if paths.orchestrator.is_dir() else set()
    for batch in paths.batches.glob("step_*.pt") if paths.batches.is_dir() else ():
        if _step_of(batch) in cut and _step_of(batch) > step:
            batch.unlink(missing_ok=True)
    for part in paths.parts.glob("step_*.pt") if paths.parts.is_dir() else ():  # early parts: the orchestrator's
        part.unlink(missing_ok=True)  # alone, and of no use once a step is whole (or cut again)
    for folder in (paths.orchestrator, paths.trainer, paths.rollouts):
        checkpoint.drop_after(folder, step)
    checkpoint.drop_after(paths.broadcasts, step - 1)  # version N too: published again, nothing loads the old copy
    metrics = out / "metrics.jsonl"
    unreadable = checkpoint.truncate_metrics(metrics, step)
    if unreadable:
        log.warning("metrics.jsonl lines that are not rows are dropped", file=str(metrics), lines=unreadable)
    if step:
        _restore_missing_rows(paths, metrics, step)
    checkpoint.clear_staging(paths.checkpoints)
    checkpoint.set_aside_damaged(paths.checkpoints, step)
    for marker in (paths.stop(), paths.restart()):
        marker.unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    return int(path.name.split(".")[0].removeprefix("step_"))


def _restore_missing_rows(paths: RunPaths, metrics: Path, step: int) -> None:
    """Rows of steps up to the checkpoint that never reached metrics.jsonl (the run died, or the disk filled,
    between the trainer's checkpoint and the orchestrator's row) are rebuilt from what both roles saved for
    that step: the batch's metrics and ledger (orchestrator/step_K.json, nothing in flight) and the trainer's
    metrics (trainer/step_K.json). A step with neither file stays missing, with a warning. Only steps after the
    last row are rebuilt (appended, the rows stay in step order); a row missing between two others (a garbage
    line dropped) stays missing, with a warning."""
    from i3core.loop.orchestrator import Ledger

    present = set()
    if metrics.exists():  # truncate_metrics left only rows
        present = {json.loads(line)["step"] for line in metrics.read_text().splitlines()}
    last = max(present, default=0)
    gaps = [k for k in range(1, last) if k not in present]
    if gaps:
        log.warning("metrics rows missing between others stay missing (rebuilt, they would come out of step order)",
                    steps=gaps)
    rows = []
    for missing in range(last + 1, step + 1):
        try:
            state = OrchestratorState.load(paths.orchestrator_state(missing))
            trained = json.loads(paths.trainer_metrics(missing).read_text())
        except (I3Error, OSError, ValueError) as exc:
            log.warning("a metrics row cannot be rebuilt", step=missing, reason=str(exc))
            continue
        ledger = Ledger.resumed(state.ledger).metrics(in_flight=0)
        row = {**state.batch_metrics, **trained, **ledger, "weights/version": missing, "resume/rebuilt_row": 1}
        rows.append({"step": missing, **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                         for k, v in row.items()}})  # as the jsonl sink writes them
    if rows:
        log.warning("metrics rows rebuilt from the saved step states", steps=[r["step"] for r in rows])
        with open(metrics, "a", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)


def prepare(config: RunConfig, required: bool) -> int | None:
    """Moves 1-3 for the process that decides: the step to start from (None: from scratch), checked, the run
    rewound to it."""
    out = config.run.out
    step = start_step(out, required)
    if step is None:
        log.info("no checkpoint: the run starts over", output_dir=str(out))
        rewind(out, 0)
        return None
    check_unchanged(config)
    if required:  # `i3core run`: a run to continue, its orchestrator from the state saved with the checkpoint
        if step >= config.run.max_steps:
            raise I3Error(f"checkpoint step_{step} is already at run.max_steps = {config.run.max_steps}: nothing to "
                          "resume (raise run.max_steps to train on)")
        orchestrator_state(out, step)
    rewind(out, step)
    return step


# -- 4. every role from N -------------------------------------------------------------------------------------


def orchestrator_state(out: Path, step: int | None) -> OrchestratorState | None:
    """What the orchestrator continues with after checkpoint ``step`` (None: it starts the run)."""
    if not step:
        return None
    path = checkpoint.checkpoint_dir(out / "checkpoints", step) / checkpoint.ORCHESTRATOR
    if not path.exists():
        raise I3Error(f"checkpoint step_{step} has no orchestrator state (the trainer ran without an orchestrator): "
                      "it cannot resume a run")
    return OrchestratorState.load(path)


@dataclass
class Attempt:
    """One start of the run's trainer: its id and the version it published first (the step it resumed from;
    None while it is starting: rewinding, loading, in its SFT)."""

    attempt: str
    step: int | None

    @classmethod
    def read(cls, paths: RunPaths) -> "Attempt | None":
        try:
            return cls(**json.loads(paths.attempt().read_text()))
        except (OSError, ValueError, TypeError):
            return None  # none yet, or being replaced


def attempt_id() -> str:
    """This attempt's id: ``$I3CORE_ATTEMPT``, or one made up once per process (a trainer started by hand or by
    Kubernetes)."""
    if not os.environ.get(ATTEMPT_ENV):
        os.environ[ATTEMPT_ENV] = uuid.uuid4().hex[:12]
    return os.environ[ATTEMPT_ENV]


def claim(paths: RunPaths) -> Attempt:
    """The trainer starts an attempt: the marker names it, with no step yet. An orchestrator of an earlier attempt
    stops cutting batches; the rewind comes :data:`CLAIM_GRACE_S` later, if there was one."""
    earlier = Attempt.read(paths)
    attempt = Attempt(attempt_id(), None)
    atomic_write_bytes(paths.attempt(), json.dumps(asdict(attempt)).encode())
    if earlier is not None and earlier.attempt != attempt.attempt:
        time.sleep(CLAIM_GRACE_S)
    return attempt


def announce(paths: RunPaths, step: int) -> Attempt:
    """The trainer has published version ``step`` and reads batches from ``step + 1``: the other roles may start."""
    attempt = Attempt(attempt_id(), step)
    atomic_write_bytes(paths.attempt(), json.dumps(asdict(attempt)).encode())
    log.info("attempt started", attempt=attempt.attempt, step=step)
    return attempt


def wait_for_attempt(paths: RunPaths, after: Attempt | None = None, timeout_s: float = ATTEMPT_TIMEOUT_S) -> Attempt:
    """The trainer's marker for this attempt (``$I3CORE_ATTEMPT``; unset: the newest marker, one other than
    ``after`` if given), once it is there."""
    wanted = None if after is not None else os.environ.get(ATTEMPT_ENV)
    deadline = time.monotonic() + timeout_s
    log.info("waiting for the trainer's attempt", attempt=wanted or "newest", marker=str(paths.attempt()))
    while True:
        attempt = Attempt.read(paths)
        if attempt is not None and attempt.step is not None and (wanted is None or attempt.attempt == wanted) and (
                after is None or attempt.attempt != after.attempt):
            return attempt
        if time.monotonic() > deadline:
            which = f"attempt {wanted}" if wanted else "an attempt"
            raise I3Error(f"the trainer did not start {which} (no {paths.attempt()}) in {timeout_s:.0f}s")
        time.sleep(POLL_S)


def changed_attempt(paths: RunPaths, attempt: Attempt) -> Attempt | None:
    """The trainer's newer attempt, if it started one after ``attempt`` (it rewound the run: follow it)."""
    now = Attempt.read(paths)
    return now if now is not None and now.attempt != attempt.attempt else None


def trained_past(paths: RunPaths, step: int) -> bool:
    """Whether the run went on after ``step`` under the marker (an orchestrator cut a later batch, or the trainer
    trained one): a restarted orchestrator cannot take those steps over."""
    return any(_step_of(p) > step for folder in (paths.orchestrator, paths.trainer) if folder.is_dir()
               for p in folder.glob("step_*.json"))


def request_restart(paths: RunPaths) -> None:
    """Ask the trainer for a new attempt (it checkpoints its last step and exits with :data:`RESTART_EXIT`)."""
    paths.restart().touch()
