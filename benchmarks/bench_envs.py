"""The reasoning-gym example as a user runs it: does the tiny model learn reasoning-gym tasks on 2 cores?

Runs ``i3core run examples/reasoning_gym.toml`` (the quickstart with only ``[env]`` changed: spell_backward and
letter_counting, adaptive mixing; SFT warm start included) in a fresh output directory and reads its
metrics.jsonl. The last line is JSON: ``reward_gain`` (mean reward of the last five RL steps minus the first
five), ``wall_s``, the per-dataset gains ``gain/<dataset>`` (the same over the steps that drew that dataset),
``steps`` and ``seed``.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 5
"""Steps averaged at each end of the run."""


def gain(values: list[float]) -> float | None:
    if len(values) < 2 * WINDOW:
        return None
    return round(sum(values[-WINDOW:]) / WINDOW - sum(values[:WINDOW]) / WINDOW, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "reasoning_gym.toml", help="run config")
    parser.add_argument("--seed", type=int, default=0, help="run.seed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "i3core.cli", "--log-level", "warning", "run", str(args.config),
             "--set", f"run.output_dir='{out}'", "--set", f"run.seed={args.seed}"],
            check=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_dataset = {}
    for key in sorted({k for r in rows for k in r if k.startswith("env/") and k.endswith("/reward/mean")}):
        per_dataset[f"gain/{key.split('/')[1]}"] = gain([r[key] for r in rows if r.get(key) is not None])
    print(json.dumps({"reward_gain": gain([r["reward/mean"] for r in rows]), "wall_s": round(wall, 1),
                      **per_dataset, "steps": len(rows), "seed": args.seed}))


if __name__ == "__main__":
    main()
