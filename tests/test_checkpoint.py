"""Checkpoints and ``--resume``: the trainer killed with SIGKILL mid-run continues bit for bit, the files that make
a checkpoint, and the orchestrator's prompt stream after a resume."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from i3core.loop import checkpoint
from i3core.loop.checkpoint import OrchestratorState

from .conftest import assert_ledger, killed_on_failure, read_metrics, trainer_command, torchrun_trainer, wait_for_step
from .test_end_to_end import start_run
from .test_trainer_distributed import make_batches, trainer_config

STEPS = 6
SCHEDULE = {"lr_warmup_steps": 2, "lr_decay": "cosine", "checkpoint_every": 3, "keep_checkpoints": 1}


def losses(out):
    return [json.loads((out / "trainer" / f"step_{s}.json").read_text())["loss"] for s in range(1, STEPS + 1)]


def weights(out):
    return load_file(str(out / "broadcasts" / f"step_{STEPS}" / "model.safetensors"))


def kill_after_step(cmd, out, step, timeout=300):
    """Start the trainer, SIGKILL torchrun and every rank once ``step`` is trained, and wait until all are gone.

    torchrun starts each rank in a session of its own, so killing torchrun's process group leaves the ranks
    running: a fast rank then finishes the run (CI once saw it write the last checkpoint after the kill)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (out / "trainer" / f"step_{step}.json").exists():
            assert proc.poll() is None, f"the trainer exited with {proc.returncode} before step {step}"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signal.SIGKILL)
        proc.wait()
        psutil.wait_procs(tree, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,optimizer", [(1, {"use": "adamw", "lr": 1e-2}), (2, {"use": "adamw", "lr": 1e-2}),
                                             (2, {"use": "muon", "lr": 1e-2, "ns_dtype": "float32"})])
