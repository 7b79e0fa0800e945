"""``filesystem``: each weight version as an HF directory under ``broadcasts/step_N/``, then STABLE.

The trainer writes the directory under a temporary name, renames it into
place, then writes the ``STABLE`` marker the same way; a reader only ever
loads a directory whose marker exists (:func:`i3core.weights.reading`). Versions older than
the newest ``keep`` are deleted, except one a server is still reading: a
reader holds a shared ``flock`` on the marker while it reads, and the pruner
deletes a version only after taking that lock exclusively (prime-rl once
crashed when the trainer deleted a version a server was still loading).
"""

import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem
from i3core.files import atomic_write_bytes
from i3core.weights import STABLE, remove_version, versions_on_disk

class FilesystemSync:
    """Publish weights as safetensors files on a filesystem every role can read."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        keep: int = Field(3, ge=1, description="Newest versions kept on disk (older ones a server is reading wait).")

    def __init__(self, config: Config):
        self.config = config

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        """Servers held ``weight_update_lag`` versions behind load versions that old: they must still be on disk."""
        lag = run.option("scheduler", "weight_update_lag", 0)
        if config.keep <= lag:
            return [Problem("weight_sync.keep", f"{config.keep} must exceed scheduler.weight_update_lag ({lag}): "
                                                "the servers load versions that old")]
        return []

    @staticmethod
    def location(root: Path, version: int) -> Path:
        """Where ``version`` lives (what the servers are told to load)."""
        return root / f"step_{version}"

    def is_ready(self, root: Path, version: int) -> bool:
        return (self.location(root, version) / STABLE).exists()

    def receiver(self, root: Path) -> dict | None:
        """What a server needs to receive weights other than from a path: nothing here."""
        return None

    @staticmethod
    def connect(spec: dict, rank: int):
        """Never called: servers load each version from its directory (:meth:`receiver` is None)."""
        raise I3Error("weight_sync filesystem delivers every version as a directory: there is nothing to connect to")

    def publish(self, root: Path, weights) -> Path | None:
        """Write ``weights`` (a :class:`~i3core.loop.trainer.PublishedWeights`) as its version; every trainer rank calls it."""
        model = weights.gather()
        if model is None:  # not rank 0
            return None
        return self.write(root, weights.version, lambda directory: weights.save_hf(model, directory))

    def write(self, root: Path, version: int, save) -> Path:
        """Write ``version`` with ``save(directory)``, mark it STABLE, prune old versions."""
        target = self.location(root, version)
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        save(staging)
        if target.exists() and not remove_version(target):
            raise I3Error(f"cannot replace weight version {version}: a server is reading it")
        os.replace(staging, target)
        atomic_write_bytes(target / STABLE, b"")
        self.prune(root, version)
        return target

    def prune(self, root: Path, newest: int) -> list[int]:
        """Delete versions older than the newest ``keep``; return the ones kept back because a server reads them."""
        held = []
        for old in versions_on_disk(root):
            if old <= newest - self.config.keep and not remove_version(self.location(root, old)):
                held.append(old)
        return held
