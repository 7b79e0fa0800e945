"""The inference and orchestrator roles on their own, for a run spread over machines.

``i3core run`` starts all three roles on one machine. On a cluster each starts
on its own (``deploy/`` has Slurm and Kubernetes templates for this), and they
meet in the run's ``output_dir`` on a filesystem every node mounts:

- trainer: ``torchrun ... -m i3core.loop.trainer plugins.toml`` (:mod:`i3core.loop.trainer`)
  publishes version 0 (after its SFT warm start) and every later version under
  ``broadcasts/``, reads each step's batch from ``batches/``;
- inference (:func:`serve`): waits for version 0, then becomes server ``index``
  of the ``[inference]`` rollout source (the same command ``i3core run`` starts:
  the builtin server, or vLLM with i3core's worker extension);
- orchestrator (:func:`orchestrate`): waits for version 0, drives rollouts on
  the servers it is given (``--servers URL ...``), writes the batches and the
  metrics, and tells the servers to load each new version by its path.

With ``--resume`` (what the Slurm and Kubernetes templates start) each role
continues the run instead (:mod:`i3core.loop.resume`): the trainer from the
newest complete checkpoint, the servers and the orchestrator from the step of
the trainer's attempt marker instead of version 0.

Only the ``filesystem`` weight sync works across machines this way (the
``broadcast`` group is hosted by ``i3core run``). The orchestrator role keeps
the ``[sandbox]`` pool like ``i3core run`` does. The orchestrator cannot see the trainer process:
when the trainer dies, the orchestrator waits; the launcher (Slurm, Kubernetes)
ends the job.
"""

import asyncio
import os
import time
from urllib.parse import urlsplit

import structlog

from i3core.config import RunConfig
from i3core.errors import I3Error, ServerError
from i3core.manager import Plugins
from i3core.loop import resume as resume_path
from i3core.loop.paths import RunPaths

log = structlog.get_logger("i3core.roles")

VERSION_0_TIMEOUT_S = 3600.0
"""How long a role waits for the trainer's version 0 (the trainer may still be queued or in its SFT warm start)."""
POLL_S = 1.0


def starts_servers(inference) -> bool:
    """Whether the ``[inference]`` component (its spec) runs server processes other machines reach (``builtin``,
    ``vllm``), rather than an engine inside the orchestrator's process (``local``)."""
    return hasattr(inference.component.cls, "command")


def _filesystem_sync(config: RunConfig):
    sync = config.get("weight_sync").build()
    if sync.receiver(RunPaths(config.run.out).broadcasts) is not None:
        raise I3Error(f"weight_sync {config.get('weight_sync').name!r} works only under `i3core run`; "
                      'roles on separate machines need [weight_sync] use = "filesystem"')
    return sync


def check_server_url(url: str) -> None:
    """:raises I3Error: ``url`` is not a server's base URL (``http(s)://host:port``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port out of range or not a number raises here
    except ValueError as exc:
        raise I3Error(f"--servers {url!r} is not a server URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise I3Error(f"--servers {url!r} is not a server URL: give http://host:port")


def wait_for_version_0(sync, paths: RunPaths, timeout_s: float = VERSION_0_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not sync.is_ready(paths.broadcasts, 0):
        if time.monotonic() > deadline:
            raise I3Error(f"the trainer published no weights under {paths.broadcasts} in {timeout_s:.0f}s")
        time.sleep(POLL_S)


def serve(config: RunConfig, index: int, port: int, host: str | None, resume: bool = False) -> int:
    """Become inference server ``index`` on ``host:port`` once version 0 exists, or with ``resume`` the version
    the trainer's attempt started from (replaces this process)."""
    spec = config.get("inference")
    if spec is None:
        raise I3Error("the inference role needs an [inference] section")
    if host is not None:
        spec.config = spec.config.model_copy(update={"host": host})
    if not starts_servers(spec):
        raise I3Error(f"inference {spec.name!r} does not start server processes; it has no inference role")
    servers = config.option("inference", "servers", 1)
    if not 0 <= index < servers:  # checked before the wait for the trainer, which may be an hour
        raise I3Error(f"--index {index} is not a server of this run: [inference] servers = {servers} "
                      f"(indices 0 to {servers - 1})")
    source = spec.build()
    sync = _filesystem_sync(config)
    paths = RunPaths(config.run.out)
    version = _first_version(sync, paths, resume)
    probe = getattr(source, "check", None)  # vllm: the interpreter imports vllm and i3core
    if callable(probe):
        probe()
    model = config.get("model")
    model = None if model is None else model.to_dict()
    first = sync.location(paths.broadcasts, version)
    cmd = source.command(index, port, first, version, None, model)
    env = source.environment(index, version, None, first, model) or dict(os.environ)
    log.info("starting inference server", index=index, version=version, command=" ".join(cmd))
    os.execvpe(cmd[0], cmd, env)


