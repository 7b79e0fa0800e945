"""Off-policy ablation: the quickstart task with staleness forced to about 8 steps, one run per loss.

Each run is the quickstart with its engine held ``--lag`` versions behind the
trainer (``scheduler.weight_update_lag``, with ``max_async`` = lag,
``max_off_policy_steps`` = 8, so groups older than 8 steps are dropped, and
``max_sample_lag`` = 8 instead of the quickstart's 1) and the same seed; only
the loss differs: icepop, gspo, cispo and pg (no correction).
Prints one JSON object per loss, then a last line with all of them:
``{"results": [{"loss", "final_reward", "peak_reward", "drop_from_peak", "mean_off_policy_steps"}...]}``
where final reward is the mean of the last 10 steps and the drop is peak (a
10-step moving average) minus final. Writes ``offpolicy.png`` with the curves.
"""

import argparse
import json
import tempfile
from pathlib import Path

from runs import run_config

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 10
"""Steps averaged for the final and peak reward (single steps are noisy)."""


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[i - window : i]) / window for i in range(window, len(values) + 1)]


MAX_OFF_POLICY = 8
"""Groups older than this many versions are dropped (``max_off_policy_steps``)."""
ICEPOP_KEYS = ("mask_low", "mask_high", "rollout_min_ratio")
"""The quickstart's [loss] section carries icepop's keys; other losses do not take them."""


def run(loss: str, args, out: Path) -> list[dict]:
    """The quickstart with loss ``loss`` at ``args.lag`` versions of staleness, in ``out``: its metrics rows."""
    text = args.config.read_text()
    if loss != "icepop":
        text = "\n".join(line for line in text.splitlines() if line.split("=")[0].strip() not in ICEPOP_KEYS)
    config = out.parent / f"{loss}.toml"
    config.write_text(text)
    sets = {
        "run.max_steps": args.steps, "loss.use": f"'{loss}'", "scheduler.max_off_policy_steps": MAX_OFF_POLICY,
        "scheduler.max_async": args.lag, "scheduler.weight_update_lag": args.lag, "weight_sync.keep": args.lag + 2,
        # the quickstart starts a group only on weights at most 1 version behind: here as far as a group is kept
        "scheduler.max_sample_lag": MAX_OFF_POLICY,
    }  # fmt: skip
    _, rows = run_config(config, args.seed, *(f"{key}={value}" for key, value in sets.items()), out=out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml", help="base config")
    parser.add_argument("--steps", type=int, default=200, help="RL steps per run")
    parser.add_argument("--lag", type=int, default=7, help="versions the servers are held behind the trainer")
    parser.add_argument("--seed", type=int, default=0, help="the same seed for every run")
    parser.add_argument("--losses", default="icepop,gspo,cispo,pg", help="comma-separated losses")
    parser.add_argument("--plot", type=Path, default=Path("offpolicy.png"), help="where to write the curves")
    args = parser.parse_args()
    results, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss in args.losses.split(","):
            rows = run(loss, args, Path(tmp) / loss)
            rewards = [r["reward/mean"] for r in rows]
            smooth = moving_average(rewards, WINDOW)
            final = smooth[-1]
            result = {
                "loss": loss,
                "final_reward": round(final, 4),
                "peak_reward": round(max(smooth), 4),
                "drop_from_peak": round(max(smooth) - final, 4),
                "first_reward": round(smooth[0], 4),
                "mean_off_policy_steps": round(sum(r["off_policy/mean_steps"] for r in rows) / len(rows), 2),
                "dropped_stale": rows[-1]["rollouts/dropped_stale"],
                "steps": len(rows),
            }
            results.append(result)
            curves[loss] = rewards
            print(json.dumps(result), flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for loss, rewards in curves.items():
        ax.plot(range(WINDOW, len(rewards) + 1), moving_average(rewards, WINDOW), label=loss)
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward ({WINDOW}-step mean)")
    ax.set_title(f"staleness forced to ~{args.lag}+ steps")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(json.dumps({"results": results, "lag": args.lag, "seed": args.seed}))


if __name__ == "__main__":
    main()
