"""``filesystem``: each weight version as an HF directory under ``broadcasts/step_N/``, then STABLE.

The trainer writes the directory under a temporary name, renames it into
place, then writes the ``STABLE`` marker the same way; a reader only ever
loads a directory whose marker exists (:func:`reading`). Versions older than
the newest ``keep`` are deleted, except one a server is still reading: a
reader holds a shared ``flock`` on the marker while it reads, and the pruner
deletes a version only after taking that lock exclusively (prime-rl once
crashed when the trainer deleted a version a server was still loading).
"""

import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem
from i3core.files import atomic_write_bytes

log = structlog.get_logger("i3core.weight_sync")

STABLE = "STABLE"
"""Marker file: a version is complete once it exists."""
_VERSION_DIR = re.compile(r"step_(\d+)")


class VersionGone(ValueError):
    """A weight version that is not (or no longer) complete on disk."""


@contextmanager
def reading(path: Path) -> Iterator[Path]:
    """Hold a reader's lease on the version directory ``path`` while the block reads it.

    :raises VersionGone: ``path`` has no STABLE marker (not finished, or pruned).
    """
    marker = Path(path) / STABLE
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        raise VersionGone(f"no {STABLE} marker under {path}: not a complete weight version") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as exc:  # a filesystem without locks: read unprotected rather than not at all
            log.warning("no reader lease on this filesystem: pruning cannot see this read", path=str(path),
                        error=str(exc))
        try:  # the pruner may have moved the directory away between our open and our lock
            same = os.stat(marker).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise VersionGone(f"weight version {path} was pruned while opening it")
        yield Path(path)
    finally:
        os.close(fd)  # releases the lock


def _try_remove(path: Path) -> bool:
    """Delete the version directory ``path`` unless a reader holds it; True when it is gone."""
    marker = path / STABLE
    try:
        fd = os.open(marker, os.O_RDWR)  # NFS emulates flock with fcntl locks: an exclusive one needs write access
    except FileNotFoundError:  # never completed (a crashed publish): nobody can be reading it
        shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:  # no locks here: prune as if nobody read it
            log.warning("no reader leases on this filesystem: pruning unprotected", path=str(path), error=str(exc))
        trash = path.with_name(f".{path.name}.deleting")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)  # under the lock: a reader that opens later finds no marker
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def versions_on_disk(root: Path) -> list[int]:
    """Version numbers with a directory under ``root`` (complete or not), ascending."""
    if not root.is_dir():
        return []
    found = (_VERSION_DIR.fullmatch(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


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
        if target.exists() and not _try_remove(target):
            raise I3Error(f"cannot replace weight version {version}: a server is reading it")
        os.replace(staging, target)
        atomic_write_bytes(target / STABLE, b"")
        self.prune(root, version)
        return target

    def prune(self, root: Path, newest: int) -> list[int]:
        """Delete versions older than the newest ``keep``; return the ones kept back because a server reads them."""
        held = []
        for old in versions_on_disk(root):
            if old <= newest - self.config.keep and not _try_remove(self.location(root, old)):
                held.append(old)
        return held
