"""The torchtitan model on a GPU: one trainer step each of Qwen3-MoE and DeepSeek-V3, Muon's Newton-Schulz
throughput in bfloat16 per matrix size, and grouped-MM experts against the per-expert loop.

The training step goes through i3core's real trainer path: ``Trainer`` built from a plugins.toml with
``[model] use = "torchtitan"`` (torchtitan's parallelize function: selective activation checkpointing and
FSDP2 on a one-rank NCCL group, bfloat16 parameters), one ``train_step`` of the IcePop loss with AdamW on a
packed batch of random samples, then ``publish`` through the filesystem weight sync (torchtitan's ``to_hf``
into an HF directory). Each model is torchtitan's debug flavor at full depth.

Newton-Schulz: ``newton_schulz`` of ``plugins/optimizers/muon.py`` on ``[n, n]`` bfloat16 matrices, 30 n^3
FLOPs per call (five iterations of three n x n x n products). Experts: the tiny-moe ``MoE`` layer at
Qwen3-30B-A3B's expert shapes, forward + backward, both backends on the same weights and tokens.

Needs CUDA and torchtitan (``pip install 'i3core[titan]'``); without them it exits 1 with one line.
Finishes in a few minutes on one H100/H200. The last line is JSON: ``train_step`` (per family: ``loss``,
``grad_norm``, ``step_time_s``, ``publish_s``, ``peak_gb``, ``hf_tensors``), ``ns5_tflops`` (per size),
``grouped_over_loop_speedup`` with ``grouped_ms`` and ``loop_ms``, and ``device``.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

NS5_SIZES = (1024, 2048, 4096, 8192)
EXPERT_SHAPE = {"tokens": 8192, "experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}
"""Qwen3-30B-A3B's MoE layer: 128 experts of SwiGLU width 768 over hidden 2048, 8 per token."""
FAMILIES = {"qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel"}


def cuda_time(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after ``warmup``, synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write_config(family: str, flavor: str, out: Path, seq_len: int) -> Path:
    """The plugins.toml of the training step: torchtitan, selective AC, IcePop, AdamW, filesystem sync."""
    toml = out / f"{family}.toml"
    toml.write_text(f'[run]\nname = "bench-titan"\noutput_dir = "{out / family}"\nmax_steps = 1\n\n'
                    f'[trainer]\nseq_len = {seq_len}\nactivation_memory = "checkpoint"\n\n'
                    f'[model]\nuse = "torchtitan"\nfamily = "{family}"\nflavor = "{flavor}"\n\n'
                    '[loss]\nuse = "icepop"\n\n[optimizer]\nuse = "adamw"\n\n'
                    '[weight_sync]\nuse = "filesystem"\n')  # fmt: skip
    return toml


def train_step(family: str, flavor: str, out: Path, seq_len: int, samples: int) -> dict:
    """One trainer step and one weight push of ``family``/``flavor`` through i3core's Trainer."""
    from i3core.config import load_config
    from i3core.loop.packing import Sample, pack
    from i3core.loop.trainer import Trainer

    config, _ = load_config(write_config(family, flavor, out, seq_len))
    trainer = Trainer(config)
    trainer.paths.make()
    rng = random.Random(0)
    vocab = trainer.model.vocab_size
    batch_samples = []
    for _ in range(samples):
        n = rng.randint(seq_len // 8, seq_len // 2)
        prompt = n // 3
        batch_samples.append(Sample([rng.randrange(vocab) for _ in range(n)], [False] * prompt + [True] * (n - prompt),
                                    [-2.0] * n, [0] * n, rng.choice([-1.0, 1.0])))  # fmt: skip
    batch = pack(batch_samples, seq_len)
    loss_fn = config.get("loss").build()
    optimizer = config.get("optimizer").build().build(trainer.model.named_parameters())
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = trainer.train_step(batch, loss_fn, optimizer, version=0)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    start = time.perf_counter()
    trainer.publish(1)
    publish_s = time.perf_counter() - start
    published = trainer.weight_sync.location(trainer.paths.broadcasts, 1)
    from safetensors import safe_open

    with safe_open(str(published / "model.safetensors"), "pt") as f:
        hf_tensors = len(list(f.keys()))
    result = {"flavor": flavor, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "step_time_s": step_s,
              "publish_s": publish_s, "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
              "rows": int(batch.input_ids.shape[0]), "hf_tensors": hf_tensors,
              "hf_model_type": json.loads((published / "config.json").read_text())["model_type"]}  # fmt: skip
    if not all(map(lambda v: v == v and abs(v) != float("inf"), (result["loss"], result["grad_norm"]))):
        raise SystemExit(f"error: {family} step gave a non-finite loss or gradient norm: {result}")
    del trainer, optimizer
    torch.cuda.empty_cache()
    return result


def ns5_tflops(iters: int) -> dict[str, float]:
    from i3core.plugins.optimizers.muon import newton_schulz

    result = {}
    for n in NS5_SIZES:
        g = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        seconds = cuda_time(lambda: newton_schulz(g, dtype=torch.bfloat16), warmup=2, iters=iters)
        result[str(n)] = round(30 * n**3 / seconds / 1e12, 2)
    return result


def experts(iters: int) -> dict:
    from i3core.plugins.models.tiny_moe.modeling import MoE

    s = EXPERT_SHAPE
    torch.manual_seed(0)
    layers = {}
    for backend in ("grouped_mm", "loop"):
        layer = MoE(s["hidden"], s["intermediate"], s["experts"], s["top_k"], True, backend)
        layers[backend] = layer
    with torch.no_grad():
        for name, param in layers["grouped_mm"].named_parameters():
            param.copy_(torch.randn_like(param) * 0.02)
        layers["loop"].load_state_dict(layers["grouped_mm"].state_dict())
    for layer in layers.values():
        layer.to("cuda", torch.bfloat16)
    x = torch.randn(s["tokens"], s["hidden"], device="cuda", dtype=torch.bfloat16)

    def step(layer):
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        out.backward(torch.ones_like(out))

    ms = {b: 1000 * cuda_time(lambda layer=layer: step(layer), warmup=2, iters=iters) for b, layer in layers.items()}
    with torch.no_grad():
        diff = (layers["grouped_mm"](x) - layers["loop"](x)).abs().max().item()
    return {"grouped_over_loop_speedup": round(ms["loop"] / ms["grouped_mm"], 2),
            "grouped_ms": round(ms["grouped_mm"], 2), "loop_ms": round(ms["loop"], 2), "max_abs_diff": diff, **s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row of the training batch")
    parser.add_argument("--samples", type=int, default=32, help="random samples packed into the training batch")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per Newton-Schulz size and expert backend")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_titan_gpu needs a CUDA GPU (none is visible); it was not run", file=sys.stderr)
        return 1
    from i3core.errors import I3Error
    from i3core.plugins.models.titan import torchtitan_module

    try:
        torchtitan_module("torchtitan.models.qwen3")
    except I3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            steps = {family: train_step(family, flavor, Path(tmp), args.seq_len, args.samples)
                     for family, flavor in FAMILIES.items()}
        result = {"train_step": steps, "ns5_tflops": ns5_tflops(args.iters), **experts(args.iters),
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    finally:
        dist.destroy_process_group()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
