"""Muon for hidden matrices (and stacked experts), AdamW for the rest, in one optimizer object.

Muon (Keller Jordan et al.; Moonshot's "Muon is scalable"): the update of a
weight matrix is the momentum-mixed gradient (momentum 0.95, Nesterov)
orthogonalised by five Newton–Schulz iterations of the quintic
``X <- aX + (bA + cA^2)X`` with ``A = XX^T`` and ``(a, b, c) = (3.4445, -4.7750,
2.0315)``, run in bfloat16 by default (``ns_dtype``).

Update scale (``scale``): ``"rms"`` (default) multiplies the orthogonal update by
``0.2 * sqrt(max(rows, cols))`` so its RMS matches AdamW's (Moonshot), which lets
Muon and AdamW share one learning rate; ``"spectral"`` uses ``max(1, rows/cols)^0.5``
(the original). ``rows, cols`` are the matrix's two dimensions as the trainer
stores it.

What gets Muon: 2-D hidden weights (attention projections, the router) and
stacked expert weights ``[E, a, b]``, orthogonalised per expert matrix in one
batched call; the fused ``gate_up [E, H, 2I]`` is orthogonalised as its two
halves (gate and up, the matrices HF stores). Embeddings, the LM head, norms and
biases go to AdamW inside the same optimizer.

FSDP2 (DTensor parameters, ``Shard(0)``): elementwise work (momentum, AdamW,
the update itself) runs on each rank's shard. Newton–Schulz needs whole
matrices: a stacked expert weight is sharded along its expert dimension, so
every rank already holds whole expert matrices and orthogonalises them with no
communication; a 2-D matrix is gathered by one rank, orthogonalised there and
handed back (``strategy``):

- ``round_robin``: the 2-D matrices are owned in turn by each rank; per matrix
  its owner gathers the shards, runs Newton–Schulz and scatters the result;
- ``all_to_all``: one all-to-all hands every rank the shards of the matrices it
  owns, Newton–Schulz runs locally, a second all-to-all returns the shards
  (the layout Dion uses in production): two collectives per step in all.
"""

import math
from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from i3core.plugins.optimizers.adamw import _is_no_decay

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonal factor of ``g`` (``[..., m, n]``, batched over leading dims) by the NS quintic."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if wide:
        x = x.mT
    return x.to(g.dtype)


def update_scale(rows: int, cols: int, rule: str) -> float:
    if rule == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return max(1.0, rows / cols) ** 0.5


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "device_mesh") and hasattr(p, "placements")


