"""``SandboxEnv``: a sandbox per rollout, leased from the run's sandbox pool.

Adds to :class:`~i3core.plugins.envs.tools.StatefulToolEnv`: ``setup``
leases a sandbox from the pool the run binds (``bind_sandboxes``) and enters
the lease on the rollout's exit stack, so it is handed back (reset for reuse,
or closed) when the rollout ends, whatever happened: finished, failed or
cancelled. The sandbox is ``state["sandbox"]`` and its id
``state["sandbox_id"]``, the hidden argument of the ``shell`` tool (offered
when ``shell_tool`` is set). A sandbox that fails during the rollout masks it
(``RolloutMasked('sandbox_failed')``, raised by the pool).

Threat model: the model's code runs only inside the sandbox (the backend's
isolation is the boundary, see docs/sandboxes.md); this process only reads
what ``exec`` returns.
"""

from pydantic import Field

from i3core.errors import I3Error
from i3core.plugins.envs.tools import StatefulToolEnv, ToolConfig

MAX_SHELL_OUTPUT_CHARS = 1000
"""Characters of a ``shell`` call's stdout and stderr shown to the model, each."""


class SandboxConfig(ToolConfig):
    shell_tool: bool = Field(False, description="Offer the model a `shell` tool running commands in its sandbox.")
    exec_timeout_s: float = Field(10.0, gt=0, description="Timeout of each command run in the sandbox.")


class SandboxEnv(StatefulToolEnv):
    """A :class:`StatefulToolEnv` whose every rollout owns one sandbox from the run's pool."""

    Config = SandboxConfig
    requires_sandbox = True

    def __init__(self, config: SandboxConfig):
        super().__init__(config)
        self._pool = None
        self._sandboxes: dict[str, object] = {}
        if config.shell_tool:
            self.add_tool(self.shell, hidden=("sandbox_id",))

    def bind_sandboxes(self, pool) -> None:
        """Take the run's :class:`~i3core.sandbox.pool.SandboxPool` (the run calls it before the first rollout)."""
        self._pool = pool

    async def setup(self, state: dict) -> None:
        await super().setup(state)
        if self._pool is None:
            raise I3Error(f"{type(self).__name__} has no sandbox pool: the run binds one when [sandbox] is configured")
        sandbox = await state["stack"].enter_async_context(self._pool.lease())
        state["sandbox"], state["sandbox_id"] = sandbox, sandbox.id
        self._sandboxes[sandbox.id] = sandbox
        state["stack"].callback(self._sandboxes.pop, sandbox.id, None)
        state["stack"].callback(state.pop, "sandbox", None)  # the rollout's state outlives its lease

    async def shell(self, command: str, sandbox_id: str) -> str:
        """Run a shell command in your sandbox; returns its exit code, stdout and stderr.

        :param command: the command line, run by /bin/sh in the work directory
        """
        result = await self._sandboxes[sandbox_id].exec(command, timeout=self.config.exec_timeout_s)
        if result.timed_out:
            return f"timed out after {self.config.exec_timeout_s:g}s"
        return (f"exit code {result.exit_code}\nstdout:\n{result.stdout[:MAX_SHELL_OUTPUT_CHARS]}"
                f"\nstderr:\n{result.stderr[:MAX_SHELL_OUTPUT_CHARS]}")
