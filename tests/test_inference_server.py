"""The builtin inference server as real processes on 127.0.0.1: API, logprobs, updates, bad requests."""

import asyncio

import aiohttp
import pytest
import torch

from i3core.errors import ServerError
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.plugins.weight_sync.filesystem import STABLE
from i3core.testing import make_component

from .conftest import wait_until_running

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One builtin server (started by the rollout source) on a tiny-moe saved with save_hf."""
    root = tmp_path_factory.mktemp("served")
    component = make_component("model", "tiny-moe", **SMALL)
    model = component.build(seed=0)
    component.save_hf(model, root / "v0")
    component.save_hf(component.build(seed=1), root / "v1")
    for version in ("v0", "v1"):
        (root / version / STABLE).write_text("")
    source = make_component("rollout_source", "builtin", servers=1, max_slots=8, max_len=512)
    (url,) = source.start(root / "v0", root / "logs")
    yield url, model, root
    source.close()


def run(coro):
    return asyncio.run(coro)


async def post(url, path, payload=None, data=None):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=payload, data=data) as response:
            return response.status, await response.json(content_type=None)


def test_completion_logprobs_match_the_trainer_forward(served):
    url, model, _ = served
    prompt = build_tokenizer().encode("reverse abc:").ids
    status, body = run(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "seed": 3, "n": 2,
                                                     "stop_token_ids": []}))
    assert status == 200 and len(body["choices"]) == 2
    for choice in body["choices"]:
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model.logits(model(ids)), dim=-1)[0]
        ref = torch.stack([logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(choice["token_ids"])])
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert (ref - got).abs().mean() < 1e-4
        assert choice["versions"] == [0] * 10


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"prompt": []}, "prompt must be"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be an integer"),
        ({"prompt": [1, 99999]}, "prompt token ids must be in"),
        ({"prompt": [1], "temperature": -1}, "temperature must be"),
        ({"prompt": [1], "n": 1000}, "n must be an integer"),
        ({"prompt": list(range(250)) * 3}, "this server holds at most"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(served, payload, message):
    url, _, _ = served
    status, body = run(post(url, "/v1/completions", payload))
    assert status == 400 and message in body["error"]["message"]
    status, _ = run(post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}))
    assert status == 200


def test_malformed_json_is_400(served):
    url, _, _ = served
    status, body = run(post(url, "/v1/completions", data=b"{not json"))
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_chat_completions(served):
    url, _, _ = served
    status, body = run(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 4}))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    status, body = run(post(url, "/v1/chat/completions", {"messages": [{"role": 1}]}))
    assert status == 400


def test_update_weights_mid_generation_and_pause_resume(served):
    url, _, root = served

    async def scenario():
        client = InferenceClient(url, build_tokenizer(), stop_token_ids=[])
        try:
            long = asyncio.create_task(client.complete("abc", max_tokens=500, temperature=1.0, seed=1))
            await wait_until_running(client, task=long)
            await client.pause()  # stop between two steps, swap, go on: the same sequence continues
            await client.update_weights(str(root / "v1"), version=1)
            await client.resume()
            completion = await long
            assert (await client.health())["version"] == 1
            with pytest.raises(ServerError, match="400"):
                await client.update_weights(str(root / "missing"), version=2)
            (root / "unfinished").mkdir()
            with pytest.raises(ServerError, match="STABLE"):  # a version still being written is never read
                await client.update_weights(str(root / "unfinished"), version=2)
            with pytest.raises(ServerError, match="receives weights from a path only"):
                await client.update_weights(None, version=2)
            await client.pause()
            paused = asyncio.create_task(client.complete("abc", max_tokens=3, temperature=1.0))
            await asyncio.sleep(0.3)
            assert not paused.done()
            await client.resume()
            after = await paused
            await client.update_weights(str(root / "v0"), version=2)
            return completion, after
        finally:
            await client.close()

    completion, after = run(scenario())
    versions = completion.versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert after.versions == [1, 1, 1]


def test_health_and_metrics(served):
    url, _, _ = served

    async def get(path):
        async with aiohttp.ClientSession() as session:
            async with session.get(url + path) as response:
                return await response.json()

    assert run(get("/health"))["status"] == "ok"
    metrics = run(get("/metrics"))
    assert metrics["max_slots"] == 8 and metrics["tokens_generated"] > 0
