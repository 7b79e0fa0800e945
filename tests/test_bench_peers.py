"""bench_peers' statistics: the paired ratios, their bootstrap interval and the figures over seeds (no TRL needed:
the script imports TRL only in its worker)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pair_where_one_side_never_reaches_the_level_counts_as_infinitely_late(bench):
    assert bench.paired(2.0, 3.0) == 1.5  # TRL's seconds over i3core's
    assert bench.paired(10, 20, ours_over_theirs=True) == 0.5  # i3core's steps over TRL's
    assert bench.paired(None, 3.0) == 0.0
    assert bench.paired(2.0, None) == float("inf")
    assert bench.paired(None, None) is None


def test_the_bootstrap_interval_holds_the_median_and_narrows_with_agreeing_pairs(bench):
    spread = [0.9, 1.1, 1.3, 1.5, 1.7, 2.0, 2.4, 2.6]
    low, high = bench.bootstrap_ci95(spread, resamples=2000)
    assert low <= bench.median(spread) <= high
    assert low >= min(spread) and high <= max(spread)
    assert low < high
    assert bench.bootstrap_ci95([1.5] * 8, resamples=200) == [1.5, 1.5]
    assert bench.bootstrap_ci95(spread, resamples=500) == bench.bootstrap_ci95(spread, resamples=500)  # seeded


def seed_run(bench, t_i3, t_trl, steps_i3, steps_trl, rss_i3=800.0):
    side = {"i3core": 1.0, "trl": 1.0}
    return {
        "i3core_time_to_reward_s": t_i3, "trl_time_to_reward_s": t_trl,
        "time_to_reward_ratio": None if t_i3 is None or t_trl is None else t_trl / t_i3,
        "cold_time_to_reward_s": {"i3core": None if t_i3 is None else t_i3 + 10, "trl": t_trl and t_trl + 10},
        "steps_to_reward": {"i3core": steps_i3, "trl": steps_trl},
        "i3core_steps_per_s": 12.0, "trl_steps_per_s": 8.0,
        "peak_rss_mb": {"i3core": rss_i3, "trl": 640.0}, "peak_pss_mb": {"i3core": 580.0, "trl": 600.0},
        **{key: side for key in ("reward_at_equal_time", "reward_last5", "cpu_s", "startup_s",
                                 "completion_tokens_first5", "completion_tokens_mean")},
        "threads": {},
    }


def test_over_seeds_reports_the_median_of_pairs_its_interval_and_the_steps_and_memory_ratios(bench):
    runs = [seed_run(bench, 2.0, 3.0, 20, 25), seed_run(bench, 2.0, 4.0, 30, 30), seed_run(bench, 4.0, 3.0, 50, 40),
            seed_run(bench, None, 5.0, None, 60), seed_run(bench, None, None, None, None)]
    figures = bench.over_seeds(runs)
    # pairs: 1.5, 2.0, 0.75, 0.0 (i3core never reached the level); the fifth reached it on neither side
    assert figures["time_to_reward_ratio"] == pytest.approx((0.75 + 1.5) / 2)
    low, high = figures["time_to_reward_ci95"]
    assert 0.0 <= low <= figures["time_to_reward_ratio"] <= high <= 2.0
    # i3core's steps over TRL's: 0.8, 1.0, 1.25, inf (i3core never reached it)
    assert figures["steps_to_reward_ratio"] == pytest.approx((1.0 + 1.25) / 2)
    assert figures["steps_to_reward_ratio_per_seed"] == [0.8, 1.0, 1.25, None]
    low, high = figures["steps_to_reward_ci95"]
    assert 0.8 <= low <= figures["steps_to_reward_ratio"] and high is None  # None: a resample's median is infinite
    assert figures["peak_rss_ratio"] == pytest.approx(800 / 640, abs=1e-3)
    assert figures["steps_per_s_ratio"] == 1.5


def test_continuous_batching_gets_a_cache_of_exactly_the_pages_its_rows_can_fill(bench):
    options = bench.generation_options("continuous-batching-fifo", rows=64, max_len=256)
    config = options["transformers_continuous_batching_config"]
    assert options["use_transformers_continuous_batching"] is True
    assert config["num_blocks"] == 64 * 256 // bench.CB_PAGE_TOKENS
    assert config["scheduler_type"] == "fifo"
    assert bench.generation_options("generate-static-cache", 64, 256) == {"cache_implementation": "static"}
    assert bench.generation_options("generate", 64, 256) == {}
