"""``[metrics] use = "wandb"``: every step's metrics logged to a Weights & Biases run.

Needs the ``wandb`` package (``pip install 'i3core[wandb]'``). The default
``mode = "offline"`` needs no account and no network: the run is written under
``<output_dir>/wandb/offline-run-*/`` and ``wandb sync`` uploads it later;
``mode = "online"`` streams it (after ``wandb login``). The run's resolved
config (``config.resolved.json``) becomes the W&B run config.
"""

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import Problem
from i3core.plugins.metric_sinks.common import missing_extra


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

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