class MuonOptimizer(torch.optim.Optimizer):
    """The torch optimizer :class:`Muon` builds; groups carry ``kind`` ``"muon"`` or ``"adamw"``."""

    def __init__(self, groups: list[dict], *, lr: float, momentum: float, nesterov: bool, ns_steps: int,
                 ns_dtype: torch.dtype, scale: str, strategy: str, betas, eps: float, weight_decay: float):
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(groups, defaults)
        self.ns_steps, self.ns_dtype, self.scale, self.strategy = ns_steps, ns_dtype, scale, strategy
        self.collectives = 0
        """Collective calls made by the distributed Newton–Schulz so far (for benchmarks)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw(group)
            else:
                self._muon(group)
        return loss

    # -- AdamW part ---------------------------------------------------------------

    def _adamw(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            param, grad = _local(p), _local(p.grad)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            correction1 = 1 - beta1 ** state["step"]
            correction2 = 1 - beta2 ** state["step"]
            denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / correction1)

    # -- Muon part ----------------------------------------------------------------

    def _momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor | None:
        """The Nesterov momentum-mixed gradient of ``p`` (local shard)."""
        if p.grad is None:
            return None
        grad = _local(p.grad)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(grad)
        return grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()

    def _orthogonalise(self, group: dict, g: torch.Tensor) -> torch.Tensor:
        """NS of the matrices of ``g`` (whole matrices: a 2-D one, or a stack ``[E, a, b]``)."""
        if g.numel() == 0:
            return g
        if group.get("halves"):  # a fused gate_up stack: orthogonalise gate and up apart
            half = g.shape[-1] // 2
            return torch.cat([self._orthogonalise_matrices(g[..., :half]), self._orthogonalise_matrices(g[..., half:])],
                             dim=-1)
        return self._orthogonalise_matrices(g)

    def _orthogonalise_matrices(self, g: torch.Tensor) -> torch.Tensor:
        out = newton_schulz(g, self.ns_steps, self.ns_dtype)
        return out * update_scale(g.shape[-2], g.shape[-1], self.scale)

    def _apply(self, group: dict, p: torch.Tensor, update: torch.Tensor) -> None:
        param = _local(p)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(update, alpha=-group["lr"])

    def _muon(self, group: dict) -> None:
        gathered = []  # sharded 2-D matrices: Newton–Schulz needs them whole
        for p in group["params"]:
            g = self._momentum(group, p)
            if g is None:
                continue
            if _is_sharded(p) and p.ndim == 2 and p.device_mesh.size() > 1:
                gathered.append((p, g))
            else:  # a plain tensor, or a stack sharded along its experts: whole matrices are here
                self._apply(group, p, self._orthogonalise(group, g))
        if not gathered:
            return
        if self.strategy == "all_to_all":
            updates = self._all_to_all(group, gathered)
        else:
            updates = self._round_robin(group, gathered)
        for (p, _), update in zip(gathered, updates):
            self._apply(group, p, update)

    def _round_robin(self, group: dict, gathered) -> list[torch.Tensor]:
        updates = []
        for i, (p, g) in enumerate(gathered):
            mesh_group, world, rank = _mesh(p)
            owner = i % world
            rows = p.shape[0]
            chunk = -(-rows // world)
            padded = _pad_rows(g, chunk)
            owner_global = dist.get_global_rank(mesh_group, owner)
            shards = [torch.empty_like(padded) for _ in range(world)] if rank == owner else None
            dist.gather(padded, shards, dst=owner_global, group=mesh_group)
            pieces = None
            if rank == owner:
                full = torch.cat(shards)[:rows]
                pieces = list(_pad_rows(self._orthogonalise(group, full), chunk * world).split(chunk))
            out = torch.empty_like(padded)
            dist.scatter(out, pieces, src=owner_global, group=mesh_group)
            self.collectives += 2
            updates.append(out[: g.shape[0]])
        return updates

    def _all_to_all(self, group: dict, gathered) -> list[torch.Tensor]:
        p0 = gathered[0][0]
        mesh_group, world, rank = _mesh(p0)
        chunks = [-(-p.shape[0] // world) for p, _ in gathered]
        sizes = [c * p.shape[1] for c, (p, _) in zip(chunks, gathered)]
        owners = [i % world for i in range(len(gathered))]
        # Send: to each owner r, my padded shard of every matrix r owns (in matrix order).
        send_order = sorted(range(len(gathered)), key=lambda i: owners[i])
        send = torch.cat([_pad_rows(gathered[i][1], chunks[i]).reshape(-1) for i in send_order])
        send_splits = [sum(sizes[i] for i in send_order if owners[i] == r) for r in range(world)]
        mine = [i for i in range(len(gathered)) if owners[i] == rank]
        recv_splits = [sum(sizes[i] for i in mine)] * world
        received = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=mesh_group)
        # Whole matrices: rank s's shards of my matrices arrive in block s, matrix by matrix.
        blocks = received.split(recv_splits)
        results = []
        for k, i in enumerate(mine):
            p, _ = gathered[i]
            offset = sum(sizes[j] for j in mine[:k])
            shards = [b[offset : offset + sizes[i]].reshape(chunks[i], p.shape[1]) for b in blocks]
            full = torch.cat(shards)[: p.shape[0]]
            results.append(_pad_rows(self._orthogonalise(group, full), chunks[i] * world))
        # Return: to each rank s, its rows of each of my matrices (same order as it sent them).
        back = torch.cat([torch.cat([r[s * chunks[i] : (s + 1) * chunks[i]].reshape(-1) for r, i in zip(results, mine)])
                          if mine else send.new_empty(0) for s in range(world)])
        out = torch.empty(sum(send_splits), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(out, back, send_splits, recv_splits, group=mesh_group)
        self.collectives += 2
        updates = [None] * len(gathered)
        offsets = {r: 0 for r in range(world)}
        starts = [sum(send_splits[:r]) for r in range(world)]
        for i in send_order:
            r = owners[i]
            start = starts[r] + offsets[r]
            offsets[r] += sizes[i]
            _, g = gathered[i]
            updates[i] = out[start : start + sizes[i]].reshape(chunks[i], -1)[: g.shape[0]]
        return updates


def _mesh(p: torch.Tensor):
    mesh = p.device_mesh
    return mesh.get_group(), mesh.size(), mesh.get_local_rank()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (FSDP2's last shards are short or empty)."""
    if t.shape[0] == rows:
        return t.contiguous()
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


