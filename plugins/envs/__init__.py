"""Built-in environments, and the environment library plugin authors build on.

The hierarchy, each level adding one capability: :class:`Environment`
(dataset, rubric, ``rollout``), :class:`SingleTurnEnv` (one text
completion), :class:`MultiTurnEnv` (chat turns, ``env_response``, stop
conditions, timeouts), :class:`ToolEnv` (Python functions as tools),
:class:`StatefulToolEnv` (hidden tool arguments from the rollout state),
:class:`SandboxEnv` (a sandbox per rollout), :class:`CodeEnv` (the model's
program against tests, in the sandbox). :class:`EnvGroup` mixes envs.
"""

from i3core import hookimpl
from i3core.plugins.envs.arithmetic import Arithmetic
from i3core.plugins.envs.base import EnvConfig, Environment, SingleTurnConfig, SingleTurnEnv, Trajectory
from i3core.plugins.envs.code import CodeEnv
from i3core.plugins.envs.group import EnvGroup
from i3core.plugins.envs.multiturn import MultiTurnConfig, MultiTurnEnv
from i3core.plugins.envs.reasoning_gym_env import ReasoningGym
from i3core.plugins.envs.reverse_text import ReverseText
from i3core.plugins.envs.rubric import Rubric
from i3core.plugins.envs.sandbox import SandboxConfig, SandboxEnv
from i3core.plugins.envs.tool_calc import ToolCalc
from i3core.plugins.envs.tools import StatefulToolEnv, ToolConfig, ToolEnv, tool_schema
from i3core.plugins.envs.verifiers_env import VerifiersEnv


@hookimpl
def i3_register_envs(register):
    register("arithmetic", Arithmetic)
    register("reverse-text", ReverseText)
    register("tool-calc", ToolCalc)
    register("group", EnvGroup)
    register("code", CodeEnv)
    register("reasoning-gym", ReasoningGym)
    register("verifiers", VerifiersEnv)  # a verifiers 0.4 taskset (the `verifiers` extra)


__all__ = ["CodeEnv", "EnvConfig", "EnvGroup", "Environment", "MultiTurnConfig", "MultiTurnEnv", "Rubric",
           "SandboxConfig", "SandboxEnv", "SingleTurnConfig", "SingleTurnEnv", "StatefulToolEnv", "ToolConfig", "ToolEnv",
           "Trajectory", "tool_schema"]
