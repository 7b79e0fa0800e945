"""The cluster path on a real Slurm: ``i3core launch --submit`` and the job it submits, on CPU nodes.

Needs a running Slurm cluster whose nodes are named in ``$SLURM_CONF`` and share this filesystem: CI starts three
nodes on one machine with ``.ci/slurm-cluster`` (docs/deploy.md, "How CI runs its cluster"). Without one the tests
skip, unless ``I3CORE_REQUIRE_SLURM=1`` makes that a failure. Each scenario is the cluster quickstart: 6 steps of
reverse-text (30 for the scenarios that interrupt the job; no SFT warm start), one builtin server, checkpoints
every 2 steps; the trainer, the server and the orchestrator each get a node of their own.
"""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from i3core.loop import checkpoint
from i3core.loop.checkpoint import OrchestratorState

from .conftest import assert_ledger, read_metrics, run_cli
from .test_roles import free_port, role_config

REQUIRE_ENV = "I3CORE_REQUIRE_SLURM"
STEPS = 6
JOB_TIMEOUT_S = 240.0
"""One attempt of the 6-step job: about 60 s on CI's loaded 2-core machine (2026-12-05)."""
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH"
    try:
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo does not answer (no slurmctld?)"
    idle = [line for line in nodes.stdout.splitlines() if line.split()[-1] in ("idle", "mix", "alloc")]
    if nodes.returncode != 0 or len(idle) < 3:
        said = (nodes.stderr.strip() or nodes.stdout.strip() or "none").splitlines()[-1]  # one line in the skip
        return f"no Slurm cluster of 3 nodes up ({said})"
    return None


_problem = _cluster_problem()
if _problem is not None and os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
    raise RuntimeError(f"{REQUIRE_ENV} is set but {_problem}: start one with .ci/slurm-cluster start DIR")
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_problem is not None, reason=f"Slurm: {_problem}")]


LONG_STEPS = 30
"""The run of the scenarios that interrupt a job (requeue, a lost trainer, SIGTERM): long enough that what the test
sends once step 3 is in lands before the last step (6 steps took 3 s on an idle machine, so a 6-step run was over
by the time the signal came, in two CI runs)."""


def _cluster_config(tmp_path, steps: int):
    """The quickstart as the roles run it (one builtin server), ``steps`` steps, checkpoints every 2."""
    path = role_config(tmp_path, steps)
    path.write_text(path.read_text().replace("[trainer]\n", "[trainer]\ncheckpoint_every = 2\n"))
    return path


@pytest.fixture
def cluster_config(tmp_path):
    return _cluster_config(tmp_path, STEPS)


@pytest.fixture
def long_cluster_config(tmp_path):
    return _cluster_config(tmp_path, LONG_STEPS)


