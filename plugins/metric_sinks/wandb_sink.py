"""``[metrics] use = "wandb"``: every step's metrics logged to a Weights & Biases run.

Needs the ``wandb`` package (``pip install 'i3core[wandb]'``). The default
``mode = "offline"`` needs no account and no network: the run is written under
``<output_dir>/wandb/offline-run-*/`` and ``wandb sync`` uploads it later;
``mode = "online"`` streams it (after ``wandb login``). The run's resolved
config (``config.resolved.json``) becomes the W&B run config. Every step also
logs ``rollouts/samples``, a table of its first ``sample_rows`` rollouts (prompt,
completion, reward, advantage, finish reason, outcome, env) from the run's
``rollouts/step_N.jsonl``.
"""

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import Problem
from i3core.plugins.metric_sinks.common import missing_extra

SAMPLE_COLUMNS = ("step", "env", "outcome", "prompt", "completion", "reward", "advantage", "finish_reason")
"""The columns of the per-step sample table (keys of a rollout line, see docs/rollouts.md)."""


class WandbSink:
    """``wandb.init`` at open, ``run.log(metrics, step=step)`` per step, ``run.finish`` at close."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        project: str = Field("i3core", description="W&B project.")
        entity: str | None = Field(None, description="W&B team or user (default: the logged-in user's).")
        name: str | None = Field(None, description="W&B run name (default: [run] name).")
        group: str | None = Field(None, description="W&B run group.")
        mode: Literal["offline", "online", "disabled"] = Field(
            "offline", description="offline: write under the run directory only; online: stream to W&B.")
        sample_rows: int = Field(8, ge=0, description="Rollouts per step in the rollouts/samples table (0: none).")

    def __init__(self, config: Config):
        self.config = config
        self._run = None

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        return missing_extra("wandb", "wandb")

    def open(self, output_dir: Path) -> None:
        import wandb

        resolved = output_dir / "config.resolved.json"
        run_config = json.loads(resolved.read_text()) if resolved.exists() else {}
        name = self.config.name or run_config.get("run", {}).get("name")
        self._run = wandb.init(
            project=self.config.project, entity=self.config.entity, name=name, group=self.config.group,
            mode=self.config.mode, dir=str(output_dir), config=run_config,
            settings=wandb.Settings(silent=True, console="off"),  # the run's console stays the run's
        )  # fmt: skip

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def write_rollouts(self, step: int, lines: list[dict]) -> None:
        """The step's first ``sample_rows`` rollouts as the ``rollouts/samples`` table (texts as strings)."""
        import wandb

        if not self.config.sample_rows:
            return
        rows = [[step if c == "step" else _cell(line.get(c)) for c in SAMPLE_COLUMNS]
                for line in lines[: self.config.sample_rows]]
        self._run.log({"rollouts/samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _cell(value):
    """A table cell: numbers and None as they are, anything else (a chat's messages) as text."""
    return value if value is None or isinstance(value, str | int | float) else json.dumps(value, default=str)
