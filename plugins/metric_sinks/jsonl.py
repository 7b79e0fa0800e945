"""``<output_dir>/metrics.jsonl``: one JSON object per trainer step, flushed as it is written."""

import json
import math
import numbers
import os
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field


class JsonlSink:
    """Append one line per step to a JSON-lines file."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        filename: str = Field("metrics.jsonl", description="File name under the run's output directory.")

    def __init__(self, config: Config):
        self.config = config
        self._file: BinaryIO | None = None

    @property
    def path(self) -> Path | None:
        return Path(self._file.name) if self._file else None

    def open(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(output_dir / self.config.filename, "ab", buffering=0)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row whole or not at all: a write that fails (a full disk) is cut back off the file, so every
        line stays one complete JSON object."""
        if self._file is None:
            raise RuntimeError("JsonlSink.write before open")
        row = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        line = (json.dumps(row, sort_keys=False) + "\n").encode()
        end = os.fstat(self._file.fileno()).st_size
        try:
            written = 0
            while written < len(line):
                written += self._file.write(line[written:])
        except OSError:
            os.ftruncate(self._file.fileno(), end)
            raise

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_number(value):
    """A metric as JSON writes it: any real number (numpy, a 0-d tensor, as a plugin's metric may be) as a Python
    number, NaN/inf as null (JSON has neither), so every line stays valid JSON."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, int):  # an int (a count, a bool) stays one
        value = float(value)
        return value if math.isfinite(value) else None
    return value
