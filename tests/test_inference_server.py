"""The builtin inference server as real processes on 127.0.0.1: API, logprobs, updates, bad requests."""

import asyncio
import json

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from i3core.errors import ServerError
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.weights import STABLE
from i3core.testing import make_component

from .conftest import wait_until_running

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
         "experts_per_token": 2, "moe_intermediate_size": 32}

pytestmark = pytest.mark.slow


def two_versions(root):
    """Versions ``root/v0`` and ``root/v1`` of a small tiny-moe (seeds 0 and 1) saved with save_hf and marked
    STABLE; the model of v0."""
    component = make_component("model", "tiny-moe", **SMALL)
    model = component.build(seed=0)
    component.save_hf(model, root / "v0")
    component.save_hf(component.build(seed=1), root / "v1")
    for version in ("v0", "v1"):
        (root / version / STABLE).write_text("")
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One builtin server (started by the rollout source) on a tiny-moe saved with save_hf."""
    root = tmp_path_factory.mktemp("served")
    model = two_versions(root)
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
        ({"prompt": list(range(250)) * 3}, "maximum context length is 512 tokens"),
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
                return response.headers["Content-Type"], await response.text()

    assert json.loads(run(get("/health"))[1])["status"] == "ok"
    counters = json.loads(run(get("/i3/metrics"))[1])
    assert counters["max_slots"] == 8 and counters["tokens_generated"] > 0
    kind, text = run(get("/metrics"))
    assert kind.startswith("text/plain")
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "i3core:kv_slots_used", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert name in samples, name
    assert samples["i3core:kv_slots"].value == 8 and samples["i3core:kv_slots"].labels["model_name"]
    assert samples["vllm:generation_tokens_total"].value == counters["tokens_generated"]
    assert samples["vllm:prompt_tokens_total"].value > 0 and samples["vllm:time_to_first_token_seconds_count"].value > 0


MALFORMED = [
    # (method, path, raw body, status, words in the message)
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"\xff\xfe\x00{\x80}", 400, "not valid JSON"),  # not UTF-8
    ("POST", "/v1/completions", b"", 400, "must be a JSON object"),
    ("POST", "/v1/completions", b"[1, 2, 3]", 400, "must be a JSON object"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "the body is nested more than 64 deep"),
    ("POST", "/v1/completions", b'{"prompt": {"a": 1}}', 400, "prompt must be"),
    ("POST", "/v1/completions", b'{"prompt": [1, true]}', 400, "prompt must be"),
    ("POST", "/v1/completions", b'{"prompt": [1, -1]}', 400, "prompt token ids must be in"),
    ("POST", "/v1/completions", b'{"prompt": [1, 100000000000000000000000]}', 400, "prompt token ids must be in"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": "8"}', 400, "max_tokens must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 8.0}', 400, "max_tokens must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": -5}', 400, "max_tokens must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 1000000000000}', 400, "max_tokens must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 1e400}', 400, "max_tokens must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', 400, "temperature must be a finite"),
    ("POST", "/v1/completions", b'{"prompt": [1], "temperature": Infinity}', 400, "temperature must be a finite"),
    ("POST", "/v1/completions", b'{"prompt": [1], "temperature": "hot"}', 400, "temperature must be"),
    ("POST", "/v1/completions", b'{"prompt": [1], "stop_token_ids": 5}', 400, "stop_token_ids must be"),
    ("POST", "/v1/completions", b'{"prompt": [1], "seed": 1.5}', 400, "seed must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "n": true}', 400, "n must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokns": 4}', 400,
     "unknown field 'max_tokns' (did you mean 'max_tokens'?)"),
    ("POST", "/v1/completions", b'{"prompt": [1], "logit_bias": {"x": 10}}', 400, "logit_bias must map token ids"),
    ("POST", "/v1/completions", b'{"prompt": [1], "logit_bias": {"99999999": 10}}', 400, "logit_bias token ids"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 0}', 400, "max_tokens must be an integer in [1,"),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 2, "min_tokens": 3}', 400, "min_tokens (3) must be"),
    ("POST", "/v1/completions", b'{"prompt": [[1], "a", 3]}', 400, "prompt must be"),
    ("POST", "/v1/completions", b'{"prompt": [1], "top_p": 0}', 400, "top_p must be a finite number in (0, 1]"),
    ("POST", "/v1/completions", b'{"prompt": [1], "stop": [""]}', 400, "stop must be a non-empty string"),
    ("POST", "/v1/completions", b'{"prompt": [1], "stream_options": {"include_usage": true}}', 400,
     "stream_options needs stream = true"),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}', 400, "messages must be a non-empty list"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', 400,
     "content must be a string or a list of text parts"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400,
     "messages[0].role must be one of system, developer, user, assistant, tool"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}', 400, "tool_call_id"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "response_format": '
                                     b'{"type": "json_object"}}', 400, "response_format is not supported"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": '
                                     b'"required"}', 400, "tool_choice must be"),
    ("POST", "/inference/v1/generate", b'{"token_ids": "abc"}', 400, "token_ids must be a non-empty list"),
    ("POST", "/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"max_tokns": 3}}', 400,
     "did you mean 'max_tokens'"),
    ("POST", "/update_weights", b'{"version": "1"}', 400, "version must be an integer >= 0"),
    ("POST", "/update_weights", b'{"version": 1, "path": 5}', 400, "path must be a string"),
    ("POST", "/update_weights", b'{"version": 1, "pth": "/x"}', 400, "unknown field 'pth' (did you mean 'path'?)"),
    ("GET", "/v1/completions", b"", 405, "Method Not Allowed: GET /v1/completions (allowed: POST)"),
    ("DELETE", "/health", b"", 405, "allowed: GET"),
    ("POST", "/v2/completions", b"{}", 404, "Not Found: POST /v2/completions"),
    ("POST", "/v1/completions", b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', 413, "at most 16777216 bytes"),
]


def test_malformed_requests_get_4xx_with_a_message_and_the_server_keeps_serving(served):
    """Every request of MALFORMED in turn against one real server process; a good request works after each."""
    url, _, _ = served

    async def scenario():
        answers = []
        async with aiohttp.ClientSession() as session:
            for method, path, raw, _, _ in MALFORMED:
                headers = {"Content-Type": "application/json"}
                async with session.request(method, url + path, data=raw, headers=headers) as response:
                    answers.append((response.status, await response.json(content_type=None)))
                async with session.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) as good:
                    assert good.status == 200, (path, raw[:40])
        return answers

    answers = run(scenario())
    for (method, path, raw, status, words), (got_status, body) in zip(MALFORMED, answers):
        assert (got_status, words in body["error"]["message"]) == (status, True), (method, path, raw[:60], body)
