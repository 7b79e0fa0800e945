"""``i3core run``: build every configured component, start the three roles, drive the lifecycle, close.

On one machine (the embedded default): the trainer is a subprocess (one rank alone, several under torchrun;
a thread of this process with ``[trainer] colocate``: :class:`TrainerThread`), the rollout source starts the
inference servers, and the orchestrator runs here. Without ``[model]``, ``[inference]`` and ``[env]`` there is
nothing to train: the run builds what is configured, fires the lifecycle hooks and says what is missing.
"""

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from i3core.loop import resume as resume_path
from i3core.loop.checkpoint import OrchestratorState
from i3core.config import TRAINING_SECTIONS, RunConfig, with_defaults
from i3core.errors import HookFailed, I3Error
from i3core.manager import Plugins
from i3core.lifetime import mark_run
from i3core.loop.checkpoint import full_disk_message
from i3core.loop.doorbell import Doorbell
from i3core.loop.paths import RunPaths
from i3core.text import end_ids

log = structlog.get_logger("i3core.run")

RECORD_SINK = "jsonl"
"""The metric sink every training run writes (metrics.jsonl: what plots, tests and resume read); ``[metrics]``
names it or one more sink."""
TRAINER_START_TIMEOUT_S = 900.0
"""The trainer publishes version 0 after its SFT warm start; that must happen within this bound."""
TRAINER_EXIT_TIMEOUT_S = 120.0
TRAINER_POLL_S = 0.2
TRAINER_MODULE = "i3core.loop.trainer"
"""What every trainer rank runs (under torchrun, or alone for one rank: :func:`trainer_launcher`)."""
LAUNCHER_GRACE_S = 30.0
"""How long torchrun may outlive all of its trainer ranks before the run stops it (it exits at once normally)."""
FULL_DISK_BYTES = 1 << 20
"""Free space under which a trainer that left no error line is taken to have failed on the full disk."""


@dataclass
class Run:
    """A run's built components and where it writes."""

    config: RunConfig
    plugins: Plugins
    output_dir: Path
    components: dict[str, Any] = field(default_factory=dict)
    sinks: list = field(default_factory=list)
    """Open metric sinks: the ``[metrics]`` component, after the ``jsonl`` record when that is another sink."""

    def close(self) -> None:
        components = list(self.components.values())
        for obj in [*reversed(components), *(s for s in self.sinks if all(s is not c for c in components))]:
            closer = getattr(obj, "close", None)
            if callable(closer):
                try:
                    closer()
                except Exception as exc:  # the next ones still close; the run's own error, if any, is the one shown
                    log.warning("close failed", component=type(obj).__name__, error=f"{type(exc).__name__}: {exc}")


def build(config: RunConfig, plugins: Plugins) -> Run:
    """Build every configured component (``cls(config)``) and write the resolved config."""
    output_dir = config.run.out
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.resolved.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    run = Run(config, plugins, output_dir)
    for section, spec in config.components.items():
        run.components[section] = spec.build()
        log.debug("built component", section=section, kind=spec.kind, name=spec.name)
    sink = run.components.get("metrics")
    if sink is not None:
        if config.get("metrics").name != RECORD_SINK:
            record = plugins.registry.get("metric_sink", RECORD_SINK)
            run.sinks.append(record.build(record.config_model()))
        run.sinks.append(sink)
    for sink in run.sinks:
        sink.open(output_dir)
    return run


