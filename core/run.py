"""``i3core run``: build every configured component, start the three roles, drive the lifecycle, close.

On one machine (the embedded default): the trainer is a torchrun subprocess,
the rollout source starts the inference servers, and the orchestrator runs
here. Without ``[model]``, ``[inference]`` and ``[env]`` there is nothing to
train: the run builds what is configured, fires the lifecycle hooks and says
what is missing.
"""

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from i3core.config import RunConfig, validate
from i3core.errors import I3Error
from i3core.manager import Plugins
from i3core.trainer import RunPaths

log = structlog.get_logger("i3core.run")

TRAINING_SECTIONS = ("model", "inference", "env")
"""Sections the training loop needs; the others have defaults."""
DEFAULT_SECTIONS = {
    "loss": "icepop",
    "optimizer": "adamw",
    "scheduler": "async",
    "weight_sync": "filesystem",
    "metrics": "jsonl",
}
"""Components a training run uses when their section is absent."""
TRAINER_START_TIMEOUT_S = 900.0
"""The trainer publishes version 0 after its SFT warm start; that must happen within this bound."""
TRAINER_EXIT_TIMEOUT_S = 120.0


@dataclass
class Run:
    """A run's built components and where it writes."""

    config: RunConfig
    plugins: Plugins
    output_dir: Path
    components: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        for obj in reversed(list(self.components.values())):
            closer = getattr(obj, "close", None)
            if callable(closer):
                closer()


def with_defaults(config: RunConfig, plugins: Plugins) -> RunConfig:
    """Fill absent sections of a training run with :data:`DEFAULT_SECTIONS`."""
    if any(config.get(s) is None for s in TRAINING_SECTIONS):
        return config
    data = config.to_dict()
    for section, name in DEFAULT_SECTIONS.items():
        data.setdefault(section, {"use": name})
    resolved = validate(data, plugins)
    resolved.source = config.source
    return resolved


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
        sink.open(output_dir)
    return run


def execute(config: RunConfig, plugins: Plugins) -> int:
    """Run to the end; the lifecycle hooks fire even when the run fails or is interrupted.

    :return: the process exit code.
    """
    config = with_defaults(config, plugins)
    run = build(config, plugins)
    status = "failed"
    try:
        plugins.hook.i3_on_run_start(config=config, output_dir=run.output_dir)
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
            log.info("starting", built=built)
            train(run)
        status = "completed"
        return 0
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        plugins.hook.i3_on_run_end(config=config, status=status)
        run.close()
        log.info("run ended", status=status, output_dir=str(run.output_dir))


