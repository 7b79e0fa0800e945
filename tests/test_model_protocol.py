"""The Model protocol: the builtin server serves any model component that meets it, found by name.

A second, minimal model plugin (a bigram LM: each token's logits depend on that token alone, so its KV
cache is empty) is registered for the test only, served by the builtin server, and its completions come back
with logprobs that match the model and with per-token policy versions across an in-flight update.
"""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save_file
from torch import nn

from i3core import hookimpl
from i3core.errors import I3Error
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.inference.server import builtin_server, make_app, model_component
from i3core.plugins.models.tiny_moe.tokenizer import EOS, IM_END, build_tokenizer, token_id
from i3core.protocols import CausalLM, Model
from i3core.testing import make_component, plugin_manager
from i3core.weights import STABLE, read_hf_tensors


class BigramLM(nn.Module):
    """``logits(forward(ids))[t]`` depends on ``ids[t]`` only; the whole model is one ``[V, V]`` table."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids, position_ids=None):
        return self.table(input_ids)

    def logits(self, hidden):
        return hidden

    def new_kv_cache(self, slots, max_len):
        return None  # nothing to remember: the next token depends on the last one alone

    def forward_cached(self, input_ids, positions, cache, slots):
        return self.table(input_ids)

    def state_dict_from_hf(self, tensors):
        if set(tensors) != {"bigram.weight"} or tensors["bigram.weight"].shape != self.table.weight.shape:
            raise ValueError(f"bigram weights do not fit: {sorted(tensors)}")
        return {"table.weight": tensors["bigram.weight"]}


class Bigram:
    """A model component over :class:`BigramLM` with tiny-moe's byte tokenizer and ChatML."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, config):
        self.config = config

    def build(self, seed=0):
        torch.manual_seed(seed)
        return BigramLM(build_tokenizer().get_vocab_size())

    def parallelize(self, model, *, world, checkpoint, seq_len):
        assert world == 1

    def train_flops(self, model, position_ids, real):
        return 0.0

    def hf_tensors(self, model):
        yield "bigram.weight", model.table.weight.detach()

    def save_hf(self, model, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"vocab_size": model.vocab_size}))
        save_file(dict(self.hf_tensors(model)), str(path / "model.safetensors"))
        return path

    def load_hf(self, path):
        model = self.build()
        assert json.loads((Path(path) / "config.json").read_text())["vocab_size"] == model.vocab_size
        model.load_state_dict(model.state_dict_from_hf(read_hf_tensors(Path(path))))
        return model

    def tokenizer(self):
        return build_tokenizer()

    def render_chat(self, messages, tools=None):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
            "<|im_start|>assistant\n"

    eos_token_id = token_id(EOS)
    end_of_turn_ids = [token_id(IM_END)]


class BigramPlugin:
    @hookimpl
    def i3_register_models(self, register):
        register("bigram", Bigram)


def test_tiny_moe_meets_the_model_protocol(builtins):
    component = make_component("model", "tiny-moe", plugins=builtins, hidden_size=32, num_layers=1,
                               num_experts=2, experts_per_token=1, moe_intermediate_size=16)
    assert isinstance(component, Model)
    assert isinstance(component.build(seed=0), CausalLM)


def publish(component, model, root: Path, version: int) -> Path:
    directory = component.save_hf(model, root / f"step_{version}")
    (directory / STABLE).touch()
    return directory


@pytest.mark.slow
def test_builtin_server_serves_a_second_model_plugin(tmp_path):
    plugins = plugin_manager(BigramPlugin(), installed=False)
    component = model_component("bigram", {}, plugins)  # found by name, as `--model bigram` finds it
    assert isinstance(component, Model)
    assert isinstance(component.build(), CausalLM)
    v0, v1 = component.build(seed=0), component.build(seed=1)
    dir0, dir1 = publish(component, v0, tmp_path, 0), publish(component, v1, tmp_path, 1)
    server = builtin_server(dir0, component, max_slots=4, max_len=64, version=0)

    def logprobs_under(model, prompt_ids, token_ids):
        ids = torch.tensor(prompt_ids + token_ids)
        with torch.no_grad():
            table = torch.log_softmax(model.logits(model(ids)), dim=-1)
        last = len(prompt_ids) - 1
        return [float(table[last + i, tok]) for i, tok in enumerate(token_ids)]

    async def scenario():
        http = TestServer(make_app(server), host="127.0.0.1")
        await http.start_server()
        client = InferenceClient(str(http.make_url("")).rstrip("/"), component.tokenizer(), stop_token_ids=[])
        try:
            first = await client.complete("abc", max_tokens=8, temperature=1.0, seed=0)
            assert len(first.token_ids) == len(first.logprobs) == len(first.versions) == 8
            assert first.versions == [0] * 8
            assert first.logprobs == pytest.approx(logprobs_under(v0, first.prompt_ids, first.token_ids), abs=1e-5)
            await client.update_weights(str(dir1), 1)
            second = await client.complete("abc", max_tokens=8, temperature=1.0, seed=0)
            assert second.versions == [1] * 8
            assert second.logprobs == pytest.approx(logprobs_under(v1, second.prompt_ids, second.token_ids),
                                                    abs=1e-5)
            chat = await client._post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4, "temperature": 0})
            choice = chat["choices"][0]
            assert len(choice["token_logprobs"]) == len(choice["versions"]) > 0
            assert set(choice["versions"]) == {1}
        finally:
            await client.close()
            await http.close()

    asyncio.run(scenario())


def test_a_model_without_the_servers_part_is_refused_in_one_line(tmp_path):
    train_only = type("TrainOnly", (), {"build": Bigram.build})()  # a model served by vLLM only
    with pytest.raises(I3Error, match="cannot be served by the builtin server .*load_hf, render_chat"):
        builtin_server(tmp_path, train_only, max_slots=1, max_len=8, version=0)