def execute(config: RunConfig, plugins: Plugins, resume: bool = False) -> int:
    """Run to the end; the lifecycle hooks fire even when the run fails or is interrupted.

    :param resume: continue the run in ``output_dir`` from its newest complete checkpoint (:mod:`i3core.loop.resume`).
    :return: the process exit code.
    """
    config = with_defaults(config, plugins)
    trains = all(config.get(s) is not None for s in TRAINING_SECTIONS)
    if resume and not trains:
        raise I3Error("--resume continues a training run; this config has no " +
                      ", ".join(f"[{s}]" for s in TRAINING_SECTIONS if config.get(s) is None))
    start = None
    if resume:  # decided, checked and rewound before anything opens the run's files
        start = resume_path.orchestrator_state(config.run.out, resume_path.prepare(config, required=True))
    elif trains:
        resume_path.refuse_fresh_start_over(config.run.out)
    run = build(config, plugins)
    with lifecycle(run):
        missing = [s for s in TRAINING_SECTIONS if s not in config.components]
        built = ", ".join(f"{s}={spec.name}" for s, spec in config.components.items()) or "nothing"
        if missing:
            log.warning(
                "nothing to train",
                missing_sections=missing,
                built=built,
                hint="the training loop needs " + ", ".join(f"[{s}]" for s in TRAINING_SECTIONS),
            )
        else:
            can_train = getattr(run.components["model"], "check_can_train", None)
            if can_train is not None:  # the trainer runs on this machine: a model that cannot says so now
                can_train()
            log.info("starting", built=built, **({} if start is None else {"resumed_from_step": start.step}))
            train(run, start)
    return 0


@contextmanager
def lifecycle(run: Run, before_end: Callable[[], None] | None = None) -> Iterator[None]:
    """``i3_on_run_start``, the block, then however it ends (``completed``, ``failed`` or ``interrupted``):
    ``before_end()``, ``i3_on_run_end`` with that status, the components closed and one log line.

    A plugin that fails in ``i3_on_run_end`` after the block failed is a warning (the run's own error is the one
    shown); after a completed block it is the error, saying that the run completed (:class:`RunEndFailed`)."""
    status = "failed"
    try:
        run.plugins.call("i3_on_run_start", config=run.config, output_dir=run.output_dir)
        yield
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        try:
            if before_end is not None:
                before_end()
            _end(run, status)
        finally:
            run.close()
            log.info("run ended", status=status, output_dir=str(run.output_dir))


class RunEndFailed(HookFailed):
    """Every step of the run is done and saved; then a plugin failed in ``i3_on_run_end`` (exit 1: what the plugin
    does at the end, an upload or a report, did not happen)."""


def _end(run: Run, status: str) -> None:
    """``i3_on_run_end`` with ``status``; see :func:`lifecycle` for a plugin that fails in it."""
    try:
        run.plugins.call("i3_on_run_end", config=run.config, status=status)
    except HookFailed as exc:
        if status != "completed":  # the run's own error (or the interrupt) is on its way up
            log.warning("a plugin failed at the end of the run", error=str(exc))
            return
        raise RunEndFailed(f"the run completed (its checkpoints and metrics are in {run.output_dir}), then {exc}",
                           exc.hook) from exc.__cause__


