"""The whole stack as a user runs it: `i3core run` with real processes (torchrun trainer, the engine in the
orchestrator as the quickstart has it, or HTTP servers where a test says so)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from .conftest import (LEDGER, ROOT, SERVERS, finish_run, interrupt_at_step, killed_on_failure, read_metrics,
                       sigint_as_at_a_terminal, wait_for_step, wait_while_running)

pytestmark = pytest.mark.slow


def start_run(out, *sets, resume=False):
    args = [sys.executable, "-m", "i3core.cli", "run", str(ROOT / "examples" / "quickstart.toml"),
            "--set", f"run.output_dir='{out}'", *[a for s in sets for a in ("--set", s)],
            *(["--resume"] if resume else [])]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_short_run_writes_metrics_ledger_checkpoint_and_plot(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "run.max_steps=6", "sft.steps=5")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row in rows:
        for key in ["reward/mean", "loss", "step_time_s", "mismatch/kl", "rollouts/started", "perf/mfu",
                    "memory/activations_mb", *LEDGER]:
            assert key in row, key
        assert row["rollouts/started"] == sum(row[k] for k in LEDGER)
        assert 0 < row["perf/mfu"] < 1 and row["memory/activations_mb"] > 0
        assert row["rollouts/trained"] >= row["step"] * 64  # batches handed to the trainer, maybe ahead
    # Version 0 is exactly what the engine sampled with: the trainer and the engine agree.
    assert rows[0]["mismatch/same_version_abs_diff"] < 1e-4
    assert rows[0]["mismatch/same_version_tokens"] > 0
    assert (out / "checkpoints" / "step_6" / "model.pt").exists()
    assert (out / "broadcasts" / "step_6" / "STABLE").exists()
    assert (out / "plot.png").stat().st_size > 0
    assert "Traceback" not in stderr
    check_rollout_files(out, rows)


def test_streamed_groups_train_early_on_policy_and_the_run_adds_up(tmp_path):
    """``[trainer] stream_groups`` with ``max_sample_lag = 0`` on uneven completions: finished groups reach the
    trainer before their batch is whole, every batch is on-policy, the ledger holds, no part is left behind."""
    out = tmp_path / "run"
    proc = start_run(out, "run.max_steps=6", "sft.steps=2", "env.min_len=8", "env.max_len=24",
                     "env.max_tokens=128", "inference.max_len=400", "trainer.seq_len=400",
                     "scheduler.max_sample_lag=0", "trainer.stream_groups=true")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert sum(r["train/streamed_rows"] for r in rows) > 0
    for row in rows:
        assert row["train/streamed_rows"] < row["train/rows"]  # the group that completes a batch comes with it
        assert row["off_policy/max_steps"] == 0
        assert row["rollouts/started"] == sum(row[k] for k in LEDGER)
        assert row["rollouts/trained"] >= row["step"] * 64
    assert list((out / "batch_parts").iterdir()) == []
    assert "Traceback" not in stderr


def test_a_colocated_trainer_runs_in_the_runs_process_and_an_interrupted_run_resumes(tmp_path):
    """``[trainer] colocate``: the trainer is a thread of the run's process (no trainer process), its lines in
    logs/trainer.log as a process's are; SIGTERM interrupts the run (exit 130) after the trainer checkpoints its
    last step, and ``--resume`` goes on from it with every step's metrics row."""
    from i3core.loop.run import TRAINER_MODULE, _cmdline, _live_children

    out = tmp_path / "run"
    sets = ("run.max_steps=400", "sft.steps=2", "trainer.colocate=true")
    proc = start_run(out, *sets)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        assert not [pid for pid in _live_children(proc.pid) if TRAINER_MODULE in _cmdline(pid)]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert saved and 3 <= saved[-1] < 400, saved
    assert '"sft_s"' in (out / "logs" / "trainer.log").read_text()
    proc = start_run(out, *sets[1:], f"run.max_steps={saved[-1] + 4}", resume=True)  # a few steps on, not 400
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved[-1] + 5))


def test_ctrl_c_in_a_terminal_stops_every_process_and_the_trainer_checkpoints_its_last_step(tmp_path):
    """A terminal's Ctrl-C is SIGINT to the whole process group: the run's process, its trainer process and its
    servers. The run ends interrupted (130) as on a signal to its process alone: the trainer checkpoints the step
    it finished last (before, a KeyboardInterrupt in its backward pass lost every step), no log holds a
    traceback, and ``--resume`` goes on from the checkpoint."""
    out = tmp_path / "run"
    sets = ("sft.steps=2", "inference.use='builtin'")
    args = [sys.executable, "-m", "i3core.cli", "run", str(ROOT / "examples" / "quickstart.toml"), "--set",
            f"run.output_dir='{out}'", *[a for s in (*sets, "run.max_steps=400") for a in ("--set", s)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_at_a_terminal)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert saved and 3 <= saved[-1] < 400, saved
    for log in (out / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log
    proc = start_run(out, *sets, f"run.max_steps={saved[-1] + 2}", resume=True)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved[-1] + 3))


