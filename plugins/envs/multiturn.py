"""``MultiTurnEnv``: a chat between the model and the env, turn after turn, tokens in and tokens out.

Adds to :class:`~i3core.plugins.envs.base.Environment`: a chat prompt (a list
of messages), ``env_response`` after each model turn, stop conditions
(``is_completed``, ``max_turns``, a token budget, truncation) and timeouts
(the whole rollout, and each env response).

Token accounting (see :mod:`i3core.plugins.envs.chat`): the prompt is
rendered once; each model turn is the exact ids the server sampled (loss
mask 1, its logprobs and per-token versions); each env response is rendered
alone and appended (loss mask 0). The next request sends the whole sequence
as token ids, so the model always continues exactly what it saw.

Stop reasons (``state["stop_reason"]``, also the metric ``stop/<reason>``):
``completed`` (``is_completed``), ``max_turns``, ``truncated`` (a turn hit
``max_tokens``), ``length`` (no room left under ``max_total_tokens``),
``timeout`` (``timeout_s``), ``env_timeout`` (an env response took longer
than ``env_timeout_s``). A rollout that stops early is still scored and
trained on.

Per-turn rewards (for ``credit = "turn"``): ``env_response`` may set
``state["turn_reward"]`` to reward the model turn it answers; the rubric's
reward goes to the last turn. The rollout's reward is the sum of both.
"""

import asyncio

from pydantic import Field, model_validator

from i3core.plugins.envs.base import EnvConfig, Environment, Trajectory
from i3core.plugins.envs.chat import ChatRenderer, encode, renderer_for
from i3core.protocols import InferenceClient

STOP_REASONS = ("completed", "max_turns", "truncated", "length", "timeout", "env_timeout")


class MultiTurnConfig(EnvConfig):
    max_tokens: int = Field(64, ge=1, description="Tokens per model turn.")
    max_turns: int = Field(4, ge=1, description="Model turns per rollout.")
    max_total_tokens: int = Field(
        256, ge=8, description="Prompt + every turn, in tokens; keep it within the servers' max_len.")
    timeout_s: float | None = Field(None, gt=0, description="Wall-clock limit of a whole rollout (None: none).")
    env_timeout_s: float = Field(30.0, gt=0, description="Limit of one env response (tool calls included).")
    system_prompt: str | None = Field(None, description="Prepended to every prompt as a system message.")

    @model_validator(mode="after")
    def _budget(self):
        if self.max_tokens >= self.max_total_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be below max_total_tokens ({self.max_total_tokens})")
        return self


class MultiTurnEnv(Environment):
    """The model and the env take turns until a stop condition; subclasses define ``env_response``.

    ``example.prompt`` is a list of chat messages (a string is taken as one
    user message). Override :meth:`is_completed` to add a stop condition
    (call ``super()``), :meth:`env_response` for what the env says after
    each model turn, and :meth:`tool_specs` to offer tools in the prompt.
    """

    Config = MultiTurnConfig

    # -- what subclasses define ----------------------------------------------

    async def env_response(self, messages: list[dict], state: dict) -> list[dict]:
        """The env's messages after the model's last turn (``messages``: the whole chat so far)."""
        raise NotImplementedError(f"{type(self).__name__} must define env_response")

    async def is_completed(self, messages: list[dict], state: dict) -> bool:
        """Whether the rollout is over after the model's last turn (before ``env_response``)."""
        return False

    def tool_specs(self) -> list[dict] | None:
        """Tools offered in the prompt (OpenAI format); None: no tools."""
        return None

    def parse_reply(self, message: dict, state: dict) -> dict:
        """The assistant message built from one model turn; ``ToolEnv`` adds its ``tool_calls``."""
        return message

    def renderer(self, client: InferenceClient) -> ChatRenderer:
        """How messages become tokens, from the client's tokenizer (a chat template if it has one)."""
        return renderer_for(client.tokenizer)

    def max_rollout_tokens(self) -> int:
        return self.config.max_total_tokens

    def sft_ids(self, example, tokenizer) -> tuple[list[int], list[int]] | None:
        """The rendered prompt and the demonstration as one assistant turn, ended by its stop token."""
        demonstration = self.demonstration(example)
        if demonstration is None:
            return None
        renderer = renderer_for(tokenizer)
        prompt = renderer.prompt_ids(self.init_state(example)["prompt"], self.tool_specs())
        return prompt, encode(tokenizer, demonstration) + renderer.stop_ids[:1]

    # -- the loop ----------------------------------------------------------------

    def init_state(self, example) -> dict:
        state = super().init_state(example)
        prompt = example.prompt if isinstance(example.prompt, list) else [{"role": "user", "content": example.prompt}]
        if self.config.system_prompt is not None and (not prompt or prompt[0]["role"] != "system"):
            prompt = [{"role": "system", "content": self.config.system_prompt}, *prompt]
        state["prompt"] = prompt
        state["completion"] = []
        return state

    async def generate(self, client: InferenceClient, state: dict) -> None:
        renderer = self.renderer(client)
        state["trajectory"] = Trajectory(renderer.prompt_ids(state["prompt"], self.tool_specs()))
        try:
            async with asyncio.timeout(self.config.timeout_s):
                state["stop_reason"] = await self._turns(client, renderer, state)
        except TimeoutError:
            state["stop_reason"] = "timeout"
        state["metrics"]["turns"] = state["turn"]
        for reason in STOP_REASONS:
            state["metrics"][f"stop/{reason}"] = float(state["stop_reason"] == reason)

    async def _turns(self, client: InferenceClient, renderer: ChatRenderer, state: dict) -> str:
        cfg = self.config
        traj: Trajectory = state["trajectory"]
        while True:
            room = cfg.max_total_tokens - len(traj)
            if room <= 0:
                return "length"
            completion = await client.complete_ids(traj.all_ids, max_tokens=min(cfg.max_tokens, room),
                                                   temperature=cfg.temperature, stop_token_ids=renderer.stop_ids,
                                                   stop=[])
            traj.add_model(completion, state["turn"])
            state["turn_rewards"].append(0.0)
            message = {"role": "assistant", "content": renderer.reply_text(completion.token_ids)}
            state["completion"].append(self.parse_reply(message, state))
            state["turn"] += 1
            messages = state["prompt"] + state["completion"]
            if not completion.token_ids or completion.token_ids[-1] not in renderer.stop_ids:
                return "truncated"
            if await self.is_completed(messages, state):
                return "completed"
            if state["turn"] >= cfg.max_turns:
                return "max_turns"
            try:
                async with asyncio.timeout(cfg.env_timeout_s):
                    reply = await self.env_response(messages, state)
            except TimeoutError:
                return "env_timeout"
            state["turn_rewards"][-1] += state.pop("turn_reward", 0.0)
            ids = renderer.continuation_ids(reply)
            if len(traj) + len(ids) >= cfg.max_total_tokens:
                return "length"
            traj.add_env(ids, state["turn"] - 1)
            state["completion"].extend(reply)
