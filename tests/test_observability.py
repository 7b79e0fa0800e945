"""Metric sinks (jsonl always, tensorboard, wandb offline) and ``i3core plot``, read back from what they wrote."""

import json
import math
import struct
import sys
import time

import matplotlib.image
import pytest

from i3core.loop.plot import VIEWS
from i3core.testing import make_component

from .conftest import quickstart_run, run_cli

METRICS = [{"loss": 0.5, "reward/mean": 0.25, "rollouts/started": 64}, {"loss": -0.125, "reward/mean": 0.5,
           "rollouts/started": 128}, {"loss": float("nan"), "reward/mean": 0.75, "rollouts/started": 192}]  # fmt: skip


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    """A real 3-step quickstart run whose plugins.toml picks ``[metrics] use = "tensorboard"``."""
    tmp = tmp_path_factory.mktemp("tb-run")
    proc, out, rows = quickstart_run(tmp, "run.max_steps=3", "sft.steps=0",
                                     replace={'[metrics]\nuse = "jsonl"': '[metrics]\nuse = "tensorboard"'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, rows


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_sink_round_trip(tmp_path):
    pytest.importorskip("tensorboard")
    sink = make_component("metric_sink", "tensorboard", logdir="tb")
    sink.open(tmp_path)
    for step, metrics in enumerate(METRICS, start=1):
        sink.write(step, metrics)
    sink.close()
    got = scalars(tmp_path / "tb")
    assert got["loss"][:2] == [(1, 0.5), (2, -0.125)] and math.isnan(got["loss"][2][1])
    assert got["rollouts/started"] == [(1, 64.0), (2, 128.0), (3, 192.0)]


@pytest.mark.slow
def test_the_run_writes_jsonl_and_the_configured_tensorboard_sink(tensorboard_run):
    out, rows = tensorboard_run
    assert [r["step"] for r in rows] == [1, 2, 3]  # metrics.jsonl: always written
    (logdir,) = {p.parent for p in (out / "tensorboard").glob("events.out.tfevents.*")}
    got = scalars(logdir)
    for key in ["loss", "reward/mean", "mismatch/kl", "rollouts/started", "rollouts/masked"]:
        assert [s for s, _ in got[key]] == [1, 2, 3], key
        assert [v for _, v in got[key]] == pytest.approx([r[key] for r in rows], rel=1e-6), key


@pytest.mark.slow
def test_the_trainer_logs_mismatch_kl(tensorboard_run):
    _, rows = tensorboard_run
    assert all(math.isfinite(r["mismatch/kl"]) and r["mismatch/kl"] >= 0 for r in rows)
    assert rows[0]["mismatch/kl"] < 1e-6  # version 0: the servers sampled with exactly the trained weights


def wandb_records(path):
    """The protobuf records of an offline ``run-*.wandb`` file (LevelDB log format: 32 KiB blocks of
    chunks, each with a 7-byte header of crc32, length and type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_sink_offline_writes_a_run_under_the_output_dir(tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "config.resolved.json").write_text(json.dumps({"run": {"name": "wb-test"}, "loss": {"use": "icepop"}}))
    sink = make_component("metric_sink", "wandb", project="i3core-tests")
    sink.open(tmp_path)
    for step, metrics in enumerate(METRICS[:2], start=1):
        sink.write(step, metrics)
    sink.close()
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file: run.finish() can return before its last records are flushed.
    # The run is whole once its exit record is there (bounded wait: 30 s).
    for _ in range(300):
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds, f"no exit record in {path} ({path.stat().st_size} bytes): {kinds}"
    history, runs = [], []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            runs.append(record.run)
    assert [(h["_step"], h["loss"], h["reward/mean"]) for h in history] == [(1, 0.5, 0.25), (2, -0.125, 0.5)], kinds
    assert runs[0].project == "i3core-tests" and runs[0].display_name == "wb-test"
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["loss"] == {"use": "icepop"}


@pytest.mark.parametrize("sink", ["wandb", "tensorboard"])
def test_a_sink_without_its_extra_is_one_clear_line(tmp_path, sink):
    config = tmp_path / "p.toml"
    config.write_text(f'[metrics]\nuse = "{sink}"\n')
    block = f"import sys; sys.modules[{sink!r}] = None; from i3core.cli.main import main; sys.exit(main(sys.argv[1:]))"
    import subprocess

    result = subprocess.run([sys.executable, "-c", block, "check", str(config)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == f"1 problem in {config}"
    assert lines[0].startswith(f"error: metrics.use: the {sink} sink needs the {sink} package (")
    assert lines[0].endswith(f"pip install 'i3core[{sink}]'")


def check_plots(folder, run_dir):
    for view in VIEWS:
        image = matplotlib.image.imread(folder / f"{view.name}.png")
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert matplotlib.image.imread(run_dir / "plot.png").shape[1] > 1000
    page = (folder / "index.html").read_text()
    for view in VIEWS:
        assert f'src="{view.name}.png"' in page
    return page


@pytest.mark.slow
def test_the_run_ends_with_its_plots_and_summary(tensorboard_run):
    out, rows = tensorboard_run
    page = check_plots(out / "plots", out)
    assert "<td>mismatch/kl</td>" in page and f"Metrics at step {rows[-1]['step']}" in page


@pytest.mark.slow
def test_plot_command_on_a_real_run(tensorboard_run, tmp_path):
    out, _ = tensorboard_run
    result = run_cli("plot", str(out), "--out", str(tmp_path / "p"))
    assert result.returncode == 0, result.stderr
    written = result.stdout.split()
    assert written[-1] == str(tmp_path / "p" / "index.html") and len(written) == len(VIEWS) + 2
    check_plots(tmp_path / "p", out)


def test_plot_command_on_a_folder_without_metrics_is_one_line(tmp_path):
    result = run_cli("plot", str(tmp_path))
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: {tmp_path / 'metrics.jsonl'} does not exist: is {tmp_path} a run directory?"]


def test_plot_command_on_a_diverged_run_draws_what_it_can(tmp_path):
    """A loss of 1e308 (matplotlib's axis arithmetic overflows on it) or inf is left out of its view, as nan is; a
    counter that is not a number counts 0; a config.resolved.json that is not JSON leaves the folder's name."""
    rows = [{"step": s, "loss": loss, "reward/mean": 0.1 * s, "rollouts/trained": 64 * s, "rollouts/failed": 0,
             "time/elapsed_s": float(s)} for s, loss in enumerate([0.5, 1e308, -1e308, 0.25], 1)]
    rows[1]["rollouts/failed"] = "many"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                            + '{"step": 5, "loss": Infinity}\n')
    (tmp_path / "config.resolved.json").write_text("[1, 2]")
    result = run_cli("plot", str(tmp_path))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.split()[-1] == str(tmp_path / "plots" / "index.html")
    page = (tmp_path / "plots" / "index.html").read_text()
    assert f"Run {tmp_path.name}" in page and "Metrics at step 5" in page