def train(run: Run) -> None:
    """Start the trainer and the inference servers, run the orchestrator, stop everything."""
    from i3core.orchestrator import ClientSlot, Orchestrator

    config = run.config
    env, sandbox = run.components["env"], run.components.get("sandbox")
    if getattr(env, "requires_sandbox", False) and sandbox is None:
        raise I3Error(f"env {config.get('env').name!r} runs code: add a [sandbox] section "
                      '(use = "local", "docker" or "k8s")')
    _check_rollout_length(env, config, run.components["inference"])
    paths = RunPaths(run.output_dir)
    paths.make()
    for stale in [paths.stop(), *paths.trainer.glob("step_*.json"), *paths.batches.glob("step_*.pt")]:
        stale.unlink(missing_ok=True)
    (run.output_dir / "logs").mkdir(exist_ok=True)
    trainer_log = open(run.output_dir / "logs" / "trainer.log", "ab")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(config.trainer.nproc),
         "-m", "i3core.trainer", str(run.output_dir / "config.resolved.json")],
        stdout=trainer_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    source = run.components["inference"]
    rendezvous = None
    try:
        sync = run.components["weight_sync"]
        lag = run.components["scheduler"].weight_update_lag
        keep = getattr(sync.config, "keep", None)
        if keep is not None and keep <= lag:
            raise I3Error(f"weight_sync.keep ({keep}) must exceed scheduler.weight_update_lag ({lag}): "
                          "the servers load versions that old")
        receiver = sync.receiver(paths.broadcasts) if hasattr(sync, "receiver") else None
        if receiver is not None:
            if lag:
                raise I3Error(f"scheduler.weight_update_lag ({lag}) needs weights the orchestrator hands out "
                              f"(weight_sync filesystem): {config.get('weight_sync').name} delivers each version at once")
            servers = getattr(source.config, "servers", None)
            if servers is None:
                raise I3Error(f"weight_sync {config.get('weight_sync').name} needs a rollout source that starts "
                              "its servers (a `servers` count)")
            rendezvous = sync.host(paths.broadcasts, servers)
        _wait_for_version_0(trainer, sync, paths, run.output_dir)
        model = run.components["model"]
        tokenizer = model.tokenizer()
        stop_ids = tokenizer.encode(env.stop_text).ids + [model.eos_token_id]
        extra = {} if receiver is None else {"receiver": receiver}
        urls = source.start(sync.location(paths.broadcasts, 0), run.output_dir / "logs", **extra)
        clients = [ClientSlot(source.client(url, tokenizer, stop_ids), url) for url in urls]
        orchestrator = Orchestrator(config, run.plugins, env, run.components["scheduler"], sync, clients,
                                    [run.components["metrics"]], progress=_progress(config.run.max_steps))
        asyncio.run(_orchestrate(orchestrator, trainer, clients, sandbox))
    finally:
        paths.stop().write_text("")
        try:
            trainer.wait(timeout=TRAINER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
        source.close()
        if rendezvous is not None:
            rendezvous.close()
        trainer_log.close()
        _plot(run.output_dir)


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


def _wait_for_version_0(trainer: subprocess.Popen, sync, paths: RunPaths, out: Path) -> None:
    deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
    while not sync.is_ready(paths.broadcasts, 0):
        if trainer.poll() is not None:
            raise I3Error(f"the trainer exited with {trainer.returncode} before publishing weights; see {out}/logs/trainer.log")
        if time.monotonic() > deadline:
            raise I3Error(f"the trainer published no weights in {TRAINER_START_TIMEOUT_S:.0f}s")
        time.sleep(0.1)


async def _orchestrate(orchestrator, trainer: subprocess.Popen, clients, sandbox_backend=None) -> None:
    """Run the orchestrator until its last step or the trainer's failure; the sandbox pool lives in this loop."""

    async def watch_trainer():
        while trainer.poll() is None:
            await asyncio.sleep(0.2)
        if trainer.returncode != 0:
            raise I3Error(f"the trainer exited with {trainer.returncode}; see logs/trainer.log")

    tasks = []
    try:
        if sandbox_backend is not None:
            from i3core.sandbox_pool import SandboxPool

            orchestrator.sandboxes = SandboxPool.for_backend(sandbox_backend)
            await orchestrator.sandboxes.start()
            bind = getattr(orchestrator.env, "bind_sandboxes", None)
            if bind is not None:
                bind(orchestrator.sandboxes)
        main = asyncio.create_task(orchestrator.run())
        guard = asyncio.create_task(watch_trainer())
        tasks = [main, guard]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if guard in done and not main.done():
            guard.result()  # a trainer failure: raise it
            await main
        else:
            main.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in clients:
            await slot.client.close()
        if orchestrator.sandboxes is not None:
            await orchestrator.sandboxes.close()


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), transient=False,
    )  # fmt: skip
    task = progress.add_task("steps", total=total, status="")

    def update(step: int, metrics: dict) -> None:
        if step == 1:
            progress.start()
        status = f"reward {metrics.get('reward/mean', float('nan')):.3f}  loss {metrics.get('loss', float('nan')):+.4f}"
        progress.update(task, completed=step, status=status)
        if step == total:
            progress.stop()

    return update


def _plot(out: Path) -> None:
    """``plot.png``: reward and loss per step, from metrics.jsonl; with an env group, each member's
    reward and mixing weight too."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("env/") and k.endswith("/mix_weight")})
    panels = [("reward/mean", ["reward/mean"]), ("loss", ["loss"])]
    if tasks:
        panels += [("reward per env", [f"env/{t}/reward/mean" for t in tasks]),
                   ("mixing weight per env", [f"env/{t}/mix_weight" for t in tasks])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
    steps = [r["step"] for r in rows]
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            ax.plot(steps, [r.get(key) for r in rows], marker=".", label=key.split("/")[1] if len(keys) > 1 else None)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=100)
    plt.close(fig)
