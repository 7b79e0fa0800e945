"""Atomic file writes (write a temporary sibling, then rename it over the target) and full-disk errors."""

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded")


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """The temporary sibling to write ``path``'s new content to; renamed over ``path`` once the block ends, deleted
    if a write failed."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with _replacing(path) as tmp:
        tmp.write_bytes(data)


def write_torch(obj, path: Path) -> None:
    """``torch.save(obj, path)`` streamed to the file, failing with the ``OSError`` of a write that failed (ENOSPC
    on a full disk), not the opaque RuntimeError torch's writer raises around it. Nothing is held in memory
    beside ``obj`` (a checkpoint serialised in memory first would double the host memory of a big model's state
    at every checkpoint)."""
    with open(path, "wb") as file:
        try:
            torch.save(obj, file)
        except RuntimeError as exc:
            failed = exc.__cause__ or exc.__context__
            if isinstance(failed, OSError):
                raise failed from None
            raise


def atomic_torch_save(obj, path: Path) -> None:
    with _replacing(path) as tmp:
        write_torch(obj, tmp)


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
