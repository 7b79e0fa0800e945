"""Atomic file writes (write a temporary sibling, then rename it over the target) and full-disk errors."""

import errno
import io
import os
from pathlib import Path

import torch

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def torch_bytes(obj) -> memoryview:
    """``torch.save(obj)`` in memory: written with Python's file I/O, a full disk is an ``OSError`` (ENOSPC),
    not the opaque RuntimeError of torch's own writer."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def write_torch(obj, path: Path) -> None:
    """``torch.save(obj, path)`` streamed to the file, failing with the ``OSError`` of a write that failed (ENOSPC
    on a full disk), not the opaque RuntimeError torch's writer raises around it. Nothing is held in memory
    beside ``obj``: a checkpoint serialised in memory first (:func:`torch_bytes`) would double the host memory
    of a big model's state at every checkpoint."""
    with open(path, "wb") as file:
        try:
            torch.save(obj, file)
        except RuntimeError as exc:
            failed = exc.__cause__ or exc.__context__
            if isinstance(failed, OSError):
                raise failed from None
            raise


def atomic_torch_save(obj, path: Path) -> None:
    atomic_write_bytes(path, torch_bytes(obj))


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says a disk or quota is full: an ``OSError`` with ENOSPC or
    EDQUOT, or a writer's error that carries that message (safetensors' Rust writer, torch's)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in _DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