def test_a_trainer_killed_mid_run_resumes_bit_for_bit(tmp_path, nproc, optimizer):
    """Steps 1-4 trained, the checkpoint of step 3 kept, then SIGKILL (torchrun and its ranks) in step 5: the
    resumed trainer trains 4, 5 and 6 again from step 3 and ends exactly where an uninterrupted one does (model,
    optimizer and learning-rate schedule restored; FSDP2 shards on two ranks)."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    for out in (whole, broken):
        make_batches(out, STEPS)
    torchrun_trainer(trainer_config(tmp_path, whole, nproc, STEPS, optimizer, **SCHEDULE), nproc)
    config = trainer_config(tmp_path, broken, nproc, STEPS, optimizer, **SCHEDULE)
    kill_after_step(trainer_command(config, nproc), broken, 4)
    assert checkpoint.complete_steps(broken / "checkpoints") == [3]
    (broken / "trainer" / f"step_{STEPS}.json").unlink(missing_ok=True)
    torchrun_trainer(config, nproc, "--resume")
    assert losses(broken) == losses(whole)
    expected, got = weights(whole), weights(broken)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    lrs = [json.loads((broken / "trainer" / f"step_{s}.json").read_text())["lr"] for s in range(1, STEPS + 1)]
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2) and lrs[-1] < lrs[2]  # warm-up, cosine
    # the last checkpoint is the end of the run; keep_checkpoints = 1 deleted step 3's
    assert checkpoint.complete_steps(broken / "checkpoints") == [STEPS]
    assert not list((broken / "checkpoints").glob(".*"))


@pytest.mark.slow
def test_resume_refuses_another_world_size_and_a_missing_step(tmp_path):
    out = tmp_path / "run"
    make_batches(out, 2)
    optimizer = {"use": "adamw", "lr": 1e-2}
    torchrun_trainer(trainer_config(tmp_path, out, 1, 2, optimizer, checkpoint_every=1), 1)
    wider = trainer_config(tmp_path, out, 2, 3, optimizer)
    result = subprocess.run(trainer_command(wider, 2, "--resume"), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "checkpoint step_2 was written by 1 trainer processes; resume it with trainer.nproc = 1" in result.stderr
    missing = subprocess.run(trainer_command(wider, 1, "--resume", "7"), capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0
    assert f"error: no complete checkpoint step_7 under {out / 'checkpoints'}" in missing.stderr


def test_latest_skips_half_written_checkpoints_and_prune_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        directory = checkpoint.checkpoint_dir(root, step)
        directory.mkdir(parents=True)
        for name in (checkpoint.MODEL, checkpoint.TRAINER, checkpoint.ORCHESTRATOR, checkpoint.optimizer_file(0)):
            (directory / name).write_bytes(b"x")
    (root / "step_6" / checkpoint.TRAINER).unlink()  # incomplete: not a candidate
    (root / ".step_8.tmp").mkdir()  # a crash while writing step 8
    assert checkpoint.latest(root) == 4
    checkpoint.clear_staging(root)
    assert not (root / ".step_8.tmp").exists()
    checkpoint.prune(root, keep=1)
    assert checkpoint.complete_steps(root) == [4] and (root / "step_6").exists()


def _fake_checkpoint(root, step):
    """The files of a checkpoint, small but real (torch files, an orchestrator state)."""
    directory = checkpoint.checkpoint_dir(root, step)
    directory.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(64)}, "step": step}, directory / checkpoint.MODEL)
    torch.save({"step": step, "world": 1}, directory / checkpoint.TRAINER)
    torch.save({"state": {}}, directory / checkpoint.optimizer_file(0))
    OrchestratorState(step=step, next_position=step, redraw=[]).save(directory / checkpoint.ORCHESTRATOR)
    return directory


def test_a_damaged_newest_checkpoint_is_named_skipped_with_a_warning_and_set_aside(tmp_path):
    """A resume falls back to the newest whole checkpoint (every role's state of one step is in it); the damaged
    one is renamed so that keep_checkpoints never keeps it over the steps trained again. All damaged: one line."""
    from structlog.testing import capture_logs

    from i3core.loop import resume

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_checkpoint(root, step)
    model = root / "step_6" / checkpoint.MODEL
    model.write_bytes(model.read_bytes()[:100])  # cut short
    (root / "step_4" / checkpoint.ORCHESTRATOR).write_text("{")
    assert f"checkpoint file {model} cannot be read (" in checkpoint.damage(root, 6)
    assert "cannot read the orchestrator state" in checkpoint.damage(root, 4)
    assert checkpoint.damage(root, 2) is None
    with capture_logs() as logs:
        assert resume.start_step(tmp_path, required=True) == 2
    assert [(e["checkpoint"], e["resume_from"]) for e in logs] == [("step_6", "step_2"), ("step_4", "step_2")]
    with pytest.raises(checkpoint.I3Error, match=f"checkpoint file {model} cannot be read .*: it is damaged"):
        checkpoint.read_torch(model)
    resume.rewind(tmp_path, 2)
    assert checkpoint.complete_steps(root) == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.damaged", "step_6.damaged"]
    (root / "step_2" / checkpoint.optimizer_file(0)).write_bytes(b"")
    with pytest.raises(checkpoint.I3Error, match=r"no checkpoint to resume from: checkpoint file .*step_2/"
                                                 r"optimizer-rank0.pt cannot be read"):
        resume.start_step(tmp_path, required=False)  # not a start over on top of the run


@pytest.mark.parametrize("written", [bytes(range(7, 107)), "a dict without the trainer's state"])
def test_a_trainer_state_that_is_garbage_or_not_the_trainers_is_damage_not_an_internal_error(tmp_path, written):
    """trainer.pt of random bytes (pickle's UnpicklingError, which is not a ValueError) or a loadable file holding
    something else: the checkpoint is damaged, named in one line, and the resume falls back to the one before."""
    from i3core.loop import resume

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        _fake_checkpoint(root, step)
    state = root / "step_4" / checkpoint.TRAINER
    if isinstance(written, bytes):
        state.write_bytes(written)
    else:
        torch.save({"x": 1}, state)
    assert checkpoint.damage(root, 4).startswith(f"checkpoint file {state} ")
    assert resume.start_step(tmp_path, required=True) == 2


def test_metrics_that_are_garbage_or_a_directory_are_one_line_not_an_internal_error(tmp_path):
    """A resume keeps metrics.jsonl's rows up to its step: binary garbage lines are dropped as lines that are not
    rows; a directory there is one line. ``i3core plot`` reads the same file the same way."""
    from i3core.loop.plot import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 0.5}\n\x9a\xff garbage\n{"step": 2}\n')
    assert checkpoint.truncate_metrics(metrics, 1) == [2]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1]
    metrics.unlink()
    metrics.mkdir()
    with pytest.raises(checkpoint.I3Error, match="metrics.jsonl is not a file"):
        checkpoint.truncate_metrics(metrics, 1)
    with pytest.raises(checkpoint.I3Error, match="metrics.jsonl is not a file"):
        read_metrics(tmp_path)


@pytest.mark.parametrize("garbage", ["not json", "[1, 2]", '{"run": 5}', b"\xff\xfe"])
def test_a_garbage_config_resolved_json_on_resume_is_one_line_naming_it(tmp_path, garbage, builtins):
    from i3core.config import validate
    from i3core.loop import resume

    config = validate({"run": {"output_dir": str(tmp_path)}}, builtins)
    saved = tmp_path / "config.resolved.json"
    saved.write_bytes(garbage if isinstance(garbage, bytes) else garbage.encode())
    with pytest.raises(checkpoint.I3Error, match=f"^{saved} (cannot be read|is not a JSON object of config sections)"
                                                 ".*: it records the config the run started with"):
        resume.check_unchanged(config)


def test_drop_after_and_truncate_metrics_undo_steps_after_the_checkpoint(tmp_path):
    for name in ("step_3", "step_4", ".step_5.tmp", "step_10.sent", "step_2.pt", "STABLE"):
        (tmp_path / name).write_text("")
    checkpoint.drop_after(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["STABLE", "step_2.pt", "step_3"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    checkpoint.truncate_metrics(metrics, 3)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_orchestrator_state_round_trips_and_a_broken_one_is_one_line(tmp_path):
    state = OrchestratorState(step=4, next_position=40, redraw=[33, 37], ledger={"started": 256},
                              batch_positions=[1, 2])
    state.save(tmp_path / "s.json")
    assert OrchestratorState.load(tmp_path / "s.json") == state
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(checkpoint.I3Error, match="cannot read the orchestrator state"):
        OrchestratorState.load(tmp_path / "bad.json")


def trainer_worker_pids(out):
    """The trainer's rank processes (torchrun's children), not torchrun itself."""
    import psutil

    ranks = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "i3core.loop.trainer" in cmdline and str(out / "config.resolved.json") in cmdline \
                and "torch.distributed.run" not in cmdline:
            ranks.append(proc.pid)
    return ranks


@pytest.mark.slow
def test_a_run_whose_trainer_is_killed_resumes_from_its_last_checkpoint(tmp_path):
    """`i3core run`, SIGKILL of the trainer's rank mid-step, then `i3core run --resume`: one metrics row per step,
    the ledger adds up on every row, no prompt trained twice, the servers start from the checkpoint's weights."""
    out = tmp_path / "run"
    sets = ["run.max_steps=8", "sft.steps=5", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2"]
    proc = start_run(out, *sets)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 5, timeout=400)
        (rank,) = trainer_worker_pids(out)
        os.kill(rank, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "error: the trainer exited" in stderr and "Traceback" not in stderr, stderr[-2000:]
    resumed_from = checkpoint.latest(out / "checkpoints")
    assert resumed_from >= 4 and resumed_from % 2 == 0
    before = read_metrics(out)
    assert len(before) >= resumed_from
    saved = OrchestratorState.load(out / "checkpoints" / f"step_{resumed_from}" / checkpoint.ORCHESTRATOR)

    resume = start_run(out, *sets, resume=True)
    _, stderr = resume.communicate(timeout=600)
    assert resume.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr and f"resumed_from_step={resumed_from}" in stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[:resumed_from] == before[:resumed_from]  # the rows up to the checkpoint are kept as they were
    assert_ledger(rows)
    first = rows[resumed_from]
    assert first["rollouts/trained"] >= (resumed_from + 1) * 64  # the ledger counts on from the checkpoint
    # the servers started from the checkpoint's weights: what they sampled at that version, the trainer agrees with
    if first["mismatch/same_version_tokens"]:
        assert first["mismatch/same_version_abs_diff"] < 1e-4
    # no prompt is trained twice: every stream position is in at most one step's batch, before or after the resume
    states = [OrchestratorState.load(out / "orchestrator" / f"step_{s}.json") for s in range(1, 9)]
    positions = [p for state in states for p in state.batch_positions]
    assert len(positions) == len(set(positions)) == 8 * 8
    for state in states[resumed_from:]:  # after the resume: prompts redrawn, then the stream where it was
        assert all(p in saved.redraw or p >= saved.next_position for p in state.batch_positions)
    assert checkpoint.complete_steps(out / "checkpoints") == [6, 8]
    # rollouts/step_N.jsonl: one file per step, each with its batch's 64 trained rollouts (the killed run's files
    # of later steps were deleted on resume and written again)
    files = sorted((out / "rollouts").glob("step_*.jsonl"))
    assert sorted(int(f.stem.removeprefix("step_")) for f in files) == list(range(1, 9))
    for path in files:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert sum(line["outcome"] == "trained" for line in lines) == 64, path


@pytest.mark.slow
def test_resume_without_a_checkpoint_and_a_fresh_run_over_an_old_one_are_one_line_each(tmp_path):
    out = tmp_path / "run"
    nothing = start_run(out, "run.max_steps=2", resume=True)
    _, stderr = nothing.communicate(timeout=120)
    assert nothing.returncode == 1
    assert stderr.strip().splitlines()[-1] == (f"error: nothing to resume: no complete checkpoint under "
                                              f"{out / 'checkpoints'} (run without --resume to start; set "
                                              "trainer.checkpoint_every to write them)")
    steps_only = tmp_path / "steps-only"  # a run killed before its first checkpoint: a plain run refuses its steps
    steps_only.mkdir()
    (steps_only / "metrics.jsonl").write_text('{"step": 1}\n')
    nothing = start_run(steps_only, "run.max_steps=2", resume=True)
    _, stderr = nothing.communicate(timeout=120)
    assert nothing.returncode == 1 and stderr.strip().splitlines()[-1] == (
        f"error: nothing to resume: no complete checkpoint under {steps_only / 'checkpoints'} (start over in "
        "another run.output_dir, or delete that directory; set trainer.checkpoint_every to write them)")
    first = start_run(out, "run.max_steps=2", "sft.steps=2")
    _, stderr = first.communicate(timeout=400)
    assert first.returncode == 0, stderr[-2000:]
    again = start_run(out, "run.max_steps=2", "sft.steps=2")
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 1
    assert stderr.strip().splitlines()[-1] == (f"error: {out} holds an earlier run (checkpoint step_2): continue it "
                                              "with --resume, or set another run.output_dir (or delete that directory)")
    done = start_run(out, "run.max_steps=2", "sft.steps=2", resume=True)
    _, stderr = done.communicate(timeout=120)
    assert done.returncode == 1 and "is already at run.max_steps = 2" in stderr.strip().splitlines()[-1]
    changed = start_run(out, "run.max_steps=4", "trainer.seq_len=128", resume=True)
    _, stderr = changed.communicate(timeout=120)
    assert changed.returncode == 1
    assert stderr.strip().splitlines()[-1] == "error: --resume continues the run as it was started; " \
                                              "changed: trainer.seq_len"


@pytest.mark.slow
def test_a_run_whose_newest_checkpoint_is_cut_short_resumes_from_the_one_before(tmp_path):
    """The probe's case: model.pt of the newest checkpoint truncated. --resume names it in one warning, goes on
    from the checkpoint before, and trains the run to its end with every metrics row once, in order."""
    out = tmp_path / "run"
    sets = ["sft.steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"]
    first = start_run(out, "run.max_steps=3", *sets)
    _, stderr = first.communicate(timeout=400)
    assert first.returncode == 0, stderr[-2000:]
    model = out / "checkpoints" / "step_3" / checkpoint.MODEL
    model.write_bytes(model.read_bytes()[:1000])
    resumed = start_run(out, "run.max_steps=5", *sets, resume=True)
    _, stderr = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, stderr[-2000:]
    warnings = [line for line in stderr.splitlines() if "damaged checkpoint" in line]
    assert len(warnings) == 1 and f"checkpoint file {model} cannot be read" in warnings[0]
    assert "resume_from=step_2" in warnings[0]
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3, 4, 5]
    assert (out / "checkpoints" / "step_3.damaged" / checkpoint.MODEL).stat().st_size == 1000


def test_a_checkpoint_file_is_streamed_and_a_full_disk_is_its_oserror(tmp_path):
    """write_torch holds no serialised copy of the state beside it, and a failed write is the OSError itself
    (ENOSPC: /dev/full), which the trainer's checkpoint turns into its one line, not torch's RuntimeError."""
    import errno

    from i3core.files import write_torch

    state = {"weights": torch.arange(1 << 20, dtype=torch.float32), "step": 3}
    write_torch(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=False)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3
    with pytest.raises(OSError) as failed:
        write_torch(state, Path("/dev/full"))
    assert failed.value.errno == errno.ENOSPC


def fill(directory):
    """Write zeros into ``directory`` until its filesystem is full; the filler file."""
    filler = directory / "filler"
    with open(filler, "wb") as file:
        chunk = bytes(1 << 20)
        try:
            while True:
                file.write(chunk)
                file.flush()
        except OSError:
            pass
    return filler


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs as the run's output directory (root)")
def test_a_full_disk_stops_the_run_with_one_line_and_the_last_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(out)], check=True)
    try:
        sets = ["run.max_steps=14", "sft.steps=5", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
        proc = start_run(out, *sets)
        with killed_on_failure(proc):
            wait_for_step(proc, out, 3, timeout=400)
            filler = fill(out)
            _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 1
        last = checkpoint.latest(out / "checkpoints")
        assert last is not None and last >= 2
        line = stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and f"the last complete checkpoint is step_{last}" in line, stderr[-3000:]
        assert "is full" in line or "No space left on device" in line, line
        assert "Traceback" not in stderr
        assert_ledger(read_metrics(out))
        # the last checkpoint is whole: every file loads, nothing half-written is left beside it
        directory = checkpoint.checkpoint_dir(out / "checkpoints", last)
        for name in (checkpoint.MODEL, checkpoint.TRAINER, checkpoint.optimizer_file(0)):
            torch.load(directory / name, weights_only=False)
        OrchestratorState.load(directory / checkpoint.ORCHESTRATOR)
        assert not list((out / "checkpoints").glob(".*"))

        filler.unlink()  # space again: the run continues from that checkpoint to its end
        resume = start_run(out, *sets, resume=True)
        _, stderr = resume.communicate(timeout=600)
        assert resume.returncode == 0, stderr[-2000:]
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == list(range(1, 15))
        assert_ledger(rows)
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def test_a_resumed_stream_draws_the_untrained_prompts_again_first_and_keeps_the_ones_not_yet_drawn(tmp_path):
    from i3core.config import validate
    from i3core.loop.orchestrator import Orchestrator
    from i3core.testing import make_component, plugin_manager

    plugins = plugin_manager(installed=False)
    config = validate({"run": {"output_dir": str(tmp_path), "max_steps": 9}}, plugins)
    env = make_component("env", "reverse-text", num_examples=50)
    scheduler = make_component("scheduler", "async", group_size=2, batch_size=4)
    fresh = Orchestrator(config, plugins, env, scheduler, None, [], [])
    order = [next(fresh._examples) for _ in range(12)]
    assert [p for p, _ in order] == list(range(12))
    state = OrchestratorState(step=4, next_position=8, redraw=[3, 5, 6], ledger={"started": 8, "trained": 8})
    resumed = Orchestrator(config, plugins, env, scheduler, None, [], [], resume=state)
    assert (resumed.step, resumed.served_version, resumed.ledger.trained) == (5, 4, 8)
    first = next(resumed._examples)
    assert first == order[3]  # the same prompt at the same position: the data order is the stream's
    # resumed again before 5 and 6 were drawn: they are still owed
    assert resumed._state(5, []).redraw == [5, 6]
    assert [p for p, _ in (next(resumed._examples) for _ in range(4))] == [5, 6, 8, 9]


def test_resume_rebuilds_the_rows_of_steps_the_checkpoint_holds_but_metrics_jsonl_lacks(tmp_path):
    """The trainer checkpointed step 3, then the run died (or the disk filled) before the orchestrator wrote
    row 3: the row is rebuilt from the step's saved orchestrator and trainer metrics."""
    from i3core.loop.resume import _restore_missing_rows
    from i3core.loop.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.make()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2)))
    ledger = {"started": 96, "trained": 72, "dropped_stale": 16, "masked": 8, "failed": 0, "requeued": 3,
              "masked_reasons": {"group_filtered": 8}}
    OrchestratorState(step=3, next_position=12, redraw=[], ledger=ledger,
                      batch_metrics={"reward/mean": 0.5}).save(paths.orchestrator_state(3))
    paths.trainer_metrics(3).write_text(json.dumps({"loss": -0.25, "mismatch/same_version_abs_diff": float("nan")}))
    _restore_missing_rows(paths, metrics, 3)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    row = rows[2]
    assert (row["loss"], row["reward/mean"], row["resume/rebuilt_row"]) == (-0.25, 0.5, 1)
    assert row["mismatch/same_version_abs_diff"] is None and row["rollouts/masked/group_filtered"] == 8
    assert_ledger(rows[2:])


