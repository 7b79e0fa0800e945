"""Muon on CPU: distributed strategies against one process and AdamW, and Newton–Schulz time per matrix size.

Part 1 trains the same tiny-moe (``--model`` JSON, a larger one than the tests use) for ``--steps``
steps on one fixed batch: in this process with AdamW and with Muon, then under torchrun with
2 and 4 gloo ranks (FSDP2, every rank on the same batch) with each distributed strategy
(``all_to_all``, ``round_robin``). Step time is the median over steps after the first
(forward + backward + optimizer step; on 2 cores, 4 ranks oversubscribe the machine), with
Newton–Schulz in float32 so every run computes the same update; collectives are the
distributed Newton–Schulz's own calls per step (FSDP2's all-gathers and reduce-scatters are
not counted). Part 2 times one Newton–Schulz (5 steps) per square matrix size in bfloat16
and float32.

Last line JSON: ``steps`` (one object per configuration: ``optimizer``, ``strategy``,
``world``, ``step_ms``, ``collectives_per_step``), ``newton_schulz_ms`` (size -> dtype -> ms)
and ``params``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from i3core.plugins.models.tiny_moe import num_parameters
from i3core.plugins.optimizers.muon import newton_schulz
from i3core.testing import make_component

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.muon_ranks import optimizer_for, train  # noqa: E402  (the rank program the tests run too)

MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "num_experts": 8,
         "experts_per_token": 2, "moe_intermediate_size": 256}


def one_process(optimizer: str, model_cfg: dict, steps: int) -> dict:
    torch.set_num_threads(1)
    model = make_component("model", "tiny-moe", **model_cfg).build(seed=0)
    times = train(model, optimizer_for(model, optimizer, "all_to_all"), steps)
    return {"optimizer": optimizer, "strategy": None, "world": 1, "step_ms": round(1000 * statistics.median(times[1:]), 1),
            "collectives_per_step": 0}


def distributed(strategy: str, world: int, model_cfg: dict, steps: int, work: Path) -> dict:
    out = work / f"{strategy}-{world}.pt"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
         str(ROOT / "tests" / "muon_ranks.py"), str(out), strategy, str(steps), json.dumps(model_cfg)],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"torchrun failed ({strategy}, {world} ranks): {result.stderr[-2000:]}")
    saved = torch.load(out, weights_only=False)
    return {"optimizer": "muon", "strategy": strategy, "world": world,
            "step_ms": round(1000 * statistics.median(saved["times"][1:]), 1),
            "collectives_per_step": saved["collectives"] / steps}


def newton_schulz_ms(size: int, dtype: torch.dtype, repeats: int = 5) -> float:
    g = torch.randn(size, size)
    newton_schulz(g, dtype=dtype)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        newton_schulz(g, dtype=dtype)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default=json.dumps(MODEL), help="tiny-moe Config fields as JSON")
    parser.add_argument("--sizes", default="128,256,512,1024")
    args = parser.parse_args()
    model_cfg = json.loads(args.model)
    torch.set_num_threads(1)
    rows = [one_process("adamw", model_cfg, args.steps), one_process("muon", model_cfg, args.steps)]
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        for world in (2, 4):
            for strategy in ("all_to_all", "round_robin"):
                rows.append(distributed(strategy, world, model_cfg, args.steps, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    ns = {size: {name: newton_schulz_ms(size, dtype) for name, dtype in (("bfloat16", torch.bfloat16),
                                                                        ("float32", torch.float32))}
          for size in map(int, args.sizes.split(","))}
    params = num_parameters(make_component("model", "tiny-moe", **model_cfg).build(seed=0))
    print(json.dumps({"steps": rows, "newton_schulz_ms": ns,
                      "params": {"model": model_cfg, "parameters": params, "steps": args.steps, "threads": 1}}))


if __name__ == "__main__":
    main()