class Muon:
    """Muon on hidden matrices and stacked experts, AdamW on embeddings, head, norms and biases."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        lr: float = Field(3e-4, gt=0, description="Learning rate of both parts (the rms scale makes them comparable).")
        momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum.")
        nesterov: bool = Field(True, description="Nesterov momentum for Muon.")
        ns_steps: int = Field(5, ge=1, description="Newton–Schulz iterations.")
        ns_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="Newton–Schulz precision.")
        scale: Literal["rms", "spectral"] = Field(
            "rms", description="rms: 0.2*sqrt(max(rows, cols)) (AdamW-matched); spectral: max(1, rows/cols)^0.5.")
        strategy: Literal["all_to_all", "round_robin"] = Field(
            "all_to_all", description="How sharded 2-D matrices are gathered for Newton–Schulz under FSDP2.")
        weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay on Muon matrices.")
        adamw_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW part: (beta1, beta2).")
        adamw_eps: float = Field(1e-8, gt=0, description="AdamW part: epsilon.")
        adamw_weight_decay: float = Field(0.0, ge=0, description="AdamW part: weight decay (embeddings and head).")

    def __init__(self, config: Config):
        self.config = config

    def build(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> MuonOptimizer:
        muon, halves, adamw_decay, adamw_plain = [], [], [], []
        for name, param in named_parameters:
            if not param.requires_grad:
                continue
            if _is_muon(name, param):
                (halves if param.ndim == 3 and name.endswith("gate_up") else muon).append(param)
            elif _is_no_decay(name, param):
                adamw_plain.append(param)
            else:
                adamw_decay.append(param)
        if not (muon or halves or adamw_decay or adamw_plain):
            raise ValueError("the optimizer got no trainable parameters")
        cfg = self.config
        groups = [
            {"params": muon, "kind": "muon", "weight_decay": cfg.weight_decay},
            {"params": halves, "kind": "muon", "halves": True, "weight_decay": cfg.weight_decay},
            {"params": adamw_decay, "kind": "adamw", "weight_decay": cfg.adamw_weight_decay},
            {"params": adamw_plain, "kind": "adamw", "weight_decay": 0.0},
        ]
        return MuonOptimizer(
            [g for g in groups if g["params"]], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps, ns_dtype=_DTYPES[cfg.ns_dtype], scale=cfg.scale, strategy=cfg.strategy,
            betas=cfg.adamw_betas, eps=cfg.adamw_eps, weight_decay=cfg.weight_decay,
        )  # fmt: skip


_ADAMW_NAMES = ("embed", "lm_head", "wte", "tok_embeddings", "output.weight")


def _is_muon(name: str, param: torch.Tensor) -> bool:
    """Hidden matrices and expert stacks; never embeddings, the head, norms or biases."""
    if param.ndim not in (2, 3) or _is_no_decay(name, param):
        return False
    return not any(key in name for key in _ADAMW_NAMES)
