"""Plots of a run from its ``metrics.jsonl``: one PNG per view, an overview and an HTML summary.

``i3core plot RUN_DIR`` and the end of ``i3core run`` both call :func:`plot_run`,
which writes

- ``RUN_DIR/plot.png``: every view on one figure;
- ``RUN_DIR/plots/{reward,loss,off_policy,mismatch_kl,masked,throughput,env_reward,env_mixing}.png``;
- ``RUN_DIR/plots/index.html``: the views (relative links, so the folder can be
  copied) and a table of the last step's metrics.

Views and the metrics they read (a view without its metrics says so):

- reward: ``reward/mean`` with ``reward/min`` and ``reward/max``.
- loss: ``loss``.
- off-policy steps: ``off_policy/mean_steps`` and ``off_policy/max_steps``
  (per trained rollout: the trained version minus its oldest token's version).
- mismatch KL: ``mismatch/kl``, the trainer's k3 estimate of
  KL(inference || trainer) over loss tokens, ``r - 1 - log r`` with
  ``r = exp(trainer logprob - inference logprob)``, averaged over tokens.
- masked fractions: of the rollouts resolved during a step (the step's increase
  of trained + dropped_stale + masked + failed), the fraction masked for each
  reason (``rollouts/masked/<reason>``), dropped stale and failed; plus the
  loss's token-level masked fractions (``loss/masked_*_frac``) where the loss
  reports them.
- throughput: trainer loss tokens per second of step time
  (``train/loss_tokens / step_time_s``) and rollouts resolved per second of
  wall time (from ``time/elapsed_s``).
- per env (an env group's members): ``env/<task>/reward/mean`` and the
  mixing weight ``env/<task>/mix_weight``.
"""

import html
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from i3core.errors import I3Error

RESOLVED = ("rollouts/trained", "rollouts/dropped_stale", "rollouts/masked", "rollouts/failed")
"""The ledger buckets a started rollout ends in; their per-step increase is the step's resolved rollouts."""
DPI = 100
MAX_PLOTTED = 1e300
"""Values beyond ±this are left out of a view, as inf and nan are: matplotlib's axis arithmetic (margins, tick
spacing) overflows near float's largest value (1.8e308). A diverged loss of 1e308 still shows in index.html."""


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]


@dataclass
class View:
    """One PNG: a name (its file), a title and how its lines come from the rows."""

    name: str
    title: str
    ylabel: str
    series: Callable[[list[dict]], list[Series]]


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``, by step; a torn last line (a killed run) is skipped.

    :raises I3Error: no metrics file, or one without a single complete row.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise I3Error(f"{path} does not exist: is {run_dir} a run directory?")
    if not path.is_file():
        raise I3Error(f"{path} is not a file: is {run_dir} a run directory?")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():  # garbage lines are not rows
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if not rows:
        raise I3Error(f"{path} has no complete step yet")
    return sorted(rows, key=lambda r: r["step"])


def _keys(*keys: str) -> Callable[[list[dict]], list[Series]]:
    def series(rows: list[dict]) -> list[Series]:
        return [s for key in keys if (s := _column(rows, key, key)).steps]

    return series


def _column(rows: list[dict], key: str, label: str) -> Series:
    points = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
    return Series(label, [p[0] for p in points], [float(p[1]) for p in points])


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _deltas(rows: list[dict], key: str) -> list[float]:
    """Per-step increase of a cumulative counter (the first step's from 0; a row without a number counts 0)."""
    values = [float(r[key]) if _number(r.get(key)) else 0.0 for r in rows]
    return [b - a for a, b in zip([0.0, *values], values)]


def masked_fractions(rows: list[dict]) -> list[Series]:
    """Of each step's resolved rollouts, the fraction per masked reason, dropped stale and failed."""
    steps = [r["step"] for r in rows]
    resolved = [sum(parts) for parts in zip(*(_deltas(rows, k) for k in RESOLVED))]
    reasons = sorted({k for r in rows for k in r if k.startswith("rollouts/masked/")})
    out = []
    for key in [*reasons, "rollouts/dropped_stale", "rollouts/failed"]:
        fractions = [d / n if n else 0.0 for d, n in zip(_deltas(rows, key), resolved)]
        out.append(Series(key.removeprefix("rollouts/"), steps, fractions))
    tokens = sorted({k for r in rows for k in r if k.startswith("loss/masked_") and k.endswith("_frac")})
    out.extend(_column(rows, key, f"{key} (tokens)") for key in tokens)
    return [s for s in out if s.steps]


def throughput(rows: list[dict]) -> list[Series]:
    """Trainer loss tokens per second of step time; rollouts resolved per second of wall time."""
    trainer = [(r["step"], r["train/loss_tokens"] / r["step_time_s"]) for r in rows
               if _number(r.get("train/loss_tokens")) and _number(r.get("step_time_s")) and r["step_time_s"] > 0]
    resolved = [sum(parts) for parts in zip(*(_deltas(rows, k) for k in RESOLVED))]
    elapsed = _deltas(rows, "time/elapsed_s")
    rollouts = [(r["step"], n / dt) for r, n, dt in zip(rows, resolved, elapsed) if "time/elapsed_s" in r and dt > 0]
    out = [Series("trainer loss tokens / s", [p[0] for p in trainer], [p[1] for p in trainer]),
           Series("rollouts resolved / s", [p[0] for p in rollouts], [p[1] for p in rollouts])]
    return [s for s in out if s.steps]


