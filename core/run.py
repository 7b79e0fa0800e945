"""``i3core run``: build every configured component, drive the run lifecycle, close.

The training loop itself (trainer, inference servers, orchestrator) needs a
``[model]`` and an ``[inference]`` section; without them the run builds and
checks everything else, fires the lifecycle hooks and says what is missing.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from i3core.config import RunConfig
from i3core.manager import Plugins

log = structlog.get_logger("i3core.run")

TRAINING_SECTIONS = ("model", "inference", "env")
"""Sections the training loop needs; the rest have defaults once it runs."""


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
            log.info("components built", built=built)
        status = "completed"
        return 0
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        plugins.hook.i3_on_run_end(config=config, status=status)
        run.close()
        log.info("run ended", status=status, output_dir=str(run.output_dir))