def _first_version(sync, paths: RunPaths, resume: bool) -> int:
    """The version a role starts from: 0, or with ``resume`` the step of the trainer's attempt marker."""
    if resume:
        return resume_path.wait_for_attempt(paths).step
    log.info("waiting for version 0", broadcasts=str(paths.broadcasts))
    wait_for_version_0(sync, paths)
    return 0


def orchestrate(config: RunConfig, plugins: Plugins, urls: list[str], resume: bool = False) -> int:
    """Run the orchestrator against ``urls`` until the last step's metrics; then tell the trainer to stop.

    With ``resume``: from the state saved with the checkpoint the trainer's attempt started from, following the
    trainer (:mod:`i3core.loop.resume`): exits with ``RESTART_EXIT`` when the trainer starts a new attempt, and
    asks for one when the trainer went on past its attempt's step without this orchestrator."""
    from i3core.loop.orchestrator import ClientSlot, Orchestrator
    from i3core.loop.run import _plot, build, lifecycle, stop_strings, stop_token_ids

    missing = [s for s in ("model", "inference", "env") if config.get(s) is None]
    if missing:
        raise I3Error("the orchestrator role needs " + ", ".join(f"[{s}]" for s in missing))
    for url in urls:  # before the wait for the trainer, which may be an hour
        check_server_url(url)
    sync = _filesystem_sync(config)
    spec = config.get("inference")
    if not starts_servers(spec):
        raise I3Error(f"inference {spec.name!r} runs no servers for the orchestrator role to drive; roles on "
                      'separate machines need [inference] use = "builtin" or "vllm"')
    paths = RunPaths(config.run.out)
    attempt, start = None, None
    if resume:  # before build(): the run's files are the trainer's to rewind until its marker is there
        attempt = resume_path.wait_for_attempt(paths)
        if resume_path.trained_past(paths, attempt.step):
            log.warning("the trainer went on without this orchestrator: asking it for a new attempt",
                        attempt=attempt.attempt, step=attempt.step)
            resume_path.request_restart(paths)
            attempt = resume_path.wait_for_attempt(paths, after=attempt)
        start = resume_path.orchestrator_state(config.run.out, attempt.step)
    run = build(config, plugins)
    paths.make()

    def finish() -> None:  # as `i3core run` does before its lifecycle ends: the trainer told to stop, the plots
        if attempt is None or resume_path.changed_attempt(paths, attempt) is None:  # not a trainer to follow
            paths.request_stop()
        _plot(run.output_dir)

    with lifecycle(run, before_end=finish):
        sync, source = run.components["weight_sync"], run.components["inference"]
        if not resume:
            _first_version(sync, paths, resume=False)
        model, env = run.components["model"], run.components["env"]
        tokenizer = model.tokenizer()
        stop_ids, stop = stop_token_ids(model, env), stop_strings(env)
        clients = [ClientSlot(source.client(url, tokenizer, stop_ids, stop), url) for url in urls]
        orchestrator = Orchestrator(config, plugins, env, run.components["scheduler"], sync, clients, run.sinks,
                                    sandbox_backend=run.components.get("sandbox"), model=model, resume=start,
                                    before_cut=None if attempt is None else lambda: _still(paths, attempt))

        async def drive():
            try:
                if attempt is None:
                    await orchestrator.run()
                    return
                await _serve_version(clients, orchestrator, attempt.step)
                await _following(orchestrator.run(), paths, attempt)
            finally:
                for slot in clients:
                    await slot.client.close()

        asyncio.run(drive())
    return 0


class TrainerRestarted(I3Error):
    """The trainer started a new attempt under this orchestrator: restart it with --resume to follow."""

    exit_code = resume_path.RESTART_EXIT


def _still(paths: RunPaths, attempt) -> None:
    """:raises TrainerRestarted: the trainer started another attempt than ``attempt``."""
    newer = resume_path.changed_attempt(paths, attempt)
    if newer is not None:
        raise TrainerRestarted(f"the trainer started attempt {newer.attempt}: restart the orchestrator with "
                               f"--resume to follow it (exit {resume_path.RESTART_EXIT})")


async def _following(main, paths: RunPaths, attempt) -> None:
    """Run ``main`` (the orchestrator) while the trainer's attempt stays ``attempt``."""
    task = asyncio.ensure_future(main)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=resume_path.POLL_S)
            if not task.done():
                _still(paths, attempt)
        task.result()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _serve_version(clients, orchestrator, version: int) -> None:
    """Servers that outlived an earlier attempt may serve a newer version, since undone: bring them to
    ``version``. A server that does not answer is left to the orchestrator's pool (marked down, re-probed)."""
    path = orchestrator._weights_path(version)
    for slot in clients:
        try:
            if (await slot.client.health()).get("version") != version:
                await slot.client.update_weights(path, version)
        except ServerError as exc:  # not up yet: a server started now loads the version itself
            log.info("a server does not answer yet", url=slot.url, error=str(exc))