def test_resume_keeps_metrics_rows_in_step_order_and_drops_a_garbage_middle_row_with_a_warning(tmp_path):
    """A garbage row 2 and a missing row 4 (the run died before writing it), checkpoint 4: row 4 is rebuilt after
    row 3; row 2 is dropped, not rebuilt after the others (it once came back last, out of order)."""
    from structlog.testing import capture_logs

    from i3core.loop.paths import RunPaths
    from i3core.loop.resume import rewind

    paths = RunPaths(tmp_path)
    paths.make()
    for step in range(1, 5):
        OrchestratorState(step=step, next_position=step, redraw=[], ledger={"started": 8 * step, "trained": 8 * step},
                          batch_metrics={"reward/mean": 0.5}).save(paths.orchestrator_state(step))
        paths.trainer_metrics(step).write_text(json.dumps({"loss": 0.1}))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.1}\n{"step": 2, "lo\x00ss\n{"step": 3, "loss": 0.1}\n')
    with capture_logs() as logs:
        rewind(tmp_path, 4)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 4] and rows[2]["resume/rebuilt_row"] == 1
    warned = {e["event"]: e for e in logs if e["log_level"] == "warning"}
    assert any(e.get("lines") == [2] for e in warned.values()) and any(e.get("steps") == [2] for e in warned.values())


