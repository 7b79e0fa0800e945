"""Multi-turn rollouts against a real builtin server: the trained sequence is exactly what was sampled.

The trainer-side forward over the whole trajectory (prompt, model turns, env
turns) must reproduce every logprob the server returned for the model's tokens,
which only holds if no turn was re-tokenised on the way.
"""

import asyncio

import pytest
import torch

from i3core.plugins.envs import MultiTurnConfig, MultiTurnEnv
from i3core.plugins.envs.chat import IM_END, ChatML
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import make_component
from i3core.types import Example

pytestmark = pytest.mark.slow

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}
SHORT_TURNS = list(range(128))
"""Stop ids for the test: half the byte tokens, so an untrained model's turns end after a token or two."""


class ShortTurns(ChatML):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stop_ids = [tokenizer.token_to_id(IM_END), *SHORT_TURNS]


class Again(MultiTurnEnv):
    """The env answers every model turn with 'again' until max_turns."""

    def load_examples(self):
        return [Example(f"e{i}", f"say something {i}") for i in range(4)]

    async def env_response(self, messages, state):
        return [{"role": "user", "content": "again"}]

    def renderer(self, client):
        return ShortTurns(client.tokenizer)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("env-server")
    component = make_component("model", "tiny-moe", **SMALL)
    model = component.build(seed=0)
    component.save_hf(model, root / "v0")
    source = make_component("rollout_source", "builtin", servers=1, max_slots=8, max_len=512)
    (url,) = source.start(root / "v0", root / "logs")
    yield url, model
    source.close()


def test_multi_turn_trajectory_logprobs_match_the_trainer_forward(server):
    url, model = server
    tok = build_tokenizer()
    env = Again(MultiTurnConfig(max_turns=4, max_tokens=12, max_total_tokens=400))

    async def rollouts():
        client = InferenceClient(url, tok)
        try:
            return await asyncio.gather(*(env.rollout(client, e) for e in env.examples()))
        finally:
            await client.close()

    for rollout in asyncio.run(rollouts()):
        assert rollout.metrics["stop/max_turns"] == 1.0 and rollout.metrics["turns"] == 4
        ids = rollout.prompt_ids + rollout.completion_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model.logits(model(torch.tensor([ids]))).float(), dim=-1)[0]
        start = len(rollout.prompt_ids)
        model_tokens = [i for i, m in enumerate(rollout.completion_mask) if m]
        ref = torch.stack([logprobs[start + i - 1, rollout.completion_ids[i]] for i in model_tokens])
        got = torch.tensor([rollout.completion_logprobs[i] for i in model_tokens])
        assert (ref - got).abs().max() < 1e-3, (ref - got).abs().max()
        env_text = tok.decode([t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if not m],
                              skip_special_tokens=False)
        assert env_text.count("<|im_start|>user\nagain<|im_end|>") == 3
        assert set(rollout.completion_turns) == {0, 1, 2, 3}
        assert all(v == 0 for v, m in zip(rollout.completion_versions, rollout.completion_mask) if m)
