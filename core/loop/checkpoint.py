"""Checkpoints of a run and ``--resume``.

``<output_dir>/checkpoints/step_N/`` holds everything needed to continue after step N:

- ``model.pt``: the full (unsharded) model state, written by trainer rank 0; for a model that trains some
  tensors on a frozen base (a LoRA adapter, ``[model.lora]``), those tensors alone and the base's identity
  (its path and a hash, :func:`model_file`): a resume onto another base is refused (:func:`check_base`);
- ``optimizer-rank{r}.pt``: each trainer rank's optimizer state (FSDP2 shards kept as local tensors);
- ``trainer.pt``: the step, the learning-rate schedule's state, the trainer's torch RNG and world size;
- ``orchestrator.json``: what the orchestrator had done when it cut batch N (:class:`OrchestratorState`):
  the step, the rollout ledger and the position in the prompt stream.

The trainer writes it into ``.step_N.tmp/`` and renames it into place, so a
``step_N`` directory is complete by construction; a crash mid-write leaves only
a temporary directory, removed at the next start. Only after the rename are
checkpoints beyond the newest ``keep`` deleted, so the last complete one
survives any failure while writing the next (a full disk included).

A checkpoint damaged after it was written (a file cut short by a copy, a bad disk) is found before a resume
reads it (:func:`damage`): the resume falls back to the newest whole one, which is safe because each
``step_N`` holds the state of every role at the same step; the damaged one is set aside as
``step_N.damaged`` (:func:`set_aside_damaged`), never resumed from nor counted by ``keep``.

How a run continues from a checkpoint (``--resume``, every role) is :mod:`i3core.loop.resume`; this module
holds the files.
"""

import json
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from i3core.errors import I3Error

PREFIX = "step_"
MODEL = "model.pt"
TRAINER = "trainer.pt"
ORCHESTRATOR = "orchestrator.json"
DAMAGED = ".damaged"
"""The suffix a damaged checkpoint is renamed with: kept for a person to look at, no longer a ``step_N``."""
_STEP_NAME = re.compile(r"^\.?step_(\d+)(?:\b|_|\.)")


def optimizer_file(rank: int) -> str:
    return f"optimizer-rank{rank}.pt"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under ``root`` (``checkpoints/``), oldest first."""
    steps = []
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit() and _is_complete(path):
                steps.append(int(path.name[len(PREFIX):]))
    return sorted(steps)


def _is_complete(path: Path) -> bool:
    """What the trainer writes (``orchestrator.json`` is absent when the trainer ran without an orchestrator)."""
    return all((path / name).is_file() for name in (MODEL, TRAINER, optimizer_file(0)))


def latest(root: Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


def clear_staging(root: Path) -> None:
    """Remove checkpoints a crash left half-written (``.step_N.tmp``)."""
    if root.is_dir():
        for path in root.glob(f".{PREFIX}*.tmp"):
            shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep``."""
    for step in complete_steps(root)[:-keep]:
        shutil.rmtree(checkpoint_dir(root, step), ignore_errors=True)


def read_torch(path: Path):
    """``torch.load`` of a checkpoint file.

    :raises I3Error: the file is missing, cut short or damaged; the line names it and why.
    """
    try:
        return torch.load(path, weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: BaseException) -> I3Error:
    reason = str(exc).split(". ")[0] or type(exc).__name__  # torch's zip errors go on with a paragraph of advice
    return I3Error(f"checkpoint file {path} cannot be read ({reason}): it is damaged or cut short")