def per_task(suffix: str) -> Callable[[list[dict]], list[Series]]:
    """One line per env-group member: ``env/<task>/<suffix>``."""

    def series(rows: list[dict]) -> list[Series]:
        keys = sorted({k for r in rows for k in r if k.startswith("env/") and k.endswith("/" + suffix)})
        return [s for k in keys if (s := _column(rows, k, k.split("/")[1])).steps]

    return series


VIEWS = [
    View("reward", "Reward", "reward", _keys("reward/mean", "reward/min", "reward/max")),
    View("loss", "Loss", "loss", _keys("loss")),
    View("off_policy", "Off-policy steps of trained rollouts", "versions behind",
         _keys("off_policy/mean_steps", "off_policy/max_steps")),
    View("mismatch_kl", "Mismatch KL(inference || trainer), k3", "nats / token", _keys("mismatch/kl")),
    View("masked", "Masked fractions", "fraction", masked_fractions),
    View("throughput", "Throughput", "per second", throughput),
    View("env_reward", "Reward per env (env group members)", "reward", per_task("reward/mean")),
    View("env_mixing", "Mixing weight per env", "weight", per_task("mix_weight")),
]


def _plottable(series: Series) -> Series:
    points = [(step, v) for step, v in zip(series.steps, series.values) if math.isfinite(v) and abs(v) <= MAX_PLOTTED]
    return Series(series.label, [p[0] for p in points], [p[1] for p in points])


def _draw(ax, view: View, rows: list[dict]) -> None:
    found = view.series(rows)
    lines = [s for s in map(_plottable, found) if s.steps]
    for s in lines:
        ax.plot(s.steps, s.values, marker="." if len(s.steps) < 50 else None, label=s.label)
    if not lines:
        text = "not in metrics.jsonl" if not found else f"no value within ±{MAX_PLOTTED:g}"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    elif len(lines) > 1:
        ax.legend(fontsize="small")
    ax.set_title(view.title)
    ax.set_xlabel("step")
    ax.set_ylabel(view.ylabel)
    ax.grid(alpha=0.3)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``plot.png``, one PNG per view and ``index.html`` (see the module docstring).

    :param out_dir: where the PNGs and index.html go (default ``run_dir/plots``).
    :return: the files written, the HTML last.
    :raises I3Error: the run has no metrics yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    rows = read_metrics(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for view in VIEWS:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        _draw(ax, view, rows)
        fig.tight_layout()
        fig.savefig(out / f"{view.name}.png", dpi=DPI)
        plt.close(fig)
        written.append(out / f"{view.name}.png")
    grid_rows = math.ceil(len(VIEWS) / 3)
    fig, axes = plt.subplots(grid_rows, 3, figsize=(16, 4 * grid_rows))
    for ax, view in zip(axes.flat, VIEWS):
        _draw(ax, view, rows)
    for ax in list(axes.flat)[len(VIEWS):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(run_dir / "plot.png", dpi=DPI)
    plt.close(fig)
    written.append(run_dir / "plot.png")
    index = out / "index.html"
    index.write_text(summary_html(run_dir, rows), encoding="utf-8")
    written.append(index)
    return written


def summary_html(run_dir: Path, rows: list[dict]) -> str:
    """A page with every view (relative links) and the last step's metrics."""
    name = _run_name(run_dir)
    last = rows[-1]
    cells = "\n".join(f"<tr><td>{html.escape(k)}</td><td>{_format(v)}</td></tr>" for k, v in sorted(last.items()))
    figures = "\n".join(f'<figure><img src="{v.name}.png" alt="{html.escape(v.title)}">'
                        f"<figcaption>{html.escape(v.title)}</figcaption></figure>" for v in VIEWS)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>i3core run {html.escape(name)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
.views {{ display: flex; flex-wrap: wrap; gap: 1em; }}
figure {{ margin: 0; }} img {{ max-width: 600px; }}
table {{ border-collapse: collapse; }} td {{ border: 1px solid #ccc; padding: 2px 8px; font-family: monospace; }}
</style></head>
<body>
<h1>Run {html.escape(name)}</h1>
<p>{len(rows)} steps (last: {last["step"]}) from {html.escape(str(run_dir / "metrics.jsonl"))}</p>
<div class="views">
{figures}
</div>
<h2>Metrics at step {last["step"]}</h2>
<table>
{cells}
</table>
</body></html>
"""


def _run_name(run_dir: Path) -> str:
    """``run.name`` of the run's ``config.resolved.json``; the folder's name when it has none readable."""
    try:
        name = json.loads((run_dir / "config.resolved.json").read_text(encoding="utf-8"))["run"]["name"]
    except (OSError, ValueError, TypeError, KeyError):  # none, not JSON, or not a config
        return run_dir.name
    return name if isinstance(name, str) else run_dir.name


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return html.escape(str(value))
