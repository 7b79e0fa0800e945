"""Grouped-MM experts vs the per-expert loop: forward + backward of one MoE layer, side by side.

Both backends get the same weights and the same tokens in one process; each is
timed over ``--iters`` forward+backward passes after ``--warmup`` untimed ones,
alternating backends so drift on a busy machine hits both alike. The last line
is JSON: ``grouped_over_loop_speedup`` (loop time / grouped time), ``tokens``,
``experts``, plus the per-pass milliseconds.
"""

import argparse
import json
import time

import torch

from i3core.plugins.models.tiny_moe.modeling import MoE


def time_pass(layer: MoE, x: torch.Tensor) -> float:
    start = time.perf_counter()
    out = layer(x)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens through the layer per pass")
    parser.add_argument("--experts", type=int, default=64, help="experts E")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H")
    parser.add_argument("--intermediate", type=int, default=128, help="expert intermediate size I")
    parser.add_argument("--iters", type=int, default=10, help="timed passes per backend")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes per backend")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and tokens")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    layers = {}
    for backend in ("grouped_mm", "loop"):
        layers[backend] = MoE(args.hidden, args.intermediate, args.experts, args.top_k, True, backend)
    with torch.no_grad():
        for param in layers["grouped_mm"].parameters():
            param.normal_(0, 0.02)
        layers["loop"].load_state_dict(layers["grouped_mm"].state_dict())
    x = torch.randn(args.tokens, args.hidden)

    check = {b: layer(x) for b, layer in layers.items()}
    max_diff = (check["grouped_mm"] - check["loop"]).abs().max().item()
    times = {b: [] for b in layers}
    for i in range(args.warmup + args.iters):
        for backend, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            elapsed = time_pass(layer, x)
            if i >= args.warmup:
                times[backend].append(elapsed)
    ms = {b: 1000 * sorted(t)[len(t) // 2] for b, t in times.items()}
    result = {
        "grouped_over_loop_speedup": round(ms["loop"] / ms["grouped_mm"], 3),
        "tokens": args.tokens,
        "experts": args.experts,
        "top_k": args.top_k,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "grouped_ms": round(ms["grouped_mm"], 2),
        "loop_ms": round(ms["loop"], 2),
        "max_abs_diff": max_diff,
        "threads": torch.get_num_threads(),
        "device": "cpu",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
