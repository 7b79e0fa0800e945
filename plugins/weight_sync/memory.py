"""``memory``: each version handed from a colocated trainer to the ``local`` engine in the same process.

With ``[trainer] colocate = true`` and ``[inference] use = "local"`` the trainer
is a thread of the run's process and the engine lives on the orchestrator's
event loop: a version need not go through files. The trainer puts a copy of
its HF tensors in the run's mailbox (one slot: the newest version replaces one
not yet taken) and the engine takes it when the orchestrator tells it to,
checked and swapped in like a broadcast's. Writing and reading safetensors,
pruning old versions and the STABLE marker are the cost this saves (about a
tenth of an on-policy quickstart step: docs/benchmarks.md).

Version 0 (or the step a trainer resumes from) goes to disk like
``filesystem`` (pruned by ``keep`` as there), as under ``broadcast``: the
engine starts from it. Later versions exist only in memory:
checkpoints hold the training state as always, and ``i3core export`` makes a
model of one.
"""

import threading
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem
from i3core.plugins.weight_sync.filesystem import FilesystemSync

TAKE_TIMEOUT_S = 60.0
"""The longest a receiver waits for a version it was told is ready (a version is put before it is ready)."""


class Mailbox:
    """One run's newest version not yet taken, put by the trainer thread and taken by the engine's side."""

    def __init__(self):
        self._ready = threading.Condition()
        self.version = -1
        """The newest version put (-1: none since the trainer started)."""
        self._tensors: dict[str, torch.Tensor] | None = None

    def reset(self) -> None:
        """A trainer starts (again): versions of an earlier one are gone."""
        with self._ready:
            self.version, self._tensors = -1, None

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._ready:
            self.version, self._tensors = version, tensors
            self._ready.notify_all()

    def wait(self) -> int:
        """Block until a version is in the mailbox; that version (it stays there for :meth:`take`)."""
        with self._ready:
            self._ready.wait_for(lambda: self._tensors is not None)
            return self.version

    def take(self, timeout_s: float = TAKE_TIMEOUT_S) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version and its tensors, waiting up to ``timeout_s`` for one; it leaves the mailbox."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._tensors is not None, timeout=timeout_s):
                raise I3Error(f"no weight version arrived in memory in {timeout_s:.0f}s (is the trainer alive?)")
            tensors, self._tensors = self._tensors, None
            return self.version, tensors


_MAILBOXES: dict[str, Mailbox] = {}
_MAILBOXES_LOCK = threading.Lock()


def mailbox(root: Path | str) -> Mailbox:
    """The mailbox of the run whose ``broadcasts/`` is ``root`` (one per run in this process)."""
    key = str(Path(root).resolve())
    with _MAILBOXES_LOCK:
        return _MAILBOXES.setdefault(key, Mailbox())


class MemoryReceiver:
    """The engine's end: a :class:`~i3core.protocols.WeightReceiver` on the run's mailbox."""

    def __init__(self, box: Mailbox):
        self.box = box

    def wait_round(self) -> int:
        """Block until a version is in the mailbox; that version (it stays there for :meth:`receive`)."""
        return self.box.wait()

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version put and its HF tensors (the engine's own copy: it may keep them as its weights)."""
        return self.box.take()


class MemorySync:
    """Hand each version to the engine in the trainer's process, no files after the first."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        keep: int = Field(3, ge=1, description="As filesystem's, for the versions that go to disk (a trainer's first).")

    def __init__(self, config: Config):
        self.config = config
        self._disk = FilesystemSync(FilesystemSync.Config(keep=config.keep))
        self._boxes: dict[Path, Mailbox] = {}

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        """The trainer and the engine must share a process, and each version is live at once."""
        problems = []
        if not run.trainer.colocate:
            problems.append(Problem("weight_sync.use", 'memory needs the trainer in the run\'s process: '
                                    "[trainer] colocate = true"))
        source = run.get("inference")
        if source is not None and source.name != "local":
            problems.append(Problem("weight_sync.use", f'memory needs the engine in the run\'s process: inference '
                                    f'"local", not {source.name!r}'))
        lag = run.option("scheduler", "weight_update_lag", 0)
        if lag:
            problems.append(Problem("scheduler.weight_update_lag", f"{lag} needs weights the orchestrator hands out "
                                    "(weight_sync filesystem): memory delivers each version at once"))
        return problems

    def location(self, root: Path, version: int) -> Path | None:
        """The first version of a trainer is a directory the engine starts from; later ones arrive in memory."""
        return self._disk.location(root, version) if self._disk.is_ready(root, version) else None

    def _box(self, root: Path) -> Mailbox:
        """The run's mailbox, its path resolved once (the orchestrator asks every half millisecond)."""
        box = self._boxes.get(root)
        if box is None:
            box = self._boxes[root] = mailbox(root)
        return box

    def is_ready(self, root: Path, version: int) -> bool:
        return self._box(root).version >= version or self._disk.is_ready(root, version)

    def receiver(self, root: Path) -> dict:
        """What the engine needs to take versions from the run's mailbox."""
        return {"transport": "memory", "root": str(root)}

    @staticmethod
    def connect(spec: dict, rank: int) -> MemoryReceiver:
        """The engine's end of the mailbox named in ``spec`` (only in the trainer's process: else it stays empty)."""
        return MemoryReceiver(mailbox(spec["root"]))

    def publish(self, root: Path, weights) -> None:
        """The first version to disk (the mailbox starts empty); each later one copied into the mailbox."""
        if weights.initial:
            self._box(root).reset()
            self._disk.publish(root, weights)
            return
        tensors = {name: tensor.detach().clone() for name, tensor in weights.hf_tensors()}
        self._box(root).put(weights.version, tensors)  # one rank: colocated (check_config)