def train(run: Run, start: OrchestratorState | None = None) -> None:
    """Start the trainer and the inference servers, run the orchestrator, stop everything; from the checkpoint
    whose orchestrator state is ``start`` when resuming."""
    from i3core.loop.orchestrator import ClientSlot, Orchestrator
    from i3core.sandbox.pool import check_env_has_sandboxes

    config = run.config
    env, sandbox = run.components["env"], run.components.get("sandbox")
    check_env_has_sandboxes(env, sandbox, config)  # before the trainer starts
    _check_rollout_length(env, config, run.components["inference"])
    paths = RunPaths(run.output_dir)
    paths.make()
    for stale in [paths.stop(), *paths.trainer.glob("step_*.json"), *paths.batches.glob("step_*.pt"),
                  *paths.parts.glob("step_*.pt")]:
        stale.unlink(missing_ok=True)
    (run.output_dir / "logs").mkdir(exist_ok=True)
    mark_run()  # the trainer and the servers stop by themselves if this process is killed
    trainer_log = open(run.output_dir / "logs" / "trainer.log", "ab")
    trainer_log.write(f"{TRAINER_STARTED} {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    trainer_log.flush()
    version = 0 if start is None else start.step
    trainer_args = [str(run.output_dir / "config.resolved.json"),
                    *([] if start is None else ["--resume", str(start.step)])]
    doorbell = Doorbell() if config.trainer.colocate else None
    if config.trainer.colocate:
        trainer = TrainerThread(trainer_args, trainer_log, doorbell)
    else:
        # a process group of its own: a terminal's Ctrl-C reaches this process alone, which stops the trainer
        # itself (STOP: it checkpoints its last step); torchrun or the trainer taking it too raced the run's
        # own handling (the trainer's exit read as its failure)
        trainer = subprocess.Popen([*trainer_launcher(config.trainer.nproc), "-m", TRAINER_MODULE, *trainer_args],
                                   stdout=trainer_log, stderr=subprocess.STDOUT, process_group=0)
    in_main = threading.current_thread() is threading.main_thread()
    interrupt = Interrupt()
    sigterm = signal.signal(signal.SIGTERM, interrupt) if in_main else None
    source = run.components["inference"]
    rendezvous = None
    try:
        sync = run.components["weight_sync"]  # contradictions with the scheduler and the source: its check_config()
        receiver = sync.receiver(paths.broadcasts) if hasattr(sync, "receiver") else None
        if receiver is not None and hasattr(sync, "host"):  # a transport with a meeting point (a broadcast's)
            rendezvous = sync.host(paths.broadcasts, source.config.servers)
        _wait_for_first_version(trainer, sync, paths, run.output_dir, version)
        model = run.components["model"]
        tokenizer = model.tokenizer()
        stop_ids, stop = stop_token_ids(model, env), stop_strings(env)
        extra = {} if receiver is None else {"receiver": receiver}
        urls = source.start(sync.location(paths.broadcasts, version), run.output_dir / "logs", version=version,
                            model=config.get("model").to_dict(), **extra)
        clients = [ClientSlot(source.client(url, tokenizer, stop_ids, stop), url) for url in urls]
        orchestrator = Orchestrator(config, run.plugins, env, run.components["scheduler"], sync, clients,
                                    run.sinks, progress=_progress(config.run.max_steps, version),
                                    sandbox_backend=sandbox, resume=start, model=model, doorbell=doorbell)
        try:
            asyncio.run(_orchestrate(orchestrator, trainer, clients, interrupt))
        except asyncio.CancelledError:
            if not interrupt.count:
                raise
            raise KeyboardInterrupt from None  # the loop wound down cleanly: now the run is interrupted
    finally:
        paths.request_stop()
        if doorbell is not None:
            doorbell.ring_trainer()  # it looks for STOP at once
        try:
            trainer.wait(timeout=TRAINER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
        source.close()
        if rendezvous is not None:
            rendezvous.close()
        trainer_log.close()
        _plot(run.output_dir)


class TrainerThread:
    """The trainer's one rank in a thread of the run's process (``[trainer] colocate``), with what :func:`train`
    asks of the trainer's process: ``poll``, ``returncode``, ``wait``, ``kill``. It runs
    :func:`i3core.loop.trainer.main` on the same arguments, its lines and error line in ``log`` (a binary file:
    logs/trainer.log, as the process's), and stops as the process does: at STOP (the run's end, an interrupt) after
    checkpointing its last step. A thread cannot be killed: :meth:`kill` stops waiting for it; it is a daemon and
    ends with the process. ``doorbell``: its rings to and from the orchestrator (:mod:`i3core.loop.doorbell`)."""

    def __init__(self, args: list[str], log, doorbell: Doorbell | None = None) -> None:
        self.returncode: int | None = None
        self.killed = False
        self.doorbell = doorbell
        self._log = open(log.fileno(), "w", buffering=1, closefd=False, errors="replace")
        self._thread = threading.Thread(target=self._main, args=(args,), name="i3core-trainer", daemon=True)
        self._thread.start()

    def _main(self, args: list[str]) -> None:
        from i3core.loop.trainer import main

        try:
            code = main(args, output=self._log, doorbell=self.doorbell)
        except BaseException:  # the process's trainer would print it and exit 1: so does this one, into its log
            traceback.print_exc(file=self._log)
            code = 1
        self._log.flush()
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.killed:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise subprocess.TimeoutExpired(TRAINER_MODULE, timeout)
        return self.returncode

    def kill(self) -> None:
        self.killed = True


class Interrupt:
    """SIGTERM to a run: it is interrupted as by Ctrl-C (exit 130), its servers stopped, and the trainer, a thread
    or a process, checkpoints its last step at the STOP that follows. Without it the run's process died at once
    and its servers and trainer process ended only when their watchers saw it gone.

    While the orchestrator's loop runs (``task``), the signal cancels that task, as asyncio.run does on Ctrl-C: the
    loop winds down (rollouts cancelled, clients closed) and :func:`train` then raises KeyboardInterrupt. Raised
    from the handler instead, it landed in whatever task ran and came out as a traceback. Outside the loop, or at
    a second signal, it raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.count = 0

    def __call__(self, signum, frame) -> None:
        self.count += 1
        task = self.task
        if task is None or task.done() or self.count > 1:
            raise KeyboardInterrupt
        task.get_loop().call_soon_threadsafe(task.cancel)


def trainer_launcher(nproc: int) -> list[str]:
    """The command that starts ``nproc`` trainer ranks on this machine, up to the module to run: torchrun for
    several; for one, the interpreter itself (the trainer needs no process group alone, and torchrun's own process
    held a third torch runtime, 150 MB of the quickstart's 1 GB: measured by bench_peers)."""
    if nproc == 1:
        return [sys.executable, "-u"]  # unbuffered, as torchrun starts its ranks
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _check_rollout_length(env, config: RunConfig, source) -> None:
    """Refuse an env whose rollouts can outgrow the servers' ``max_len`` (every request would be refused) or
    ``trainer.seq_len`` (the batch could not be packed)."""
    bound = getattr(env, "max_rollout_tokens", lambda: None)()
    if bound is None:
        return
    name = config.get("env").name
    max_len = getattr(source.config, "max_len", None)
    if max_len is not None and bound > max_len:
        raise I3Error(f"env {name!r} rollouts reach {bound} tokens (max_total_tokens) but [inference] max_len is "
                      f"{max_len}: lower the one or raise the other")
    if bound > config.trainer.seq_len:
        raise I3Error(f"env {name!r} rollouts reach {bound} tokens (max_total_tokens) but trainer.seq_len is "
                      f"{config.trainer.seq_len}: a rollout must fit one packed row")


def stop_token_ids(model, env) -> list[int]:
    """The token ids where the servers stop a completion: the model's end-of-sequence ids only
    (:func:`i3core.text.end_ids`); the env's stop text is matched as text (:func:`stop_strings`)."""
    return end_ids(model)


def stop_strings(env) -> list[str]:
    """The strings where the servers stop a text completion: the env's ``stop_text``, matched on the decoded
    text whatever tokens hold it."""
    stop = getattr(env, "stop_text", None)
    return [stop] if stop else []


def _wait_for_first_version(trainer: subprocess.Popen, sync, paths: RunPaths, out: Path, version: int) -> None:
    """Wait for the trainer's first version (0 after its SFT warm start, or the checkpoint it resumed from)."""
    deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
    while not sync.is_ready(paths.broadcasts, version):
        if trainer.poll() is not None:
            raise trainer_failure(trainer.returncode, out, "before publishing weights")
        if time.monotonic() > deadline:
            raise I3Error(f"the trainer published no weights in {TRAINER_START_TIMEOUT_S:.0f}s")
        time.sleep(0.1)


TRAINER_STARTED = "--- i3core run started the trainer:"
"""The line the run writes in logs/trainer.log before each trainer it starts (the log is kept across attempts)."""


def trainer_failure(returncode: int, out: Path, when: str = "") -> I3Error:
    """The trainer's own one-line error (its last ``error: ...`` line in logs/trainer.log, e.g. a model that
    refuses this machine), or where to look."""
    log_path = out / "logs" / "trainer.log"
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    starts = [i for i, line in enumerate(lines) if line.startswith(TRAINER_STARTED)]
    lines = lines[starts[-1] + 1:] if starts else lines  # this trainer's lines, not an earlier attempt's error
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        return I3Error(errors[-1])
    if shutil.disk_usage(out).free < FULL_DISK_BYTES:  # the trainer's own error line could not be written
        return I3Error(full_disk_message(out, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    return I3Error(f"the trainer exited with {returncode}{' ' + when if when else ''}; see {log_path}")


def _cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _live_children(pid: int) -> set[int]:
    """The children of ``pid`` that have not exited (zombies left out), from /proc; empty where there is none."""
    children = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    alive = set()
    for child in children:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(child)
    return alive


async def watch_trainer(trainer: "subprocess.Popen | TrainerThread", out: Path,
                        grace_s: float = LAUNCHER_GRACE_S) -> None:
    """Until the trainer (torchrun) exits; its failure raised as one line. A launcher that outlives every rank
    it started by ``grace_s`` (a torchrun seen to hang on its way out after a rank was SIGKILLed) is killed, so
    the run fails instead of waiting for it for ever. A trainer thread has no launcher."""
    launched = not isinstance(trainer, TrainerThread)
    seen: set[int] = set()
    ranks: set[int] = set()
    """Children seen so far, and those of them that run the trainer module (torchrun may keep helper children)."""
    ranks_gone_at = None
    while trainer.poll() is None:
        await asyncio.sleep(TRAINER_POLL_S)
        if not launched:
            continue
        live = _live_children(trainer.pid)
        ranks |= {pid for pid in live if TRAINER_MODULE in _cmdline(pid)}
        # gone: every child seen before this poll (a launcher whose ranks are plain processes), or every child
        # that ran the trainer (a launcher that keeps other children); children that appear now are not ranks
        gone = bool(seen) and not live & seen or bool(ranks) and not live & ranks
        seen |= live
        if not gone:
            ranks_gone_at = None
            continue
        ranks_gone_at = ranks_gone_at or time.monotonic()
        if time.monotonic() - ranks_gone_at > grace_s:
            log.warning("the trainer's launcher outlived its ranks; stopping it", pid=trainer.pid, grace_s=grace_s)
            trainer.kill()
            trainer.wait()
    if trainer.returncode != 0:
        raise trainer_failure(trainer.returncode, out)


async def _orchestrate(orchestrator, trainer: subprocess.Popen, clients, interrupt: Interrupt) -> None:
    interrupt.task = asyncio.current_task()
    main = asyncio.create_task(orchestrator.run())
    guard = asyncio.create_task(watch_trainer(trainer, orchestrator.config.run.out))
    try:
        done, _ = await asyncio.wait({main, guard}, return_when=asyncio.FIRST_COMPLETED)
        if guard in done and not main.done():
            guard.result()  # a trainer failure: raise it
            await main
        else:
            main.result()
    finally:
        guard.cancel()
        main.cancel()
        await asyncio.gather(main, guard, return_exceptions=True)
        for slot in clients:
            await slot.client.close()


def _progress(total: int, done: int = 0):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), transient=False,
    )  # fmt: skip
    task = progress.add_task("steps", total=total, completed=done, status="")

    def update(step: int, metrics: dict) -> None:
        if step == done + 1:
            progress.start()
        status = f"reward {metrics.get('reward/mean', float('nan')):.3f}  loss {metrics.get('loss', float('nan')):+.4f}"
        progress.update(task, completed=step, status=status)
        if step == total:
            progress.stop()

    return update


def _plot(out: Path) -> None:
    """The run's plots (:mod:`i3core.loop.plot`); a run that ended before its first step has none."""
    from i3core.loop.plot import plot_run

    try:
        plot_run(out)
    except (I3Error, OSError) as exc:  # OSError: a full disk; the run's own error stays the one shown
        log.warning("no plots", reason=str(exc))