class Job:
    """A job submitted by ``i3core launch --submit``; cancelled at the end if still there."""

    def __init__(self, config, *extra: str):
        self.out = config.parent / "run"
        result = run_cli("launch", "--submit", str(config), "--gpus-per-node", "0", "--orchestrator-cpus", "2",
                         "--partition", "cpu", "--cpu-partition", "cpu", "--inference-port", str(free_port()),
                         "--rdzv-port", str(free_port()), *extra, cwd=config.parent)
        assert result.returncode == 0, result.stderr
        match = re.match(r"submitted job (\d+): (.*)$", result.stdout.splitlines()[0])
        assert match and match.group(2) == str(self.out / "i3core.sbatch"), result.stdout
        self.id = match.group(1)
        self.output = self.out / "logs" / f"slurm-{self.id}.out"
        assert result.stdout.splitlines()[1] == f"job output: {self.output}"

    def show(self) -> dict[str, str]:
        """``scontrol show job`` of the job's first component, as key=value pairs."""
        text = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True,
                              timeout=20).stdout
        first = text.splitlines()[0] if text else ""
        return dict(item.split("=", 1) for item in first.split() if "=" in item)

    def wait(self, until, what: str, timeout: float = JOB_TIMEOUT_S, poll_s: float = 1.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.show()
            if until(info):
                return info
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id}: not {what} in {timeout:.0f}s ({info.get('JobState')}): {self.logs()}")
            time.sleep(poll_s)

    def role_step(self, role: str) -> str:
        """The id of the job step running ``role`` (``trainer``, ...): the job's sruns start together, so which
        of them is step 0 is a race; the job script names each step after its role."""
        text = subprocess.run(["squeue", "-h", "-s", "-j", self.id, "-o", "%i %j"], capture_output=True, text=True,
                              timeout=20).stdout
        steps = [line.split()[0] for line in text.splitlines() if line.split()[1:] == [role]]
        assert len(steps) == 1, f"job {self.id}: steps {text!r}"
        return steps[0]

    def wait_for_step(self, step: int) -> None:
        self.wait(lambda info: len(read_metrics(self.out)) >= step, f"at step {step}", poll_s=0.2)

    def finish(self) -> dict[str, str]:
        """Until the job has ended; a requeued attempt is started at once (Slurm holds one for 2 minutes)."""
        def ended(info):
            if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={self.id}", "StartTime=now"], timeout=20)
            return info.get("JobState") in DONE

        return self.wait(ended, "ended")

    def logs(self) -> str:
        parts = []
        for path in [self.output, *sorted((self.out / "logs").glob(f"*-{self.id}*.log"))]:
            if path.exists():
                parts.append(f"--- {path.name} ---\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def cancel(self) -> None:
        if self.show().get("JobState") not in DONE:
            subprocess.run(["scancel", self.id], timeout=20)


@pytest.fixture
def jobs():
    submitted = []
    yield submitted
    for job in submitted:
        job.cancel()


def assert_every_step_trained_once(out, steps: int = STEPS) -> list[dict]:
    """One metrics row per step, the ledger balanced on each, every prompt in at most one step's batch."""
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_ledger(rows)
    states = [OrchestratorState.load(out / "orchestrator" / f"step_{s}.json") for s in range(1, steps + 1)]
    positions = [p for state in states for p in state.batch_positions]
    assert len(positions) == len(set(positions)) == steps * 8  # 8 groups a batch
    kept = checkpoint.complete_steps(out / "checkpoints")  # keep_checkpoints = 2 (the default); a SIGTERM (a
    assert kept[-1] == steps and len(kept) == 2               # requeue's too) adds its own checkpoint
    return rows


def test_the_cluster_quickstart_completes_on_three_nodes(cluster_config, jobs):
    jobs.append(job := Job(cluster_config))
    info = job.finish()
    assert info["JobState"] == "COMPLETED", job.logs()
    assert_every_step_trained_once(job.out)
    assert (job.out / "plots" / "index.html").exists()
    output = job.output.read_text()
    assert f"i3core: attempt {job.id}.0 of job {job.id}" in output and "i3core: run quickstart completed" in output
    trainer, server, orchestrator = (subprocess.run(["scontrol", "show", "hostnames", info_nodes], text=True,
                                                    capture_output=True).stdout.split()
                                     for info_nodes in _component_nodes(job))
    assert len({*trainer, *server, *orchestrator}) == 3  # a node each
    resubmitted = run_cli("launch", "--submit", str(cluster_config), "--gpus-per-node", "0", cwd=cluster_config.parent)
    assert resubmitted.returncode == 1 and resubmitted.stderr.splitlines() == [
        f"error: {job.out} holds an earlier run (checkpoint step_6): continue it with --resume, or set another "
        "run.output_dir (or delete that directory)"]


def _component_nodes(job: Job) -> list[str]:
    text = subprocess.run(["scontrol", "-o", "show", "job", job.id], capture_output=True, text=True).stdout
    return [re.search(r"\bNodeList=(\S+)", line).group(1) for line in text.splitlines()]


def test_a_requeued_job_trains_every_step_exactly_once(long_cluster_config, jobs):
    jobs.append(job := Job(long_cluster_config))
    job.wait_for_step(3)
    requeue = subprocess.run(["scontrol", "requeue", job.id], capture_output=True, text=True, timeout=20)
    assert requeue.returncode == 0, requeue.stderr
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.logs()
    rows = assert_every_step_trained_once(job.out, LONG_STEPS)
    output = job.output.read_text()  # appended to by both attempts
    assert f"i3core: attempt {job.id}.0 " in output and f"i3core: attempt {job.id}.1 " in output
    trainer_log = (job.out / "logs" / f"trainer-{job.id}-0.log").read_text()
    assert trainer_log.count("=== i3core: attempt") == 2
    resumed_from = json.loads((job.out / "ATTEMPT.json").read_text())
    assert resumed_from["attempt"] == f"{job.id}.1" and resumed_from["step"] >= 2
    # the second attempt's servers started from the checkpoint's weights: the trainer agrees with their logprobs
    first = rows[resumed_from["step"]] if resumed_from["step"] < LONG_STEPS else None
    if first is not None and first["mismatch/same_version_tokens"]:
        assert first["mismatch/same_version_abs_diff"] < 1e-4


def test_a_lost_trainer_fails_the_job_and_a_resubmission_resumes(long_cluster_config, jobs):
    jobs.append(job := Job(long_cluster_config))
    job.wait_for_step(3)
    kill = subprocess.run(["scancel", "--signal=KILL", job.role_step("trainer")], capture_output=True, text=True,
                          timeout=20)
    assert kill.returncode == 0, kill.stderr
    info = job.finish()
    assert info["JobState"] == "FAILED", job.logs()
    failed = [line for line in job.output.read_text().splitlines() if line.startswith("i3core: the trainer failed")]
    assert failed and re.match(r"i3core: the trainer failed with exit code \d+", failed[0]), job.logs()
    assert info["ExitCode"].split(":")[0] != "0"
    last = checkpoint.latest(job.out / "checkpoints")
    assert last is not None and last >= 2
    jobs.append(again := Job(long_cluster_config, "--resume"))
    info = again.finish()
    assert info["JobState"] == "COMPLETED", again.logs()
    assert_every_step_trained_once(again.out, LONG_STEPS)
    assert json.loads((again.out / "ATTEMPT.json").read_text()) == {"attempt": f"{again.id}.0", "step": last}


def test_sigterm_before_the_time_limit_checkpoints_and_the_job_requeues_itself(long_cluster_config, jobs):
    """What ``--signal=B:TERM@120`` delivers before a time limit, sent now: SIGTERM to the job script alone."""
    jobs.append(job := Job(long_cluster_config))
    job.wait_for_step(3)
    term = subprocess.run(["scancel", "--signal=TERM", "--batch", job.id], capture_output=True, text=True,
                          timeout=20)
    assert term.returncode == 0, term.stderr
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.logs()
    output = job.output.read_text()
    assert "i3core: SIGTERM (JobState=RUNNING): the trainer checkpoints its last step" in output, job.logs()
    assert f"i3core: job {job.id} requeues itself" in output
    trainer_log = (job.out / "logs" / f"trainer-{job.id}-0.log").read_text()
    stopped = re.search(r"error: stopped on SIGTERM: checkpoint step_(\d+) written", trainer_log)
    assert stopped and int(stopped.group(1)) < LONG_STEPS, job.logs()
    # the second attempt started from the checkpoint the SIGTERM wrote, not an older one
    assert json.loads((job.out / "ATTEMPT.json").read_text()) == {"attempt": f"{job.id}.1",
                                                                  "step": int(stopped.group(1))}
    assert_every_step_trained_once(job.out, LONG_STEPS)
