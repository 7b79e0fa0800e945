"""Run under torchrun by tests/test_muon.py and benchmarks/bench_muon.py: Muon steps on an FSDP2-sharded tiny-moe.

``torchrun --nproc-per-node N tests/muon_ranks.py OUT.pt STRATEGY STEPS [MODEL_JSON]``: every rank builds the
same model, shards it like the trainer (each block, then the root), takes STEPS Muon steps (float32
Newton–Schulz) on the same batch on every rank (so FSDP2's averaged gradient is the one-process gradient),
and rank 0 saves the full final state, the per-step times and the collective count to OUT.pt.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from i3core.testing import make_component

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}


def batch(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (4, 24), generator=generator)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model.logits(model(ids)[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, optimizer, steps: int) -> list[float]:
    ids = batch(model.vocab_size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def optimizer_for(model, name: str, strategy: str):
    options = {"lr": 1e-2}
    if name == "muon":
        options.update(ns_dtype="float32", strategy=strategy)
    return make_component("optimizer", name, **options).build(model.named_parameters())


def main() -> None:
    out, strategy, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else SMALL
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = make_component("model", "tiny-moe", **config).build(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = optimizer_for(model, "muon", strategy)
    times = train(model, optimizer, steps)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"state": state, "times": times, "collectives": optimizer.collectives}, out)
    dist.barrier()  # no rank tears its group down while another still has work in flight
    dist.destroy_process_group()
    # Seen here now and then: after every rank has destroyed its group and its results are saved, a
    # rank aborts in C++ teardown at interpreter exit ("terminate called without an active exception").
    # Leave without running those destructors; the work is done and on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
