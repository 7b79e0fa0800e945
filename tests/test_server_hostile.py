"""The hostile-request suite against `i3core serve` as a user runs it: numbers at and past every bound, NaN and
Infinity, malformed and oversized bodies, surrogates and NUL bytes, invalid token ids, huge stop lists,
unauthenticated admin calls, abandoned streams and non-streams, a flood of 512 requests; after each, a plain request
still works. Then the request line, the API key, property-based fuzzing of the live schema, and shutdown by real
signals."""

import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ADMIN_TOKEN, SERVED_MODEL, i3core_serve

pytestmark = pytest.mark.slow

MAX_LEN = 1024
PLAIN = {"prompt": [1, 2, 3], "max_tokens": 2, "stop_token_ids": []}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``i3core serve`` (64 slots, max_len 1024, admin routes on with a token); yields (url, vocab size, log)."""
    directory = tmp_path_factory.mktemp("hostile") / "model"
    with i3core_serve(directory, "hostile", max_len=MAX_LEN) as url:
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        yield url, vocab, directory.parent / "serve.log"


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def nested(depth: int) -> dict:
    """``{"a": {"a": ...}}``, ``depth`` objects deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def called(arguments: str) -> list[dict]:
    """A user turn, then an assistant turn that called ``f`` with ``arguments``."""
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]