def test_weights_in_memory_reach_the_engine_and_a_resumed_run_starts_from_its_checkpoints_version(tmp_path):
    """``[weight_sync] use = "memory"`` beside a colocated trainer: no version after 0 goes to disk, every step's
    version is the engine's when its metrics are written, and the engine samples with exactly the trainer's
    weights (same-version logprobs agree); an interrupted run resumes from the version of its checkpoint, written
    to disk as the engine's start."""
    out = tmp_path / "run"
    sets = ("sft.steps=2", "trainer.colocate=true", "weight_sync.use=memory", "scheduler.max_sample_lag=0")
    proc = start_run(out, "run.max_steps=400", *sets)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert sorted(p.name for p in (out / "broadcasts").iterdir()) == ["step_0"]
    resumed = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    proc = start_run(out, f"run.max_steps={resumed + 4}", *sets, resume=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, resumed + 5))
    served = [(r["step"], r["weights/served_version"]) for r in rows if "weights/served_version" in r]
    assert len(served) >= len(rows) - 1 and all(step == version for step, version in served)  # the row of the
    # step the interruption cut short is the trainer's alone (resume fills it in)
    on_disk = {p.name for p in (out / "broadcasts").iterdir()}
    assert f"step_{resumed}" in on_disk and on_disk <= {"step_0", f"step_{resumed}"}
    # on-policy: every token sampled by the version its step trains, which the trainer scores the same
    assert all(r["mismatch/same_version_tokens"] > 0 and r["mismatch/same_version_abs_diff"] < 1e-4 for r in rows)
    assert "Traceback" not in stderr


def test_a_colocated_trainer_that_fails_fails_the_run_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "run.max_steps=4", "sft.steps=3", "sft.lr=1e30", "trainer.colocate=true")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]  # the trainer's error line, from its log
    assert last.startswith("error: sft step ") and "the gradient is not finite" in last, last
    assert "Traceback" not in stderr