def test_a_launcher_that_outlives_its_ranks_is_stopped_and_the_trainer_failure_raised(tmp_path):
    """A torchrun that hangs after its rank was SIGKILLed (seen in CI) must not hold the run for ever."""
    import asyncio

    from i3core.errors import I3Error
    from i3core.loop.run import watch_trainer

    (tmp_path / "logs").mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                                 "subprocess.Popen(['sleep', '600']).wait()\ntime.sleep(600)"])
    try:
        async def kill_the_rank():
            watch = asyncio.create_task(watch_trainer(launcher, tmp_path, grace_s=1.0))
            while not (ranks := _children(launcher.pid)):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the watch has seen the rank
            os.kill(ranks[0], signal.SIGKILL)
            return await watch

        started = time.monotonic()
        with pytest.raises(I3Error, match="the trainer exited with -9"):
            asyncio.run(asyncio.wait_for(kill_the_rank(), 60))
        assert time.monotonic() - started < 30 and launcher.poll() == -9
    finally:
        launcher.kill()
        launcher.wait()


def test_a_launcher_that_keeps_a_helper_child_is_stopped_once_its_trainer_ranks_are_gone(tmp_path):
    """torchrun may keep children that are not ranks (seen in CI: the run idle for 300 s after its rank was
    SIGKILLed): the ranks are the children running the trainer module, and their end starts the grace."""
    import asyncio

    from i3core.errors import I3Error
    from i3core.loop.run import TRAINER_MODULE, watch_trainer

    (tmp_path / "logs").mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                                 "subprocess.Popen(['sleep', '600'])\n"  # a helper, alive throughout
                                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
                                 f"'-m', {TRAINER_MODULE!r}])\n"
                                 "time.sleep(600)"])
    try:
        async def kill_the_rank():
            watch = asyncio.create_task(watch_trainer(launcher, tmp_path, grace_s=1.0))
            while len(children := _children(launcher.pid)) < 2:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the watch has seen both
            (rank,) = [pid for pid in children if TRAINER_MODULE in " ".join(psutil.Process(pid).cmdline())]
            os.kill(rank, signal.SIGKILL)
            return await watch

        import psutil

        with pytest.raises(I3Error, match="the trainer exited with -9"):
            asyncio.run(asyncio.wait_for(kill_the_rank(), 60))
        assert launcher.poll() == -9
    finally:
        launcher.kill()
        launcher.wait()