def cases(vocab: int) -> list[tuple]:
    """(method, path, body: dict or raw bytes, headers, status, words in the error message)."""
    c = "/v1/completions"
    long_stop = "s" * 256
    return [
        # numbers at and past every bound
        ("POST", c, {**PLAIN, "n": 64, "max_tokens": 1}, {}, 200, ""),
        ("POST", c, {**PLAIN, "n": 65}, {}, 400, "n must be an integer in [1, 64]"),
        ("POST", c, {**PLAIN, "n": 0}, {}, 400, "n must be an integer in [1, 64]"),
        ("POST", c, {**PLAIN, "max_tokens": MAX_LEN + 1}, {}, 400, f"maximum context length is {MAX_LEN} tokens"),
        ("POST", c, {**PLAIN, "max_tokens": 0}, {}, 400, "max_tokens must be an integer in [1, "),
        ("POST", c, {**PLAIN, "max_tokens": 2**80}, {}, 400, "max_tokens must be an integer in [1, max_len]"),
        ("POST", c, {**PLAIN, "temperature": 0}, {}, 200, ""),
        ("POST", c, {**PLAIN, "temperature": 1e-300}, {}, 200, ""),
        ("POST", c, {**PLAIN, "temperature": 5e-3}, {}, 200, ""),
        ("POST", c, {**PLAIN, "temperature": 1e308}, {}, 200, ""),
        ("POST", c, {**PLAIN, "temperature": -1e-9}, {}, 400, "temperature must be a finite number >= 0"),
        ("POST", c, {**PLAIN, "top_p": 1}, {}, 200, ""),
        ("POST", c, {**PLAIN, "top_p": 1e-12}, {}, 200, ""),
        ("POST", c, {**PLAIN, "top_p": 1e-46}, {}, 200, ""),  # 0 in float32: the most likely token stays
        ("POST", c, {**PLAIN, "repetition_penalty": 1e-46}, {}, 200, ""),  # 0 in float32: logits stay finite
        ("POST", c, {**PLAIN, "top_p": 0}, {}, 400, "top_p must be a finite number in (0, 1]"),
        ("POST", c, {**PLAIN, "top_p": 1.0000001}, {}, 400, "top_p must be a finite number in (0, 1]"),
        ("POST", c, {**PLAIN, "top_k": -1}, {}, 200, ""),
        ("POST", c, {**PLAIN, "top_k": 1}, {}, 200, ""),
        ("POST", c, {**PLAIN, "top_k": 10**9}, {}, 200, ""),
        ("POST", c, {**PLAIN, "top_k": -2}, {}, 400, "top_k must be -1, 0 (off) or an integer in [1, "),
        ("POST", c, {**PLAIN, "logprobs": 20}, {}, 200, ""),
        ("POST", c, {**PLAIN, "logprobs": 21}, {}, 400, "logprobs must be an integer in [0, 20]"),
        ("POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=20), {}, 200, ""),
        ("POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400,
         "top_logprobs must be an integer in [0, 20]"),
        ("POST", c, {**PLAIN, "seed": 2**63 - 1, "n": 2}, {}, 200, ""),
        ("POST", c, {**PLAIN, "seed": -(2**63)}, {}, 200, ""),
        ("POST", c, {**PLAIN, "seed": 2**63}, {}, 400, "seed must be an integer in"),
        ("POST", c, {**PLAIN, "logit_bias": {str(vocab - 1): 100}}, {}, 200, ""),
        ("POST", c, {**PLAIN, "logit_bias": {"\u00b2": 1}}, {}, 400, "logit_bias must map token ids"),  # isdigit
        ("POST", c, {**PLAIN, "logit_bias": {"--1": 1}}, {}, 400, "logit_bias must map token ids"),
        ("POST", c, {**PLAIN, "logit_bias": {"9" * 5000: 1}}, {}, 400, "logit_bias must map token ids"),
        ("POST", "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logit_bias": {"\u00b2": 1}}}, {},
         400, "logit_bias must map token ids"),
        ("POST", c, {**PLAIN, "stop": [long_stop] * 16}, {}, 200, ""),
        ("POST", c, {**PLAIN, "stop": ["x"] * 17}, {}, 400, "stop must be a non-empty string or a list of at most 16"),
        ("POST", c, {**PLAIN, "stop": long_stop + "s"}, {}, 400, "each at most 256 characters"),
        ("POST", c, {**PLAIN, "stop": ["x"] * 200_000}, {}, 400, "stop must be"),  # a huge stop list: refused fast
        ("POST", c, {**PLAIN, "stop_token_ids": [vocab - 1]}, {}, 200, ""),
        ("POST", c, {**PLAIN, "stop_token_ids": [vocab]}, {}, 400, f"stop_token_ids must be token ids in [0, {vocab})"),
        ("POST", c, {**PLAIN, "stop_token_ids": list(range(257))}, {}, 400, "stop_token_ids must be a list of at most"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 4097}, {}, 400,
         "messages must be a non-empty list of at most 4096 messages"),
        ("POST", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129), {},
         400, "tools must be a list of at most 128"),
        # NaN and Infinity, wherever a number goes
        ("POST", c, b'{"prompt": [1], "temperature": NaN}', {}, 400, "temperature must be a finite number"),
        ("POST", c, b'{"prompt": [1], "top_p": -Infinity}', {}, 400, "top_p must be a finite number"),
        ("POST", c, b'{"prompt": [1], "max_tokens": Infinity}', {}, 400, "max_tokens must be an integer"),
        ("POST", c, b'{"prompt": [1, NaN]}', {}, 400, "prompt must be"),
        ("POST", c, b'{"prompt": [1], "seed": NaN}', {}, 400, "seed must be an integer"),
        ("POST", "/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}', {}, 400,
         "sampling_params.temperature must be a finite number"),
        # malformed and oversized bodies
        ("POST", c, b'{"prompt": [1], "max_tokens": 2', {}, 400, "not valid JSON"),
        ("POST", c, b'"just a string"', {}, 400, "must be a JSON object"),
        ("POST", c, b"null", {}, 400, "must be a JSON object"),
        ("POST", c, b"{" * 50_000, {}, 400, "not valid JSON"),
        ("POST", c, b'{"a":' * 5_000 + b"1" + b"}" * 5_000, {}, 400, "the body is nested more than 64 deep"),
        # JSON nested past what a chat template can recurse through: in tools, in a call's arguments
        ("POST", "/v1/chat/completions", chat(tools=[tool(nested(100))]), {}, 400,
         "the body is nested more than 64 deep (in tools)"),
        ("POST", "/v1/chat/completions", chat(tools=[tool(nested(40))]), {}, 200, ""),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool(nested(100))]}, {},
         400, "the body is nested more than 64 deep"),
        ("POST", "/v1/chat/completions", chat(messages=called("[" * 100_000)), {}, 400,
         "messages[1].tool_calls[0].function.arguments must encode a JSON object"),
        ("POST", "/v1/chat/completions", chat(messages=called(json.dumps(nested(100)))), {}, 400,
         "messages[1].tool_calls[0].function.arguments is nested more than 64 deep"),
        ("POST", "/v1/responses", {"input": [{"role": "user", "content": "hi"}, {
            "type": "function_call", "call_id": "c", "name": "f", "arguments": json.dumps(nested(100))}]}, {}, 400,
         "input[1].arguments is nested more than 64 deep"),
        ("POST", c, b'{"prompt": [1], "stop": ' + b"[" * 500 + b"]" * 500 + b"}", {}, 400,
         "the body is nested more than 64 deep (in stop)"),
        ("POST", c, b"\xef\xbb\xbf" + json.dumps(PLAIN).encode(), {}, 200, ""),  # a BOM, as Python reads JSON
        ("POST", c, json.dumps(PLAIN).encode(), {"Content-Type": "text/plain"}, 200, ""),
        ("POST", c, b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', {}, 413, "at most 16777216 bytes"),
        ("POST", c, {**PLAIN, "prompt": "a" * 20_000}, {}, 400, f"maximum context length is {MAX_LEN} tokens"),
        # texts no context holds, refused before the tokenizer holds the interpreter for them
        ("POST", c, {**PLAIN, "prompt": "a b " * 1_000_000}, {}, 400, "the prompt has 4000000 characters"),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * 1_000_000}]), {}, 400,
         f"maximum context length is {MAX_LEN} tokens"),
        ("POST", "/tokenize", {"prompt": "a" * 1_000_000}, {}, 400, "the prompt has 1000000 characters"),
        ("POST", "/v1/responses", {"input": "a" * 1_000_000, "max_output_tokens": 2}, {}, 400, "the input has"),
        ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": {str(i): "" for i in range(17)}},
         {}, 400, "metadata must be an object of at most 16 strings"),
        ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v" * 513}}, {}, 400,
         "metadata must be an object of at most 16 strings"),
        # surrogates and NUL bytes
        ("POST", c, b'{"prompt": "a\\ud800b"}', {}, 400, "prompt holds a lone UTF-16 surrogate"),
        ("POST", c, b'{"prompt": "\\udfff", "max_tokens": 2}', {}, 400, "surrogate"),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', {}, 400,
         "messages[0].content holds a lone UTF-16 surrogate"),
        ("POST", c, b'{"\\ud800": 1, "prompt": [1]}', {}, 400, "surrogate"),
        ("POST", c, b'{"prompt": "a\\u0000b\\u0000", "max_tokens": 2}', {}, 200, ""),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "\x00" * 100}]), {}, 200, ""),
        ("POST", c, {**PLAIN, "stop": "\x00"}, {}, 200, ""),
        ("POST", c, {**PLAIN, "prompt": "\U0001f600" * 10}, {}, 200, ""),  # astral characters (surrogate pairs)
        # invalid token ids
        ("POST", c, {**PLAIN, "prompt": [vocab]}, {}, 400, f"prompt token ids must be in [0, {vocab})"),
        ("POST", c, {**PLAIN, "prompt": [-1]}, {}, 400, "prompt token ids must be in"),
        ("POST", c, {**PLAIN, "prompt": [2**64]}, {}, 400, "prompt token ids must be in"),
        ("POST", c, {**PLAIN, "prompt": [1.0]}, {}, 400, "prompt must be"),
        ("POST", "/inference/v1/generate", {"token_ids": [vocab]}, {}, 400, "prompt token ids must be in"),
        ("POST", c, {**PLAIN, "prompt": list(range(1, 20)) * 60}, {}, 400, f"maximum context length is {MAX_LEN}"),
        ("POST", "/detokenize", {"tokens": [1] * MAX_LEN}, {}, 200, ""),
        ("POST", "/detokenize", {"tokens": [1] * (MAX_LEN + 1)}, {}, 400, f"tokens: at most {MAX_LEN}"),
        # unauthenticated and wrongly authenticated admin calls
        ("POST", "/pause", {}, {}, 401, "/pause needs the admin token"),
        ("POST", "/resume", {}, {}, 401, "/resume needs the admin token"),
        ("POST", "/update_weights", {"path": "/etc", "version": 1}, {}, 401, "needs the admin token"),
        ("POST", "/pause", {}, {"Authorization": "Bearer wrong"}, 401, "needs the admin token"),
        ("POST", "/pause", {}, {"Authorization": ADMIN_TOKEN}, 401, "needs the admin token"),  # no scheme
        ("POST", "/pause", {}, {"Authorization": "Bearer s\u00e9cret"}, 401, "needs the admin token"),  # not ASCII
        ("POST", "/update_weights", {"path": "/etc\x00", "version": 1}, ADMIN, 400, "path must not hold a NUL"),
        ("GET", "/inference/v1/sessions/x", None, {}, 401, "needs the admin token"),
        ("DELETE", "/inference/v1/sessions/x", None, {}, 401, "needs the admin token"),
        ("POST", "/update_weights", {"path": "/etc", "version": 1}, ADMIN, 403,
         "is outside the weight directories this server reads from"),
        ("POST", "/update_weights", {"path": "../../../../etc", "version": 1}, ADMIN, 403, "is outside"),
        ("POST", "/resume", {}, ADMIN, 200, ""),
        # routes and methods that do not exist
        ("POST", "/v1/embeddings", {}, {}, 404, "Not Found"),
        ("PUT", c, {}, {}, 405, "allowed: POST"),
    ]


