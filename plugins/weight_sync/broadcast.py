"""``broadcast``: weights streamed from trainer rank 0 to every inference server over one torch.distributed group.

The group holds trainer rank 0 (rank 0 of the group) and one receiver per
inference server (ranks 1..S): gloo on CPU, NCCL on GPU, the same code (one
``backend`` for every member, from the config; NCCL needs a GPU per member). It
is separate from the trainer's own torchrun group, built from a TCPStore that
the run driver hosts (:meth:`BroadcastSync.host`, address in
``broadcasts/rendezvous.json``).

One update ("round"): rank 0 announces the version under ``round/<k>`` in the
store; receivers wait on that key (so no collective sits open between
updates), then every member takes part in the broadcasts. The HF tensors
(experts unstacked on the way, see the model's ``hf_tensors``) travel one
layer at a time: per chunk a header ``int64[2]`` (metadata bytes, data bytes),
the metadata (JSON: name, dtype, shape per tensor) and the data as one flat
byte buffer; a header of ``-1`` ends the round. Rank 0 never holds more than
one layer beyond the model itself; a receiver keeps the chunks until the
whole version is in and checked, so a bad update never touches live weights.

Version 0 (what the servers start from) goes to disk like ``filesystem``.
A server that stops answering stalls a broadcast until ``timeout_s``, then
the trainer fails with that error: collectives have no partial members.
"""

import datetime
import json
import math
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from i3core.errors import I3Error, Problem
from i3core.files import atomic_write_bytes
from i3core.plugins.weight_sync.filesystem import FilesystemSync

RENDEZVOUS = "rendezvous.json"
_PREFIX = "i3core/weights"
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_WAIT_S = 5.0
"""A receiver re-arms its wait for the next round this often (the store wait itself is bounded)."""
_RENDEZVOUS_WAIT_S = 120.0


