"""Weight versions between the weight sync and the servers: the contract both sides keep.

A version on disk is a Hugging Face directory (``config.json``, safetensors, tokenizer files) under
``broadcasts/step_N/``, complete once its ``STABLE`` marker exists. A server reads one only under a reader's
lease (:func:`reading`): a shared ``flock`` on the marker, which the pruner (:func:`remove_version`) must take
exclusively before it deletes the version (prime-rl once crashed when the trainer deleted a version a server
was still loading). A version that arrives some other way (a broadcast) reaches a server through the receiving
end of its weight sync, :func:`connect_receiver`: plugins of the two kinds meet here, never import each other.
"""

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from i3core.errors import I3Error
from i3core.manager import load_plugins
from i3core.protocols import WeightReceiver

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
    except (FileNotFoundError, NotADirectoryError):  # a file named as the version: no version either
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


def remove_version(path: Path) -> bool:
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


def read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of the HF directory ``path`` (one file or shards), on the CPU.

    :raises ValueError: no safetensors file, or one that cannot be read.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors file under {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file}: {exc}") from None
    return tensors


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""The safetensors format's name of each dtype it holds."""


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file (what ``safetensors.torch.load_file`` reads back): the 8-byte
    header length, the JSON header (padded to 8 bytes), then each tensor's bytes in order, written straight from
    the tensors' memory (``safetensors.torch.save_file`` copies every tensor to a bytes object first; a version of
    the quickstart's model is written in 2.7 ms instead of 3.8). Tensors may share storage (views of one copy); a
    non-contiguous one is copied first, one on another device is brought to the CPU."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    parts, offset = [], 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            parts.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for part in parts:
            file.write(part)


class MaxLenTooLong(I3Error):
    """A server asked to hold more tokens than its model has positions for (as vLLM, refused at start-up)."""

    exit_code = 2


def check_max_len(model_dir: Path, max_len: int, setting: str = "--max-len") -> None:
    """:param setting: what the user gave ``max_len`` as, named in the error: a server's flag, or a run's
        ``inference.max_len``.
    :raises MaxLenTooLong: ``max_len`` above the ``max_position_embeddings`` of ``model_dir``'s
        ``config.json`` (a model without one is not checked)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the model component reports a missing or broken config itself
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(positions, int) and max_len > positions:
        given, fix = (f"{setting} {max_len}", f"give {setting} {positions}") if setting.startswith("--") else (
            f"{setting} = {max_len}", f"set {setting} = {positions}")
        raise MaxLenTooLong(f"{given} exceeds the model's max_position_embeddings ({positions}) in "
                            f"{Path(model_dir) / 'config.json'}: {fix} or less")


def connect_receiver(spec: dict, rank: int, plugins=None) -> WeightReceiver:
    """The receiving end of the weight sync whose ``receiver(root)`` returned ``spec``, as server ``rank`` (1..S).

    The component is found by the name in ``spec["transport"]`` through the plugin manager (``plugins``;
    default: every installed plugin), so a server needs no import of the weight-sync plugin.
    """
    plugins = plugins if plugins is not None else load_plugins()
    name = spec.get("transport")
    component = plugins.registry.get("weight_sync", name) if isinstance(name, str) else None
    if component is None:
        raise I3Error(f"no weight_sync {name!r} to receive weights from (is its plugin installed here?)")
    return component.cls.connect(spec, rank)