def damage(root: Path, step: int) -> str | None:
    """Why complete checkpoint ``step`` under ``root`` cannot be resumed from (one line naming the file), or None.

    Reads ``trainer.pt`` (small), the orchestrator state, and only the zip directory at the end of the model and
    optimizer files, not their tensors: a file cut short has none, and the check costs the same on any model.
    """
    directory = checkpoint_dir(root, step)
    try:
        state = read_torch(directory / TRAINER)
        world = state.get("world") if isinstance(state, dict) else None
        if not isinstance(world, int) or world < 1:
            raise I3Error(f"checkpoint file {directory / TRAINER} holds no trainer state: it is damaged")
        for path in (directory / MODEL, *(directory / optimizer_file(rank) for rank in range(world))):
            try:
                zipfile.ZipFile(path).close()
            except (OSError, zipfile.BadZipFile) as exc:
                raise _unreadable(path, exc) from None
        if (directory / ORCHESTRATOR).exists():
            OrchestratorState.load(directory / ORCHESTRATOR)
    except I3Error as exc:
        return str(exc)
    return None


def set_aside_damaged(root: Path, after: int) -> None:
    """Rename each complete checkpoint after step ``after`` that is damaged to ``step_N.damaged``: a run resumed
    from ``after`` trains those steps again, and :func:`prune` must not keep a damaged checkpoint over them."""
    for step in complete_steps(root):
        if step > after and damage(root, step) is not None:
            target = checkpoint_dir(root, step).with_name(f"{PREFIX}{step}{DAMAGED}")
            shutil.rmtree(target, ignore_errors=True)  # an earlier damaged copy of the same step
            os.replace(checkpoint_dir(root, step), target)


def drop_after(directory: Path, step: int) -> None:
    """Delete every ``step_M`` / ``.step_M...`` entry of ``directory`` with M > ``step`` (files or directories)."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = _STEP_NAME.match(path.name)
        if match and int(match.group(1)) > step:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def truncate_metrics(path: Path, step: int) -> list[int]:
    """Keep the rows of ``path`` (metrics.jsonl) up to ``step``; later ones are trained again after a resume.
    The file is rewritten only when a row goes (a sink may hold it open for appending).

    :return: the numbers of the lines dropped because they are not a row (a line cut short by a crash, or
        garbage), for the caller to warn about.
    """
    if not path.exists():
        return []
    if not path.is_file():
        raise I3Error(f"{path} is not a file: a run's metrics.jsonl cannot be kept up to step {step}")
    kept, unreadable = [], []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)  # garbage: not rows
    for number, line in enumerate(lines, 1):
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            unreadable.append(number)
            continue
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept == lines:
        return unreadable
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return unreadable


# -- the model's part ---------------------------------------------------------------------------------------


def trained_names(model: torch.nn.Module) -> set[str] | None:
    """The names of ``model``'s trainable parameters when some are frozen (an adapter on a frozen base), else
    None (every tensor is trained and saved). Read before sharding: the names are the module's own."""
    params = dict(model.named_parameters())
    trained = {name for name, param in params.items() if param.requires_grad}
    return None if len(trained) == len(params) else trained


def saved_state(state: dict[str, torch.Tensor], trained: set[str] | None) -> dict[str, torch.Tensor]:
    """What a checkpoint and a published version hold of the model's ``state``: all of it, or the ``trained``
    tensors alone."""
    return dict(state) if trained is None else {name: t for name, t in state.items() if name in trained}


def base_identity(component) -> dict | None:
    """The frozen base a model component trains on (its optional ``base_identity()``: path and hash), or None."""
    identity = getattr(component, "base_identity", None)
    return identity() if identity is not None else None


def model_file(state: dict[str, torch.Tensor], step: int, base: dict | None) -> dict:
    """The content of ``model.pt``: the saved ``state`` of ``step`` and the identity of the frozen ``base`` it
    was trained on (None: the state is the whole model)."""
    return {"model": state, "step": step, **({"base": base} if base is not None else {})}