def check_rollout_files(out, rows):
    """rollouts/step_N.jsonl of every step: each trained rollout of the step's batch, as its env scored it, with
    the keys DESIGN.md names; `i3core rollouts` prints a step and says in one line what it cannot."""
    from i3core.plugins.envs.reverse_text import ReverseText

    env = ReverseText(ReverseText.Config(num_examples=2000, min_len=3, max_len=5, alphabet="abcdef", max_tokens=8))
    examples = {e.id: e for e in env.examples()}
    for row in rows:
        lines = [json.loads(line) for line in (out / "rollouts" / f"step_{row['step']}.jsonl").read_text().splitlines()]
        trained = [line for line in lines if line["outcome"] == "trained"]
        assert len(trained) == 64 and {line["outcome"] for line in lines} <= {"trained", "dropped"}
        assert sum(line["reward"] for line in trained) / 64 == pytest.approx(row["reward/mean"])
        for line in trained:
            assert {"prompt", "completion", "reward", "advantage", "finish_reason", "prompt_ids", "completion_ids",
                    "loss_mask", "versions", "env", "outcome"} <= set(line)
            example = examples[line["example"]]
            assert line["env"] == "reverse-text" and line["prompt"] == example.prompt
            scored = 0.0 if line["finish_reason"] == "length" else env.score(line["completion"], example)
            assert line["reward"] == pytest.approx(scored)  # the quickstart's truncated = "zero"
            assert len(line["completion_ids"]) == len(line["loss_mask"]) == len(line["versions"]) <= 8
            assert line["finish_reason"] in ("stop", "length") and all(line["loss_mask"])
            assert all(row["step"] - 1 - 8 <= v <= row["step"] - 1 for v in line["versions"])
        # a group's advantages are R - mean(R) over the group
        groups = {}
        for line in trained:
            groups.setdefault(line["example"], []).append(line)
        for group in groups.values():
            mean = sum(line["reward"] for line in group) / len(group)
            assert all(line["advantage"] == pytest.approx(line["reward"] - mean) for line in group)
    shown = subprocess.run([sys.executable, "-m", "i3core.cli", "rollouts", str(out), "--step", "2"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("step 2: ") and "reverse-text" in shown.stdout
    result = subprocess.run([sys.executable, "-m", "i3core.cli", "rollouts", str(out), "--step", "99"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"error: {out} has no rollouts of step 99 (steps 1-6 are kept)"]


KEEP_GENERATING = "scheduler.max_sample_lag=8"
"""The servers generate without waiting for the trainer, so a kill hits running rollouts: with the quickstart's
lag of 1 they idle between batches (its engine outpaces its trainer), and a server killed idle has nothing to
re-queue."""


def server_pids(out):
    found = subprocess.run(["pgrep", "-f", f"i3core.plugins.inference.server --model-dir {out}"],
                           capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def test_killing_one_of_two_servers_mid_run_the_run_finishes_on_the_other(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "run.max_steps=40", "sft.steps=5", *SERVERS, "inference.restarts=0",  # never back
                     KEEP_GENERATING)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        pids = server_pids(out)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
    stderr, rows = finish_run(proc, out, 40)
    for row in rows:
        assert 0 < row["perf/mfu"] < 1 and row["memory/activations_mb"] > 0
    # the rollouts running on the killed server are re-queued on the other one: none lost, none failed
    assert rows[-1]["rollouts/requeued"] > 0
    assert rows[-1]["rollouts/failed"] == 0
    assert "inference server marked down" in stderr
    assert "inference server crashed" not in stderr  # restarts=0: not supervised at all
    assert "inference server re-admitted" not in stderr and rows[-1]["servers/live"] == 1


RESTART_MAX_STEPS = 5000
"""Far past the test's end: the run is interrupted once the restarted server has served, so the test does not
bet on how many steps a restart takes (seconds to load torch and the model, re-probed with backoff up to 8 s;
a step takes 0.1-1 s here, and 100 steps were once over before the re-admission)."""


def logged(out, event: str) -> list[dict]:
    """The run's log events (``logs/run.jsonl``) named ``event`` so far."""
    path = out / "logs" / "run.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if row.get("event") == event]


def test_a_killed_server_is_restarted_and_re_admitted_and_the_ledger_holds(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, f"run.max_steps={RESTART_MAX_STEPS}", "sft.steps=5", *SERVERS, KEEP_GENERATING)
    with killed_on_failure(proc):
        wait_for_step(proc, out, 3)
        pids = server_pids(out)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        wait_while_running(proc, lambda: logged(out, "inference server re-admitted"), "the re-admission")
        back = server_pids(out)  # the restarted process on the killed one's port and weights
        assert len(back) == 2 and pids[0] not in back and pids[1] in back
        readmitted = len(read_metrics(out))
    stderr, rows = interrupt_at_step(proc, out, readmitted + 3, RESTART_MAX_STEPS)  # both servers live again
    # the rollouts running on the killed server are re-queued on the other one: none lost, none failed
    assert rows[-1]["rollouts/requeued"] > 0 and rows[-1]["rollouts/failed"] == 0
    for event in ("inference server marked down", "inference server crashed; restarting",
                  "inference server re-admitted"):
        assert event in stderr, event
    assert min(r["servers/live"] for r in rows) == 1 and rows[-1]["servers/live"] == 2
    assert "Traceback" not in stderr
    assert server_pids(out) == []  # the restarted server stopped with the run
    # SIGTERM interrupted the run as Ctrl-C does: its trainer process checkpointed its last step
    assert stderr.strip().splitlines()[-1] == "interrupted"
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= readmitted + 3, saved


def group_run(tmp_path, config_name, *sets):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "i3core.cli", "run", str(ROOT / "examples" / config_name),
            "--set", f"run.output_dir='{out}'", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, read_metrics(out)


def check_group_metrics(rows, tasks):
    for row in rows:
        assert row["rollouts/started"] == sum(row[k] for k in LEDGER)
        assert row["rollouts/failed"] == 0
        assert sum(row[f"env/{t}/mix_weight"] for t in tasks) == pytest.approx(1.0)
        shares = [row[f"env/{t}/share"] for t in tasks if f"env/{t}/share" in row]
        assert shares and sum(shares) == pytest.approx(1.0)
    for task in tasks:  # every member was trained on at some step, with its own reward and metrics
        assert any(f"env/{task}/reward/mean" in row for row in rows), task
    assert any(row.get("env/calc/metrics/turns", 0) >= 1 for row in rows)


def test_env_group_of_reverse_text_and_tool_calc_trains_with_per_member_metrics(tmp_path):
    out, rows = group_run(tmp_path, "env_group.toml", "run.max_steps=6", "sft.steps=3", "env.mixing='fixed'")
    assert [r["step"] for r in rows] == list(range(1, 7))
    check_group_metrics(rows, ["reverse-text", "calc"])
    assert (out / "plot.png").stat().st_size > 0


@pytest.mark.sandbox
def test_env_group_with_code_in_sandboxes_trains_with_per_member_metrics(tmp_path):
    out, rows = group_run(tmp_path, "env_group_code.toml", "run.max_steps=6", "sft.steps=3", "env.mixing='fixed'")
    assert [r["step"] for r in rows] == list(range(1, 7))
    check_group_metrics(rows, ["reverse-text", "calc", "code"])
    assert any("env/code/metrics/pass_rate" in row for row in rows)
    assert rows[-1]["sandboxes/created"] >= 1 and rows[-1]["rollouts/masked"] == 0
