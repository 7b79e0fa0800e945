"""The quickstart (or any example, ``--config FILE``) as a user runs it: wall time, and how much the reward rises.

Runs ``i3core run examples/quickstart.toml`` (SFT warm start included) in a
fresh output directory and reads its metrics.jsonl. The last line is JSON:
``config`` (the file's name), ``wall_s``, ``reward_first5`` / ``reward_last5``
(mean reward of the first and last five RL steps), ``reward_gain`` (their
difference), ``steps``, ``off_policy_mean_steps`` (over the run), and
``same_version_abs_diff_step1`` (trainer vs engine logprobs on the same weights).
``--set SECTION.KEY=VALUE`` overrides the config as ``i3core run --set`` does
(e.g. ``model.path='runs/hf-qwen3'`` for examples/hf_model.toml).
"""

import argparse
import json
from pathlib import Path

from runs import add_run_options, run_config

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser, ROOT / "examples" / "quickstart.toml")
    args = parser.parse_args()
    wall, rows = run_config(args.config, args.seed, *args.overrides)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(
        json.dumps(
            {
                "config": args.config.name,
                "wall_s": round(wall, 1),
                "steps": len(rows),
                "reward_first5": round(first, 4),
                "reward_last5": round(last, 4),
                "reward_gain": round(last - first, 4),
                "off_policy_mean_steps": round(sum(r["off_policy/mean_steps"] for r in rows) / len(rows), 3),
                "same_version_abs_diff_step1": rows[0]["mismatch/same_version_abs_diff"],
                "seed": args.seed,
            }
        )
    )


if __name__ == "__main__":
    main()
