"""``[metrics] use = "tensorboard"``: every step's metrics as TensorBoard scalars under the run directory.

Needs the ``tensorboard`` package (``pip install 'i3core[tensorboard]'``); the
writer is torch's ``SummaryWriter``. Point TensorBoard at the run:
``tensorboard --logdir runs/NAME/tensorboard``.
"""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import Problem
from i3core.plugins.metric_sinks.common import missing_extra


class TensorBoardSink:
    """One scalar per metric and step, written with ``torch.utils.tensorboard.SummaryWriter``."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        logdir: str = Field("tensorboard", description="Event-file folder, relative to the run's output directory.")
        flush_secs: int = Field(10, ge=1, description="Seconds between flushes of the event file.")

    def __init__(self, config: Config):
        self.config = config
        self._writer = None

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        return missing_extra("tensorboard", "tensorboard")

    @property
    def logdir(self) -> Path | None:
        return Path(self._writer.log_dir) if self._writer is not None else None

    def open(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(output_dir / self.config.logdir), flush_secs=self.config.flush_secs)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