def test_update_weights_from_a_file_is_a_client_error(served):
    """A file under the weight directories named as a version: 400, not an error of the server's."""
    url, _, log = served
    config = log.parent / "model" / "config.json"

    async def scenario():
        async with aiohttp.ClientSession() as session:
            return await answer(session, "POST", url + "/update_weights", {"path": str(config), "version": 1}, ADMIN)

    status, body = asyncio.run(scenario())
    assert config.is_file() and status == 400 and "not a complete weight version" in body["error"]["message"], body


async def answer(session, method, url, body, headers):
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    async with session.request(method, url, data=data, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def plain_works(session, url) -> None:
    status, body = await answer(session, "POST", url + "/v1/completions", PLAIN, {})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2, body


def test_every_hostile_request_is_answered_with_a_message_and_the_server_keeps_serving(served):
    url, vocab, _ = served

    async def scenario():
        answers = []
        async with aiohttp.ClientSession() as session:
            for method, path, body, headers, _, _ in cases(vocab):
                answers.append(await answer(session, method, url + path, body, headers))
                await plain_works(session, url)
        return answers

    for case, (status, body) in zip(cases(vocab), asyncio.run(scenario())):
        method, path, sent, _, expected, words = case
        shown = (method, path, sent[:80] if isinstance(sent, bytes) else str(sent)[:80])
        assert status == expected, (shown, body)
        if status >= 400:
            error = body["error"]
            assert words in error["message"], (shown, error)
            assert set(error) == {"message", "type", "param", "code"}, error  # OpenAI's shape


async def scrape(url: str, name: str) -> float:
    """One sample of the server's Prometheus ``/metrics``."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}[name]


def metric(url: str, name: str) -> float:
    return asyncio.run(scrape(url, name))


async def timed_plain(session, url, tokens=16) -> float:
    start = time.perf_counter()
    status, _ = await answer(session, "POST", url + "/v1/completions", {**PLAIN, "max_tokens": tokens,
                                                                         "stop_token_ids": []}, {})
    assert status == 200
    return time.perf_counter() - start


def test_64_abandoned_requests_free_their_slots_and_leave_the_server_as_fast_as_before(served):
    """32 streams and 32 plain requests of 1000 tokens each, dropped once all run: their slots are free within a
    step or two, and a plain request takes as long as on the idle server (not behind 64 x 1000 tokens)."""
    url, _, _ = served

    async def scenario():
        async with aiohttp.ClientSession() as session:
            before = statistics.median([await timed_plain(session, url) for _ in range(3)])
        dropping = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        long = {"prompt": [1, 2, 3], "max_tokens": 1000, "stop_token_ids": [], "temperature": 1.0}

        async def abandoned(i):
            body = {**long, "stream": i % 2 == 0, "seed": i}
            async with dropping.post(url + "/v1/completions", json=body) as response:
                await response.content.read()  # never finishes: cancelled below

        tasks = [asyncio.create_task(abandoned(i)) for i in range(64)]
        deadline = time.monotonic() + 60
        while await scrape(url, "vllm:num_requests_running") < 64:
            assert time.monotonic() < deadline, "the 64 requests never all ran"
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await dropping.close()  # the connections close: the server sees its clients go
        dropped = time.perf_counter()
        while await scrape(url, "vllm:num_requests_running") > 0:
            assert time.perf_counter() - dropped < 10, "the abandoned sequences still hold their slots"
            await asyncio.sleep(0.01)
        freed = time.perf_counter() - dropped
        async with aiohttp.ClientSession() as session:
            after = statistics.median([await timed_plain(session, url) for _ in range(3)])
        return before, freed, after

    before, freed, after = asyncio.run(scenario())
    print(f"plain 16 tokens: {before:.3f}s before, {after:.3f}s after; slots free {freed:.3f}s after the drop")
    assert freed < 5  # a step or two (a step of 64 sequences is tens of ms; a loaded machine is slower)
    assert after < 2 * before + 0.5  # as fast as before (1000 tokens x 64 would take minutes)


def test_a_flood_of_512_requests_is_served_and_leaves_a_healthy_server(served):
    url, _, _ = served

    async def scenario():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            kinds = [("/v1/completions", {**PLAIN, "seed": i}) if i % 2 else ("/v1/chat/completions", chat(seed=i))
                     for i in range(512)]
            answers = await asyncio.gather(*(answer(session, "POST", url + path, body, {}) for path, body in kinds))
            await plain_works(session, url)
            return answers

    answers = asyncio.run(scenario())
    assert [status for status, _ in answers] == [200] * 512
    assert metric(url, "vllm:num_requests_running") == 0 and metric(url, "vllm:num_requests_waiting") == 0


def test_each_request_leaves_one_log_line(served):
    url, _, log = served

    async def scenario():
        async with aiohttp.ClientSession() as session:
            await answer(session, "POST", url + "/v1/completions", {**PLAIN, "max_tokens": 3, "logprobs": 0,
                                                                    "stop_token_ids": []}, {})
            await answer(session, "POST", url + "/v1/completions", {**PLAIN, "top_p": 0}, {})

    size = log.stat().st_size
    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in log.read_text()[size:].splitlines() if "request" in line and "route=" in line]
        if len(lines) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ok, bad = lines[:2]
    for field in ("method=POST", "route=/v1/completions", "prompt_tokens=3", "completion_tokens=3",
                  "finish_reason=length", "client=127.0.0.1", "status=200"):
        assert field in ok, (field, ok)
    assert re.search(r"duration_s=\d", ok) and "status=400" in bad


def test_a_stream_whose_client_leaves_before_its_answer_is_logged_499_not_a_server_error(served):
    """Streams posted on a raw socket that closes at once: each is logged (and counted) as the client leaving,
    499, with no traceback; before, writing the stream's 200 to the closed connection was a 500 and a traceback."""
    url, _, log = served
    port = int(url.rsplit(":", 1)[1])
    routes = {"/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 50},
              "/v1/chat/completions": chat(max_tokens=50), "/v1/responses": {"input": "hi", "max_output_tokens": 50}}
    size = log.stat().st_size
    for path, body in routes.items():
        for _ in range(3):
            data = json.dumps({**body, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    deadline = time.monotonic() + 10
    while True:
        text = log.read_text()[size:]
        lines = [line for line in text.splitlines() if "route=" in line and "route=/v1/" in line]
        if len(lines) >= 9 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 9, text
    assert all("status=499" in line for line in lines), lines
    assert "request failed" not in text and "Traceback" not in text, text
    asyncio.run(plain_session(url))


async def plain_session(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await plain_works(session, url)


def test_responses_errors_name_the_responses_fields(served):
    """A Responses request is answered through a chat request; its errors name its own fields: ``input[i]...``
    (the item, not the chat message it became: ``instructions`` come first), ``max_output_tokens``."""
    url, _, _ = served
    user = {"role": "user", "content": "hi"}
    call = {"type": "function_call", "call_id": "c", "name": "f"}
    requests = [
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": [{"role": "bogus", "content": "a"}]}, "input[0].role"),
        ({"instructions": "be brief", "input": [user, {**call, "arguments": "{}"}, {**call, "arguments": "[1]"}]},
         "input[2].arguments"),
        ({"input": [user, {"role": "assistant", "content": "ok"}, {**call, "arguments": "{x"}]}, "input[2].arguments"),
    ]

    async def scenario():
        async with aiohttp.ClientSession() as session:
            return [await answer(session, "POST", url + "/v1/responses", body, {}) for body, _ in requests]

    for (status, body), (_, param) in zip(asyncio.run(scenario()), requests):
        assert status == 400 and body["error"]["param"] == param, body
        assert "messages" not in body["error"]["message"] and "max_tokens" not in body["error"]["message"], body


# -- fuzzing the live schema -------------------------------------------------------------------------------------

SCHEMA_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                          st.text(max_size=12), st.lists(st.integers(-5, 400), max_size=6),
                          st.lists(st.text(max_size=4), max_size=3))


def test_fuzzed_requests_against_the_published_schema_are_200_or_400_never_500(served):
    """Bodies drawn over the published schema's own field names: every answer is 200 or an OpenAI-shaped 4xx."""
    url, _, _ = served

    async def fields():
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/openapi.json") as response:
                return (await response.json())["components"]["schemas"]["CompletionRequest"]["properties"]

    names = sorted(asyncio.run(fields()))
    bodies = st.dictionaries(st.sampled_from(names), SCHEMA_VALUES, max_size=6).map(
        lambda body: {"prompt": [1, 2], **body, "max_tokens": 2, "n": 1, "stream": False})

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
    @given(bodies)
    def check(body):
        async def send():
            async with aiohttp.ClientSession() as session:
                return await answer(session, "POST", url + "/v1/completions", body, {})

        status, answer_ = asyncio.run(send())
        assert status in (200, 400), (body, answer_)
        if status == 400:
            assert answer_["error"]["message"] and answer_["error"]["type"] == "invalid_request_error"

    check()


# -- the API key, and shutdown by signals ---------------------------------------------------------------------------


def test_the_api_key_guards_v1_and_nothing_else(tmp_path):
    with i3core_serve(tmp_path / "model", "keyed", max_len=64, args=("--api-key", "sk-test")) as url:

        async def scenario():
            async with aiohttp.ClientSession() as session:
                none = await answer(session, "POST", url + "/v1/completions", PLAIN, {})
                wrong = await answer(session, "GET", url + "/v1/models", None, {"Authorization": "Bearer sk-no"})
                right = await answer(session, "POST", url + "/v1/completions", PLAIN,
                                     {"Authorization": "Bearer sk-test"})
                health = await answer(session, "GET", url + "/health", None, {})
                return none, wrong, right, health

        none, wrong, right, health = asyncio.run(scenario())
    assert none[0] == wrong[0] == 401 and none[1]["error"]["code"] == "invalid_api_key"
    assert right[0] == 200 and health[0] == 200


def test_admin_routes_are_off_in_i3core_serve_unless_enabled(tmp_path):
    model = tmp_path / "model"
    from i3core.testing import make_component

    component = make_component("model", "tiny-moe", **SERVED_MODEL)
    component.save_hf(component.build(seed=0), model)
    proc, url = start_serve(model, tmp_path / "off.log")
    try:
        async def scenario():
            async with aiohttp.ClientSession() as session:
                return [(await answer(session, "POST", url + path, {}, ADMIN))[0] for path in ("/pause", "/resume")]

        assert asyncio.run(scenario()) == [404, 404]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    result = subprocess.run([sys.executable, "-m", "i3core.cli", "serve", str(model), "--enable-admin"],
                            capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                 if k != "I3CORE_ADMIN_TOKEN"}, timeout=120)
    assert result.returncode != 0 and "--enable-admin needs a token" in result.stderr
    assert "Traceback" not in result.stderr


def start_serve(model: Path, log: Path, *args: str, max_len: int = 1024) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "serve", str(model), "--port", str(port),
                                 "--max-len", str(max_len), *args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, url
        except OSError:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
    raise AssertionError("i3core serve did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_accepting_ends_requests_in_flight_within_the_grace_and_exits_0(tmp_path, sig):
    from i3core.testing import make_component

    model = tmp_path / "model"
    component = make_component("model", "tiny-moe", **SERVED_MODEL, max_position_embeddings=16384)
    component.save_hf(component.build(seed=0), model)
    # the long requests must outlast the 1 s grace however fast the machine: with 1000 tokens both finished inside
    # it in CI on 2026-12-07 (answered 200, not cut)
    proc, url = start_serve(model, tmp_path / "serve.log", "--shutdown-grace-s", "1", max_len=16384)

    async def scenario():
        async with aiohttp.ClientSession() as session:
            long = {"prompt": [1, 2, 3], "max_tokens": 16000, "stop_token_ids": [], "temperature": 1.0}
            short = asyncio.create_task(answer(session, "POST", url + "/v1/completions",
                                               {**PLAIN, "max_tokens": 40, "stop_token_ids": []}, {}))
            whole = asyncio.create_task(answer(session, "POST", url + "/v1/completions", long, {}))

            async def streamed():
                async with session.post(url + "/v1/completions", json={**long, "stream": True}) as response:
                    return response.status, await response.text()

            stream = asyncio.create_task(streamed())
            deadline = time.monotonic() + 60
            while await scrape(url, "vllm:num_requests_running") < 3:
                assert time.monotonic() < deadline and not short.done(), "the three requests never ran together"
                await asyncio.sleep(0.02)
            sent = time.monotonic()
            proc.send_signal(sig)
            await asyncio.sleep(0.3)
            try:
                async with aiohttp.ClientSession() as fresh:
                    refused = await answer(fresh, "POST", url + "/v1/completions", PLAIN, {})
            except aiohttp.ClientConnectionError:
                refused = "connection refused"
            results = await asyncio.gather(short, whole, stream)
            ended = time.monotonic() - sent
            return results, refused, ended

    try:
        (short, whole, stream), refused, ended = asyncio.run(scenario())
        code = proc.wait(timeout=30)
        exited = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert exited and code == 0, (tmp_path / "serve.log").read_text()
    assert refused == "connection refused"  # no longer accepting
    assert short[0] == 200 and len(short[1]["choices"][0]["token_ids"]) == 40  # finished within the grace
    assert whole[0] == 503 and "shutting down" in whole[1]["error"]["message"]  # cut at the grace, answered
    status, text = stream
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and "shutting down" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    assert ended < 3 + 5  # the grace, plus a loaded machine's slack
