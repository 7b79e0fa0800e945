"""``async``: keep ``inflight`` rollouts running at all times; train on whatever groups finish first.

The textbook on-policy loop generates a batch, waits for its slowest rollout,
trains, then updates. Here generation never stops: a finished group's slots
are refilled at once, a batch is cut from the groups that finished first, the
trainer may run up to ``max_async`` steps ahead of the weights the servers
hold, and groups whose oldest token is more than ``max_off_policy_steps``
versions behind the step that trains on them are dropped whole.
"""

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AsyncScheduler:
    """Continuous batching at prompt-group level with a bound on off-policy staleness."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        group_size: int = Field(16, ge=1, description="Rollouts per prompt (advantages are group-relative).")
        batch_size: int = Field(128, ge=1, description="Rollouts per trainer step; a multiple of group_size.")
        inflight: int = Field(64, ge=1, description="Rollouts kept generating at once; a multiple of group_size.")
        max_off_policy_steps: int = Field(8, ge=0, description="Drop groups older than this many versions.")
        max_async: int = Field(1, ge=0, description="Trainer steps the batches may run ahead of served weights.")
        weight_update_lag: int = Field(
            0, ge=0, description="Serve version N only once the trainer has N + lag (forces staleness, for ablations)."
        )

        @model_validator(mode="after")
        def _multiples(self):
            for name in ("batch_size", "inflight"):
                if getattr(self, name) % self.group_size:
                    raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of group_size ({self.group_size})")
            if self.weight_update_lag > self.max_async:
                raise ValueError(
                    f"weight_update_lag ({self.weight_update_lag}) needs max_async >= it (now {self.max_async}), "
                    "or the trainer would wait forever"
                )
            return self

    def __init__(self, config: Config):
        self.config = config

    @property
    def groups_inflight(self) -> int:
        return self.config.inflight // self.config.group_size

    @property
    def groups_per_batch(self) -> int:
        return self.config.batch_size // self.config.group_size

    def is_stale(self, oldest_version: int, step: int) -> bool:
        """Whether a group whose oldest token has ``oldest_version`` is too old for trainer ``step``.

        The batch of step ``step`` trains weights of version ``step - 1``.
        """
        return (step - 1) - oldest_version > self.config.max_off_policy_steps
