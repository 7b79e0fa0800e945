"""``async``: keep ``inflight`` rollouts running; train on whatever groups finish first.

The textbook on-policy loop generates a batch, waits for its slowest rollout,
trains, then updates (that is the ``sync`` scheduler). Here generation does
not wait for a batch to be trained: a finished rollout's slot is taken at once by the
next rollout (the rest of a prompt group, or a new prompt group on the next
server in round robin) as long as it will be trained at most ``max_async``
versions after the weights that sample it; a batch is cut from the groups that
finished first, the trainer may run up to ``max_async`` steps ahead of the
weights the servers hold, and groups whose oldest token is more than
``max_off_policy_steps`` versions behind the step that trains on them are
dropped whole.
"""

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AsyncScheduler:
    """Continuous batching at prompt-group level with a bound on off-policy staleness."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        group_size: int = Field(16, ge=1, description="Rollouts per prompt (advantages are group-relative).")
        batch_size: int = Field(128, ge=1, description="Rollouts per trainer step; a multiple of group_size.")
        inflight: int = Field(64, ge=1, description="Rollouts kept generating at once, over all servers.")
        max_off_policy_steps: int = Field(8, ge=0, description="Drop groups older than this many versions.")
        max_async: int = Field(1, ge=0, description="Trainer steps the batches may run ahead of served weights; also how "
                                                   "many versions a group may be sampled before the weights it trains.")
        weight_update_lag: int = Field(
            0, ge=0, description="Serve version N only once the trainer has N + lag (forces staleness, for ablations)."
        )

        @model_validator(mode="after")
        def _multiples(self):
            if self.batch_size % self.group_size:
                raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
            if self.weight_update_lag > self.max_async:
                raise ValueError(
                    f"weight_update_lag ({self.weight_update_lag}) needs max_async >= it (now {self.max_async}), "
                    "or the trainer would wait forever"
                )
            return self

    def __init__(self, config: Config):
        self.config = config

    @property
    def group_size(self) -> int:
        return self.config.group_size

    @property
    def groups_per_batch(self) -> int:
        return self.config.batch_size // self.config.group_size

    @property
    def rollout_slots(self) -> int:
        return self.config.inflight

    @property
    def weight_update_lag(self) -> int:
        return self.config.weight_update_lag

    def may_start_group(self, step: int, served_version: int, open_groups: int) -> bool:
        """Whether a group started now, on the weights the servers hold, is at most ``max_async`` versions behind
        the weights it will be trained on.

        The groups started and not yet trained (``open_groups``) fill the batches of ``step``, ``step + 1``...
        in turn, so a new group joins the batch of ``step + open_groups // groups_per_batch``, which trains
        version ``step - 1 + open_groups // groups_per_batch``. Free slots are refilled at once while that
        holds. Without the bound an engine faster than the trainer piles up finished groups that are trained
        long after they were sampled (measured on the quickstart's local engine: a mean of 7-8 versions
        off-policy, groups dropped as stale, and less learned per step); with it the engine waits for newer
        weights instead of producing rollouts that would be stale.
        """
        joins = step + open_groups // self.groups_per_batch
        return (joins - 1) - served_version <= self.config.max_async

    def may_cut(self, step: int, served_version: int) -> bool:
        """Whether the batch of ``step`` may be handed over: at most ``max_async`` steps ahead of the servers."""
        return step - 1 - served_version <= self.config.max_async

    def is_stale(self, oldest_version: int, step: int) -> bool:
        """Whether a group whose oldest token has ``oldest_version`` is too old for trainer ``step``.

        The batch of step ``step`` trains weights of version ``step - 1``.
        """
        return (step - 1) - oldest_version > self.config.max_off_policy_steps
