"""The quickstart as a user runs it: wall time, and how much the reward rises during RL.

Runs ``i3core run examples/quickstart.toml`` (SFT warm start included) in a
fresh output directory and reads its metrics.jsonl. The last line is JSON:
``wall_s``, ``reward_first5`` / ``reward_last5`` (mean reward of the first and
last five RL steps), ``reward_gain`` (their difference), ``steps``, and
``same_version_abs_diff_step1`` (trainer vs server logprobs on the same weights).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml", help="run config")
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
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(
        json.dumps(
            {
                "wall_s": round(wall, 1),
                "steps": len(rows),
                "reward_first5": round(first, 4),
                "reward_last5": round(last, 4),
                "reward_gain": round(last - first, 4),
                "same_version_abs_diff_step1": rows[0]["mismatch/same_version_abs_diff"],
                "seed": args.seed,
            }
        )
    )


if __name__ == "__main__":
    main()
