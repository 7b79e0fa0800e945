"""The reasoning-gym example as a user runs it: does the tiny model learn reasoning-gym tasks on 2 cores?

Runs ``i3core run examples/reasoning_gym.toml`` (the quickstart with only ``[env]`` changed: spell_backward and
letter_counting, adaptive mixing; SFT warm start included) in a fresh output directory and reads its
metrics.jsonl. The last line is JSON: ``reward_gain`` (mean reward of the last five RL steps minus the first
five), ``wall_s``, the per-dataset gains ``gain/<dataset>`` (the same over the steps that drew that dataset),
``steps`` and ``seed``. ``--set SECTION.KEY=VALUE`` overrides the config as ``i3core run --set`` does.
"""

import argparse
import json
from pathlib import Path

from runs import add_run_options, run_config

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 5
"""Steps averaged at each end of the run."""


def gain(values: list[float]) -> float | None:
    if len(values) < 2 * WINDOW:
        return None
    return round(sum(values[-WINDOW:]) / WINDOW - sum(values[:WINDOW]) / WINDOW, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser, ROOT / "examples" / "reasoning_gym.toml")
    args = parser.parse_args()
    wall, rows = run_config(args.config, args.seed, *args.overrides)
    per_dataset = {}
    for key in sorted({k for r in rows for k in r if k.startswith("env/") and k.endswith("/reward/mean")}):
        per_dataset[f"gain/{key.split('/')[1]}"] = gain([r[key] for r in rows if r.get(key) is not None])
    print(json.dumps({"reward_gain": gain([r["reward/mean"] for r in rows]), "wall_s": round(wall, 1),
                      **per_dataset, "steps": len(rows), "seed": args.seed}))


if __name__ == "__main__":
    main()
