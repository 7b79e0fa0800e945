"""What the benchmarks that time a whole ``i3core run`` share: run a config as a user does, read its metrics."""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_config(config: Path, seed: int, *sets: str, out: Path | None = None) -> tuple[float, list[dict]]:
    """``i3core run CONFIG`` in a fresh output directory (``out``, kept; else a temporary one) with ``run.seed =
    seed`` and ``--set`` overrides ``sets``; its wall time in seconds and its metrics.jsonl rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run" if out is None else Path(out)
        start = time.perf_counter()
        overrides = [f"run.output_dir='{out}'", f"run.seed={seed}", *sets]
        subprocess.run([sys.executable, "-m", "i3core.cli", "--log-level", "warning", "run", str(config),
                        *(a for s in overrides for a in ("--set", s))], check=True)
        wall = time.perf_counter() - start
        return wall, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def add_run_options(parser: argparse.ArgumentParser, config: Path) -> None:
    """``--config`` (default ``config``), ``--seed`` and the repeatable ``--set`` of a benchmark that runs a config."""
    parser.add_argument("--config", type=Path, default=config, help="run config")
    parser.add_argument("--seed", type=int, default=0, help="run.seed")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, as i3core run --set; repeatable")
