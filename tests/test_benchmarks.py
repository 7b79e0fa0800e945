"""Every benchmark script still runs: each at its smallest size, exit 0 and its last line JSON. A benchmark the code
has outgrown reports nothing (two had: bench_weight_sync read ``/metrics`` after it became Prometheus text,
bench_offpolicy's runs were refused once the quickstart bounded ``max_sample_lag``), and its figures in
docs/benchmarks.md could no longer be measured again.

Its own step of .ci/run (``python -m pytest -m benchmarks``), about five minutes: the main suite leaves it out
(pyproject's ``-m "not benchmarks"``). Not here: bench_peers (TRL, the ``bench`` extra; its statistics are
tests/test_bench_peers.py) and bench_titan_gpu (a CUDA GPU; its refusal without one is tests/test_titan.py)."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.benchmarks, pytest.mark.slow]

TINY_MOE = json.dumps({"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
                       "experts_per_token": 2, "moe_intermediate_size": 32})
SHORT_RUN = ["--set", "run.max_steps=12", "--set", "sft.steps=2"]

SMALLEST = {
    "bench_engine": ["--sizes", "quickstart", "--threads", "1", "--concurrency", "2", "--tokens", "8",
                     "--prompt-len", "4", "--rounds", "1"],
    "bench_envs": SHORT_RUN,
    "bench_lora": ["--steps", "2", "--rows", "1", "--seq-len", "16", "--threads", "2", "--sequences", "1",
                   "--swap-every", "1", "--decode-steps", "1", "--rounds", "1", "--rl-steps", "5"],
    "bench_models": ["--rows", "2", "--seq-len", "64", "--iters", "1", "--warmup", "1", "--sequences", "4",
                     "--prompt-len", "8", "--decode-tokens", "8"],
    "bench_moe": ["--tokens", "256", "--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "32",
                  "--iters", "2", "--warmup", "1"],
    "bench_muon": ["--steps", "2", "--model", TINY_MOE, "--sizes", "64"],
    "bench_offpolicy": ["--steps", "12", "--losses", "icepop,cispo", "--plot", "offpolicy.png"],
    "bench_quickstart": SHORT_RUN,
    "bench_sandbox": ["--concurrent", "4", "--docker-concurrent", "2", "--create-parallel", "2", "--execs", "8",
                      "--exec-parallel", "2"],
    "bench_scheduler": ["--steps", "3", "--warm", "1", "--slots", "8", "--servers", "1,2", "--train-s", "0.1",
                        "--quickstart-steps", "7"],
    "bench_weight_sync": ["--updates", "1", "--streams", "1", "--sizes", "quickstart", "--backends", "builtin"],
}
"""The smallest arguments each benchmark takes (steps at least 2 where it takes the median after the first)."""


def test_every_benchmark_script_but_the_peers_and_the_gpus_has_a_smallest_run():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert scripts - set(SMALLEST) == {"bench_peers", "bench_titan_gpu"}


@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_the_benchmark_runs_at_its_smallest_size_and_ends_with_a_json_line(script, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *SMALLEST[script]],
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