def _group(backend: str, store, rank: int, world: int, timeout: datetime.timedelta):
    """A process group of its own (not torch's default one): the trainer keeps its torchrun group."""
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def layer_chunks(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive ``(name, tensor)`` pairs by transformer layer; other tensors travel alone."""
    chunk, key = [], None
    for name, tensor in tensors:
        match = _LAYER.search(name)
        this = match.group(1) if match else name
        if chunk and this != key:
            yield chunk
            chunk = []
        chunk.append((name, tensor))
        key = this
    if chunk:
        yield chunk


def _read_rendezvous(path: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise I3Error(f"no weight-broadcast rendezvous at {path} after {timeout_s:.0f}s")
        time.sleep(0.05)
    return json.loads(path.read_text())


class Rendezvous:
    """The TCPStore every member of the broadcast group meets at; the run driver keeps it open."""

    def __init__(self, root: Path, receivers: int, host: str, port: int):
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.path = root / RENDEZVOUS
        info = {"host": host, "port": self.store.port, "world": receivers + 1}
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, json.dumps(info).encode())

    def close(self) -> None:
        """Stop hosting: members still connected lose the store (and with it the group)."""
        self.path.unlink(missing_ok=True)
        self.store = None


class _Member:
    def __init__(self, rendezvous: Path, rank: int, backend: str, timeout_s: float):
        info = _read_rendezvous(Path(rendezvous), _RENDEZVOUS_WAIT_S)
        self.rank, self.world = rank, info["world"]
        if not 0 <= rank < self.world:
            raise I3Error(f"broadcast rank {rank} outside the group of {self.world}")
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(info["host"], info["port"], is_master=False, timeout=self.timeout)
        self.device = torch.device("cpu")
        self.group = None
        self.round = 0

    def _join(self) -> None:
        if self.group is None:  # the device only now: a member that just watches the store never touches CUDA
            self.device = _device(self.backend)
            self.group = _group(self.backend, self.store, self.rank, self.world, self.timeout)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor


class Sender(_Member):
    """Trainer rank 0's end of the group."""

    def __init__(self, rendezvous: Path, backend: str = "gloo", timeout_s: float = 600.0):
        super().__init__(rendezvous, 0, backend, timeout_s)

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream ``tensors`` to every receiver as ``version``; return the bytes sent."""
        self.round += 1
        self.store.set(f"round/{self.round}", str(version))
        self._join()
        sent = 0
        for chunk in layer_chunks(tensors):
            meta = json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in chunk]).encode()
            data = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in chunk]).to(self.device)
            self._broadcast(torch.tensor([len(meta), data.numel()], dtype=torch.int64, device=self.device))
            self._broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device))
            self._broadcast(data)
            sent += data.numel()
            del chunk, data  # before the next layer is gathered: one layer in flight
        self._broadcast(torch.tensor([-1, -1], dtype=torch.int64, device=self.device))
        return sent


class Receiver(_Member):
    """One inference server's end of the group (ranks 1..S)."""

    def __init__(self, rendezvous: Path, rank: int, backend: str = "gloo", timeout_s: float = 600.0):
        if rank < 1:
            raise I3Error(f"a receiver's broadcast rank starts at 1, got {rank}")
        super().__init__(rendezvous, rank, backend, timeout_s)

    @classmethod
    def from_spec(cls, spec: dict, rank: int) -> "Receiver":
        """Built from :meth:`BroadcastSync.receiver` (what the rollout source hands each server)."""
        return cls(Path(spec["rendezvous"]), rank, spec.get("backend", "gloo"), spec.get("timeout_s", 600.0))

    def wait_round(self) -> int:
        """Block until the trainer announces the next update; its version."""
        key = f"round/{self.round + 1}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=_WAIT_S))
                break
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
        self.round += 1
        return int(self.store.get(key))

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The next version and its HF tensors (on the CPU), once all of it is in."""
        version = self.wait_round()
        self._join()
        tensors: dict[str, torch.Tensor] = {}
        while True:
            header = self._broadcast(torch.empty(2, dtype=torch.int64, device=self.device)).tolist()
            if header[0] < 0:
                return version, tensors
            meta = self._broadcast(torch.empty(header[0], dtype=torch.uint8, device=self.device))
            data = self._broadcast(torch.empty(header[1], dtype=torch.uint8, device=self.device)).cpu()
            offset = 0
            for name, dtype, shape in json.loads(bytes(meta.cpu().tolist())):
                dtype = getattr(torch, dtype)
                size = dtype.itemsize * math.prod(shape)
                piece = data[offset : offset + size]
                if offset % dtype.itemsize:  # a view must start on an element boundary
                    piece = piece.clone()
                tensors[name] = piece.view(dtype).reshape(shape)
                offset += size


class BroadcastSync:
    """Stream each version from trainer rank 0 to the servers over a gloo/NCCL group."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        host: str = Field("127.0.0.1", description="Address the rendezvous store listens on.")
        port: int = Field(0, ge=0, le=65535, description="Rendezvous store port (0: a free one).")
        backend: Literal["gloo", "nccl"] = Field(
            "gloo", description="gloo (CPU tensors, any member) or NCCL (every member on a GPU of its own).")
        timeout_s: float = Field(600.0, gt=0, description="Longest one broadcast (or the group's set-up) may take.")

    def __init__(self, config: Config):
        self.config = config
        self._disk = FilesystemSync(FilesystemSync.Config(keep=1))
        self._sender: Sender | None = None

    @staticmethod
    def check_config(config: Config, run) -> list[Problem]:
        """Each version goes to every server at once, to servers the run starts itself."""
        problems = []
        lag = run.option("scheduler", "weight_update_lag", 0)
        if lag:
            problems.append(Problem("scheduler.weight_update_lag", f"{lag} needs weights the orchestrator hands out "
                                    "(weight_sync filesystem): broadcast delivers each version at once"))
        source = run.get("inference")
        if source is not None and getattr(source.config, "servers", None) is None:
            problems.append(Problem("weight_sync.use", f"broadcast needs a rollout source that starts its servers "
                                    f"(a `servers` count); inference {source.name!r} has none"))
        return problems

    def location(self, root: Path, version: int) -> Path | None:
        """The first version of a trainer (0, or the step it resumed from) is a directory the servers start from;
        later versions reach the servers by broadcast (no path)."""
        return self._disk.location(root, version) if self._disk.is_ready(root, version) else None

    @staticmethod
    def _marker(root: Path, version: int) -> Path:
        return root / f"step_{version}.sent"

    def is_ready(self, root: Path, version: int) -> bool:
        return self._disk.is_ready(root, version) or self._marker(root, version).exists()

    @staticmethod
    def connect(spec: dict, rank: int) -> Receiver:
        """Server ``rank``'s end of the group described by ``spec`` (from :meth:`receiver`)."""
        return Receiver.from_spec(spec, rank)

    def receiver(self, root: Path) -> dict:
        """What each server needs to join the group (its rank is its index + 1)."""
        return {"transport": "broadcast", "rendezvous": str(root / RENDEZVOUS), "backend": self.config.backend,
                "timeout_s": self.config.timeout_s}

    def host(self, root: Path, receivers: int) -> Rendezvous:
        """Open the rendezvous store for ``receivers`` servers and the trainer (the run driver calls this)."""
        return Rendezvous(root, receivers, self.config.host, self.config.port)

    def publish(self, root: Path, weights) -> None:
        """Every trainer rank calls it: all ranks gather layer by layer, rank 0 broadcasts."""
        if weights.initial:
            self._disk.publish(root, weights)
            return
        tensors = weights.hf_tensors()
        if weights.rank != 0:
            for _ in tensors:  # take part in each layer's gather
                pass
            return
        try:
            if self._sender is None:
                self._sender = Sender(root / RENDEZVOUS, self.config.backend, self.config.timeout_s)
            self._sender.send(weights.version, tensors)
        except (RuntimeError, dist.DistError) as exc:
            raise I3Error(f"weight broadcast of version {weights.version} failed: {exc}") from exc
        atomic_write_bytes(self._marker(root, weights.version), b"")
