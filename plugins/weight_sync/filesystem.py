"""``filesystem``: each weight version as an HF directory under ``broadcasts/step_N/``, then STABLE.

The trainer writes the directory under a temporary name, renames it into
place, then writes the ``STABLE`` marker the same way; a reader only ever
loads a directory whose marker exists. Versions older than the newest
``keep`` are deleted.
"""

import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from i3core.files import atomic_write_bytes

STABLE = "STABLE"
"""Marker file: a version is complete once it exists."""


class FilesystemSync:
    """Publish weights as safetensors files on a filesystem every role can read."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        keep: int = Field(3, ge=1, description="Newest versions kept on disk.")

    def __init__(self, config: Config):
        self.config = config

    @staticmethod
    def location(root: Path, version: int) -> Path:
        """Where ``version`` lives (what the servers are told to load)."""
        return root / f"step_{version}"

    def is_ready(self, root: Path, version: int) -> bool:
        return (self.location(root, version) / STABLE).exists()

    def publish(self, root: Path, version: int, save) -> Path:
        """Write ``version`` with ``save(directory)``, mark it STABLE, prune old versions."""
        target = self.location(root, version)
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        save(staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        atomic_write_bytes(target / STABLE, b"")
        for old in range(version - self.config.keep, -1, -1):
            path = self.location(root, old)
            if not path.exists():
                break
            shutil.rmtree(path, ignore_errors=True)
        return target
