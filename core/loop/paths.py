"""Where the roles of one run exchange files under its output directory; nothing else (imports no i3core module)."""

from pathlib import Path

STOP = "STOP"
"""Written by the orchestrator under the run directory when the trainer should finish."""
ATTEMPT = "ATTEMPT.json"
"""The trainer's marker of its attempt: its id and the version it started from (:mod:`i3core.loop.resume`)."""
RESTART = "RESTART"
"""Written by a restarted orchestrator: the trainer checkpoints and exits to start a new attempt."""


class RunPaths:
    """Where the roles of one run exchange files."""

    def __init__(self, out: Path):
        self.out = out
        self.batches = out / "batches"
        self.parts = out / "batch_parts"
        """``step_N_K.pt``: the K-th early part of step N's batch (``[trainer] stream_groups``), until N is trained."""
        self.broadcasts = out / "broadcasts"
        self.trainer = out / "trainer"
        self.checkpoints = out / "checkpoints"
        self.orchestrator = out / "orchestrator"
        self.rollouts = out / "rollouts"
        """``step_N.jsonl``: every rollout accounted at step N, for a person to read (:mod:`i3core.loop.rollouts`)."""

    def batch(self, step: int) -> Path:
        return self.batches / f"step_{step}.pt"

    def batch_part(self, step: int, part: int) -> Path:
        return self.parts / f"step_{step}_{part}.pt"

    def trainer_metrics(self, step: int) -> Path:
        return self.trainer / f"step_{step}.json"

    def orchestrator_state(self, step: int) -> Path:
        """The orchestrator's state when it cut the batch of ``step`` (copied into that step's checkpoint)."""
        return self.orchestrator / f"step_{step}.json"

    def stop(self) -> Path:
        return self.out / STOP

    def attempt(self) -> Path:
        return self.out / ATTEMPT

    def restart(self) -> Path:
        return self.out / RESTART

    def request_stop(self) -> None:
        """Tell the trainer to finish. On a full disk the file may not be creatable: the trainer also stops
        when the run's process is gone (:mod:`i3core.lifetime`)."""
        try:
            self.stop().touch()
        except OSError:
            pass

    def make(self) -> None:
        for path in (self.batches, self.parts, self.broadcasts, self.trainer, self.checkpoints, self.orchestrator):
            path.mkdir(parents=True, exist_ok=True)