def check_base(saved: dict, base: dict | None, step: int) -> None:
    """Refuse to resume ``model.pt`` content ``saved`` onto a base other than the one it was trained on.

    :raises I3Error: one line naming both bases.
    """
    before = saved.get("base")
    if before is None and base is None:
        return
    if before is None or base is None:
        had = "an adapter on a frozen base" if before is not None else "the whole model"
        raise I3Error(f"checkpoint step_{step} holds {had}; the run's [model] now trains "
                      f"{'an adapter' if base is not None else 'the whole model'}: resume with the [model] it was "
                      "written with")
    if before.get("sha256") != base.get("sha256"):
        raise I3Error(f"checkpoint step_{step} is an adapter of the base {before.get('path')} (sha256 "
                      f"{str(before.get('sha256'))[:12]}), not of {base.get('path')} (sha256 "
                      f"{str(base.get('sha256'))[:12]}): resume it on the base it was trained on")


def load_model(root: Path, step: int, model: torch.nn.Module, base: dict | None) -> None:
    """Load ``model.pt`` of checkpoint ``step`` under ``root`` into the (unsharded) ``model``, refusing another
    ``base`` (:func:`check_base`); a checkpoint of trained tensors alone fills those.

    :raises I3Error: no complete checkpoint ``step``, a damaged ``model.pt``, or another base.
    """
    if step not in complete_steps(root):
        raise I3Error(f"no complete checkpoint step_{step} under {root}")
    saved = read_torch(checkpoint_dir(root, step) / MODEL)
    check_base(saved, base, step)
    model.load_state_dict(saved["model"], strict=trained_names(model) is None)


# -- optimizer state -----------------------------------------------------------------------------------


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every FSDP2 (DTensor) state tensor replaced by this rank's shard, and
    which entries those were (``dtensors``: parameter index -> keys). The optimizer's own state is left as is."""
    state = optimizer.state_dict()
    packed, dtensors = {}, {}
    for index, values in state["state"].items():
        values = dict(values)  # state_dict() shares the live per-parameter dicts: never edit them
        for key, value in values.items():
            to_local = getattr(value, "to_local", None)
            if callable(to_local):
                values[key] = to_local().clone()
                dtensors.setdefault(index, []).append(key)
        packed[index] = values
    return {**state, "state": packed, "dtensors": dtensors}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of :func:`local_optimizer_state` on the same sharding: the entries that were DTensors become
    DTensors again, laid out as their parameter; the others (an optimizer's own local state) stay plain."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(state)
    dtensors = state.pop("dtensors", {})
    if dtensors:
        from torch.distributed.tensor import DTensor

        for index, keys in dtensors.items():
            param, values = params[int(index)], state["state"][index]
            for key in keys:
                values[key] = DTensor.from_local(values[key].to(param.device), param.device_mesh, param.placements,
                                                 run_check=False, shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(state)


# -- the orchestrator's part -------------------------------------------------------------------------------


@dataclass
class OrchestratorState:
    """What the orchestrator had done when it cut the batch of ``step``.

    ``next_position`` is the number of prompts drawn from the stream; ``redraw``
    the positions among them not yet accounted for (open or finished groups not
    in a batch): a resumed run draws those again first. The ledger's counters
    exclude the rollouts of those groups, which start again.
    """

    step: int
    next_position: int
    redraw: list[int]
    ledger: dict = field(default_factory=dict)
    batch_positions: list[int] = field(default_factory=list)
    """Stream positions of the prompts in this step's batch."""
    batch_metrics: dict = field(default_factory=dict)
    """The batch's metrics (reward, staleness, ...): a step's metrics row can be rebuilt from them."""

    def save(self, path: Path) -> None:
        from i3core.files import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(asdict(self)).encode())

    @classmethod
    def load(cls, path: Path) -> "OrchestratorState":
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise I3Error(f"cannot read the orchestrator state {path}: {exc}") from None


def full_disk_message(out: Path, exc: BaseException) -> str:
    """One line for a write that failed on a full disk: what failed and the checkpoint to resume from."""
    last = latest(out / "checkpoints")
    kept = (f"the last complete checkpoint is step_{last}: free space, then resume with --resume" if last is not None
            else "no checkpoint was written yet")
    what = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
    return f"the disk under {out} is full ({what}); {kept}"
