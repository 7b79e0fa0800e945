"""``[env] use = "verifiers"``: a verifiers 0.4 taskset played through verifiers' own training client.

Each rollout is one verifiers episode of the example's task: verifiers' harness (``null`` by default, a plain
chat loop) runs in its runtime (``subprocess`` by default: nothing hosted unless configured), its model calls go
through verifiers' interception to its ``TrainClientConfig`` client, which renders the chat with the tokenizer
at ``renderer_model`` (it must carry a chat template) and posts token ids to the run's server at
``/inference/v1/generate`` under ``X-Session-ID`` = the trace's id. The episode's one trainable branch becomes the
Rollout: token ids, the loss mask from ``sampled_mask``, the server's logprobs, and the per-token policy versions
read back from the server's record of that session (``GET /inference/v1/sessions/{id}``). A failed episode, a
framework-truncated one (``max_turns``, token limits), an episode with several trainable branches, one whose
tokens disagree with the server's record, or one that no reward function scored (``verifiers_unscored``: no
reward recorded, or ``trace.reward`` None; its reward would not judge it) is masked with that reason.

Imports: the contract and modules of its own kind (envs); verifiers itself (the ``verifiers`` extra).
"""

from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from i3core.errors import I3Error, Problem, RolloutMasked
from i3core.plugins.envs.base import ENV_TOKEN_VERSION
from i3core.types import Example, Rollout

FRAMEWORK_LIMITS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed")
"""verifiers stop conditions that cut an episode short: its reward does not judge a finished episode."""


class VerifiersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="The verifiers taskset id: an installed package exporting its Taskset in __all__.")
    args: dict[str, Any] = Field(default_factory=dict, description="The taskset's config fields.")
    renderer_model: str | None = Field(
        None, description="Tokenizer directory with the chat template verifiers' training client renders with "
                          "(default: the served model's directory, which the builtin server reports as its name).")
    harness: dict[str, Any] = Field(default_factory=lambda: {"id": "null"},
                                    description="verifiers harness config (default: the null chat loop).")
    runtime: dict[str, Any] = Field(default_factory=lambda: {"type": "subprocess"},
                                    description="verifiers runtime config (default: a local subprocess).")
    max_turns: int | None = Field(None, ge=1, description="verifiers' max_turns for the agent (None: its own).")
    max_tokens: int = Field(32, ge=1, description="Completion length limit per turn.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    seed: int = Field(0, description="Unused by verifiers tasksets (their order is their own); kept for the run.")

    @field_validator("id")
    @classmethod
    def _installed(cls, value: str) -> str:
        try:
            from verifiers.v1.utils.loaders import taskset_class
        except ModuleNotFoundError:
            raise ValueError("env verifiers needs verifiers 0.4: pip install 'i3core[verifiers]'") from None

        try:
            taskset_class(value)
        except ModuleNotFoundError:
            raise ValueError(f"verifiers taskset {value!r} is not installed (pip install its package)") from None
        except (TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"verifiers taskset {value!r} is not usable: {str(exc).splitlines()[0]}") from None
        return value


class VerifiersEnv:
    """The Environment protocol over a verifiers 0.4 env (see the module docstring)."""

    Config = VerifiersConfig
    requires_sandbox = False
    stop_text = "\n"

    @staticmethod
    def check_config(config: VerifiersConfig, run) -> list[Problem]:
        """verifiers' harness calls the model over HTTP: the rollouts need servers, not the in-process engine."""
        inference = run.get("inference")
        if inference is not None and inference.name == "local":
            return [Problem("inference.use", 'env verifiers calls the model over HTTP: use "builtin" (servers = N) '
                                             'or "vllm", not "local"')]
        return []

    def __init__(self, config: VerifiersConfig):
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import load_environment

        self.config = config
        agent: dict[str, Any] = {"harness": config.harness, "runtime": config.runtime}
        if config.max_turns is not None:
            agent["max_turns"] = config.max_turns
        self._vf = vf
        self._env = load_environment(vf.SingleAgentEnvConfig.model_validate(
            {"taskset": {"id": config.id, **config.args}, "agent": agent}))
        self._tasks = list(self._env.taskset)
        self._models: dict[str, str] = {}

    def examples(self) -> list[Example]:
        return [Example(id=str(task.key or i), prompt=task.data.prompt, info={"task": i})
                for i, task in enumerate(self._tasks)]

    async def _served_name(self, session: aiohttp.ClientSession, base_url: str) -> str:
        if base_url not in self._models:
            async with session.get(base_url + "/v1/models") as response:
                self._models[base_url] = (await response.json())["data"][0]["id"]
        return self._models[base_url]

    async def rollout(self, client: Any, example: Example) -> Rollout:
        vf = self._vf
        base_url = client.base_url
        # the client's headers carry the run's admin token: the session routes ask for it
        async with aiohttp.ClientSession(headers=getattr(client, "headers", None)) as session:
            model = await self._served_name(session, base_url)
            renderer = self.config.renderer_model or model
            if not (Path(renderer) / "tokenizer_config.json").is_file():
                raise I3Error(f"env verifiers: no tokenizer directory to render chats with at {renderer!r} (the "
                              "served model's name): set [env] renderer_model to the model's directory")
            train = vf.TrainClientConfig(base_url=base_url + "/v1", api_key_var="I3CORE_VERIFIERS_NO_KEY",
                                         renderer_model_name=renderer)
            ctx = vf.ModelContext(model=model, client=train, sampling=vf.Sampling(
                max_tokens=self.config.max_tokens, temperature=self.config.temperature))
            task = self._tasks[example.info["task"]]
            async with self._env.serving():
                (slot,) = self._env.slots(task, 1)
                episode = await self._env.run_slot(slot, ctx)
            records = {}
            for trace in episode.traces:
                async with session.get(f"{base_url}/inference/v1/sessions/{trace.id}") as response:
                    records[trace.id] = (await response.json())["turns"] if response.status == 200 else []
                async with session.delete(f"{base_url}/inference/v1/sessions/{trace.id}"):
                    pass
        return to_rollout(example, episode, records)


def to_rollout(example: Example, episode: Any, records: dict[str, list[dict]]) -> Rollout:
    """The episode's one trainable branch as a Rollout, versions from the server's ``records`` (trace id -> turns)."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        raise RolloutMasked("verifiers_failed", "; ".join(e.message.splitlines()[0] for e in errors if e.message))
    branches = [(t, b) for t in episode.traces if t.agent.trainable for b in t.branches if b.trainable]
    if len(branches) != 1:
        raise RolloutMasked("verifiers_branches", f"{len(branches)} trainable branches (one is supported)")
    trace, branch = branches[0]
    if trace.is_timeout or trace.stop_condition in FRAMEWORK_LIMITS:
        raise RolloutMasked("verifiers_truncated", trace.stop_condition or "timeout")
    ids, mask, logprobs = list(branch.token_ids), list(branch.sampled_mask), list(branch.logprobs)
    if True not in mask:
        raise RolloutMasked("verifiers_no_tokens", "the branch has no sampled tokens")
    start = mask.index(True)
    served = [(t, v) for turn in records.get(trace.id, []) for t, v in zip(turn["token_ids"], turn["versions"])]
    sampled = [t for t, m in zip(ids, mask) if m]
    if [t for t, _ in served] != sampled:
        raise RolloutMasked("verifiers_version_record", "the server's session record differs from the branch")
    reward = episode_reward(trace)
    if reward is None:
        raise RolloutMasked("verifiers_unscored", "no reward function scored the episode (stop condition: "
                                                  f"{trace.stop_condition or 'none'})")
    versions = iter(v for _, v in served)
    metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    metrics.update({f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None})
    return Rollout(
        example=example, prompt_ids=ids[:start], completion_ids=ids[start:],
        completion_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:])],
        completion_versions=[next(versions) if m else ENV_TOKEN_VERSION for m in mask[start:]],
        completion_mask=mask[start:], completion_text=trace.messages[-1].content or "" if trace.messages else "",
        reward=reward, metrics=metrics, finish_reason=_finish_reason(trace))


def episode_reward(trace: Any) -> float | None:
    """The trace's reward, or None when nothing scored it (``trace.reward`` None, or no reward recorded: verifiers
    then sums nothing to 0, which would train as a real reward of 0)."""
    reward = getattr(trace, "reward", None)
    rewards = getattr(trace, "rewards", None)
    if reward is None or (rewards is not None and all(r is None for r in rewards.values())):
        return None
    return float(reward)


def _finish_reason(trace: Any) -> str | None:
    """Why the trace's last successful model call ended (verifiers' normalised ``stop``/``length``/``tool_calls``)."""
    last = next((c for c in reversed(getattr(trace, "calls", None) or []) if c.error is None), None)
    return None if last is None else last.finish_reason