def _children(pid):
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]


@pytest.mark.slow
def test_sigterm_makes_every_rank_checkpoint_its_last_step_and_resume_goes_on_bit_for_bit(tmp_path):
    """A scheduler's SIGTERM (time limit, preemption) to torchrun while its two ranks wait for batch 4: step 3 is
    checkpointed (no checkpoint_every step was due), the trainer exits 143 with one line, and ``--resume`` trains
    4-6 to the weights of an uninterrupted run."""
    optimizer = {"use": "adamw", "lr": 1e-2}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out in (whole, cut):
        make_batches(out, STEPS)
    torchrun_trainer(trainer_config(tmp_path, whole, 2, STEPS, optimizer), 2)
    later = tmp_path / "later"
    later.mkdir()
    for step in range(4, STEPS + 1):  # not written yet: the trainer waits for them
        (cut / "batches" / f"step_{step}.pt").rename(later / f"step_{step}.pt")
    config = trainer_config(tmp_path, cut, 2, STEPS, optimizer, checkpoint_every=100)
    proc = subprocess.Popen(trainer_command(config, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (cut / "trainer" / "step_3.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "error: stopped on SIGTERM: checkpoint step_3 written; continue with --resume" in stderr, stderr[-3000:]
    assert checkpoint.complete_steps(cut / "checkpoints") == [3]
    for batch in later.iterdir():
        batch.rename(cut / "batches" / batch.name)
    torchrun_trainer(config, 2, "--resume")
    expected, got = weights(whole), weights(cut)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert json.loads((cut / "ATTEMPT.json").read_text())["step"] == 3


def test_rewind_undoes_what_the_orchestrator_cut_after_the_checkpoint_and_nothing_else(tmp_path):
    from i3core.loop import resume
    from i3core.loop.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.make()
    for step in range(1, 6):
        paths.batch(step).write_bytes(b"b")
        paths.batch_part(step, 0).write_bytes(b"p")
        paths.trainer_metrics(step).write_text("{}")
        (paths.broadcasts / f"step_{step}").mkdir()
    for step in range(1, 5):  # the orchestrator cut 1-4; batch 5 was handed to the trainer otherwise
        OrchestratorState(step=step, next_position=8 * step, redraw=[]).save(paths.orchestrator_state(step))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    paths.stop().touch()
    paths.restart().touch()
    resume.rewind(tmp_path, 2)
    assert sorted(p.name for p in paths.batches.iterdir()) == ["step_1.pt", "step_2.pt", "step_5.pt"]
    assert list(paths.parts.iterdir()) == []  # early parts: of a step trained, or to be cut again
    assert sorted(p.name for p in paths.orchestrator.iterdir()) == ["step_1.json", "step_2.json"]
    assert sorted(p.name for p in paths.trainer.iterdir()) == ["step_1.json", "step_2.json"]
    assert sorted(p.name for p in paths.broadcasts.iterdir()) == ["step_1"]  # version 2 is published again
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    assert not paths.stop().exists() and not paths.restart().exists()
    inode = metrics.stat().st_ino
    resume.rewind(tmp_path, 2)  # again: nothing changes, metrics.jsonl is not rewritten (a sink may hold it open)
    assert metrics.stat().st_ino == inode
    resume.rewind(tmp_path, 0)  # no checkpoint: the run starts over
    assert not list(paths.broadcasts.iterdir()) and metrics.read_text() == ""


def test_roles_wait_for_the_marker_of_their_attempt(tmp_path, monkeypatch):
    from i3core.errors import I3Error
    from i3core.loop import resume
    from i3core.loop.paths import RunPaths

    paths = RunPaths(tmp_path)
    monkeypatch.setenv(resume.ATTEMPT_ENV, "7.0")
    old = resume.announce(paths, 4)
    monkeypatch.setenv(resume.ATTEMPT_ENV, "7.1")
    with pytest.raises(I3Error, match=r"the trainer did not start attempt 7\.1 \(no .*ATTEMPT\.json\) in 0s"):
        resume.wait_for_attempt(paths, timeout_s=0)  # the previous attempt's marker is not this one's
    new = resume.announce(paths, 2)
    assert resume.wait_for_attempt(paths, timeout_s=0) == resume.Attempt("7.1", 2)
    assert resume.changed_attempt(paths, old) == new and resume.changed_attempt(paths, new) is None
    monkeypatch.delenv(resume.ATTEMPT_ENV)
    assert resume.wait_for_attempt(paths, timeout_s=0) == new  # no id (Kubernetes): the newest marker
    with pytest.raises(I3Error, match="did not start an attempt"):
        resume.wait_for_attempt(paths, after=new, timeout_s=0)
