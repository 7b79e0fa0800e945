"""Faults in the engine, builtin server and ``local``: one sequence's fault fails that sequence alone; a fault that
breaks the engine fails every waiting request at once, /health says why, the server process exits 1 with one line
and its supervisor restarts it, and the ``local`` source fails the run. The faults are real: a model plugin
(tests/faulty_server.py) whose forward writes NaN into the rows fed a given token, or raises on a given call."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from i3core.errors import EngineFailed, SequenceFailed
from i3core.plugins.inference.builtin import BuiltinSource
from i3core.plugins.inference.engine import Request
from i3core.plugins.inference.local import LOCAL_URL, LocalClient
from i3core.plugins.inference.server import builtin_server, make_app, model_component
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import make_component, plugin_manager

from .conftest import SERVED_MODEL
from .faulty_server import FaultyPlugin

POISON = 7
"""The token whose rows the faulty model fills with NaN."""
PLAIN = {"prompt": [1, 2, 3], "max_tokens": 4, "stop_token_ids": []}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("faulty") / "model"
    component = make_component("model", "tiny-moe", **SERVED_MODEL)
    component.save_hf(component.build(seed=0), directory)
    return directory


def faulty_server(model_dir: Path, max_slots: int = 8, **faults):
    component = model_component("faulty", {**SERVED_MODEL, **faults}, plugin_manager(FaultyPlugin(), installed=False))
    return builtin_server(model_dir, component, max_slots=max_slots, max_len=256, version=0, served_name="faulty")


async def post(session, url, body):
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, await response.json(content_type=None)


async def stream_events(session, url, body) -> list[str]:
    """The ``data:`` payloads of a streamed completion."""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as response:
        return [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]


async def in_process(server, scenario):
    http = TestServer(make_app(server), host="127.0.0.1")
    await http.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            return await scenario(session, str(http.make_url("")).rstrip("/"))
    finally:
        await http.close()


def test_a_sequence_with_nan_logits_fails_alone_and_the_others_go_on(model_dir):
    server = faulty_server(model_dir, nan_token=POISON)

    async def scenario(session, url):
        poisoned = {"prompt": [1, POISON, 3], "max_tokens": 30, "stop_token_ids": []}
        healthy = {"prompt": [1, 2, 3], "max_tokens": 30, "stop_token_ids": [], "n": 2}
        answers = await asyncio.gather(post(session, url, poisoned), post(session, url, healthy),
                                       stream_events(session, url, healthy))
        events = await stream_events(session, url, poisoned)
        async with session.get(url + "/health") as response:
            health = response.status
        # the failed sequence's slot (NaN keys and values) goes to the short prompt; its batch mate is longer, so
        # attention reads the slot's stale entries (masked): they must have been cleared
        await post(session, url, {"prompt": [POISON] * 60, "max_tokens": 5})
        reuse = await asyncio.gather(post(session, url, {**PLAIN, "max_tokens": 10}),
                                     post(session, url, {"prompt": [2] * 50, "max_tokens": 10, "stop_token_ids": []}))
        return answers, events, health, reuse

    (bad, good, streamed), events, health, reuse = asyncio.run(in_process(server, scenario))
    assert bad[0] == 500 and bad[1]["error"]["code"] == "sequence_failed" and bad[1]["error"]["type"] == "server_error"
    assert "logits are not finite (NaN or inf) at completion token 0" in bad[1]["error"]["message"]
    assert good[0] == 200 and [len(c["token_ids"]) for c in good[1]["choices"]] == [30, 30]
    assert streamed[-1] == "[DONE]" and sum(len(json.loads(e)["choices"][0].get("token_ids", [])) for e in streamed[:-1]) == 60
    assert json.loads(events[-2])["error"]["code"] == "sequence_failed" and events[-1] == "[DONE]"
    assert health == 200 and [status for status, _ in reuse] == [200, 200]
    assert not server.engine.running and len(server.engine._free) == server.engine.max_slots  # every slot back


def test_a_responses_stream_whose_sequence_fails_ends_with_response_failed(model_dir):
    """After the 200 of a Responses stream, a failed sequence is the stream's last event (``response.failed``),
    not a second HTTP response written into the body."""
    server = faulty_server(model_dir, nan_token=POISON)

    async def scenario(session, url):
        body = {"input": "a" + chr(POISON) + "b", "max_output_tokens": 4, "stream": True}
        async with session.post(url + "/v1/responses", json=body) as response:
            status, text = response.status, await response.text()
        return status, text, await post(session, url, PLAIN)

    status, text, after = asyncio.run(in_process(server, scenario))
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and "HTTP/1.1" not in text
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "sequence_failed"
    assert "logits are not finite" in failed["error"]["message"] and after[0] == 200


def test_a_bug_after_a_streams_200_is_the_streams_last_event_not_a_second_response(model_dir, monkeypatch):
    """Whatever escapes a streaming handler once its 200 is sent (here the tool parser, broken on purpose) ends
    the stream with the route's error event; the server goes on."""
    from i3core.plugins.inference import openai_api, responses

    def broken(text):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(openai_api, "split_tool_calls", broken)
    monkeypatch.setattr(responses, "split_tool_calls", broken)
    server = faulty_server(model_dir)
    tool = {"name": "add", "parameters": {"type": "object", "properties": {}}}

    async def scenario(session, url):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "tools": [{"type": "function", "function": tool}]}
        async with session.post(url + "/v1/chat/completions", json=chat) as response:
            chat_answer = response.status, await response.text()
        body = {"input": "hi", "max_output_tokens": 3, "stream": True, "tools": [{"type": "function", **tool}]}
        async with session.post(url + "/v1/responses", json=body) as response:
            responses_answer = response.status, await response.text()
        return chat_answer, responses_answer, await post(session, url, PLAIN)

    with capture_logs() as logs:
        (chat_status, chat_text), (resp_status, resp_text), after = asyncio.run(in_process(server, scenario))
    chat_events = [line[6:] for line in chat_text.splitlines() if line.startswith("data: ")]
    assert chat_status == 200 and "HTTP/1.1" not in chat_text and chat_events[-1] == "[DONE]"
    assert json.loads(chat_events[-2])["error"]["message"] == "internal error: RuntimeError: injected bug"
    events = [json.loads(line[6:]) for line in resp_text.splitlines() if line.startswith("data: ")]
    assert resp_status == 200 and "HTTP/1.1" not in resp_text and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "internal error: RuntimeError: injected bug"}
    assert after[0] == 200 and sum(log["event"] == "request failed" for log in logs) == 2


def test_an_engine_that_breaks_fails_every_waiting_request_at_once_and_health_says_why(model_dir):
    server = faulty_server(model_dir, raise_at=6)  # a prefill or two, then a few decode steps

    async def scenario(session, url):
        long = {"prompt": [1, 2, 3], "max_tokens": 200, "stop_token_ids": []}
        start = time.monotonic()
        answers = await asyncio.gather(*(post(session, url, {**long, "seed": i}) for i in range(4)),
                                       return_exceptions=True)
        elapsed = time.monotonic() - start
        async with session.get(url + "/health") as response:
            health = response.status, await response.json()
        return answers, elapsed, health, await post(session, url, PLAIN)

    answers, elapsed, health, later = asyncio.run(in_process(server, scenario))
    assert all(status == 503 for status, _ in answers), answers
    assert all("the engine failed: RuntimeError: injected fault" in body["error"]["message"] for _, body in answers)
    assert elapsed < 10  # at once, not after 200 tokens or a timeout
    assert health[0] == 503 and health[1]["status"] == "error" and "injected fault" in health[1]["error"]
    assert later[0] == 503 and "injected fault" in later[1]["error"]["message"]


def serve_faulty(model_dir: Path, port: int, **faults) -> list[str]:
    return [sys.executable, str(Path(__file__).parent / "faulty_server.py"), "--model-dir", str(model_dir),
            "--port", str(port), "--model", "faulty", "--model-options", json.dumps({**SERVED_MODEL, **faults})]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    async def ask():
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as response:
                return response.status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.communicate()
        try:
            if asyncio.run(ask()) == 200:
                return
        except aiohttp.ClientError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy within {timeout}s")


@pytest.mark.slow
def test_a_server_whose_engine_breaks_exits_1_with_one_line(model_dir):
    port = free_port()
    proc = subprocess.Popen(serve_faulty(model_dir, port, raise_at=3), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)

        async def ask():
            async with aiohttp.ClientSession() as session:
                return await post(session, url, {"prompt": [1, 2], "max_tokens": 50, "stop_token_ids": []})

        status, body = asyncio.run(ask())
        assert status == 503 and "injected fault" in body["error"]["message"]
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert stderr.strip().splitlines() == ["error: the engine failed: RuntimeError: injected fault: the forward failed"]


class FaultySource(BuiltinSource):
    """The builtin source, each server over the faulty model."""

    faults: dict = {}

    def command(self, index, port, model_dir, version, receiver, model=None):
        return serve_faulty(model_dir, port, **self.faults)


@pytest.mark.slow
def test_the_supervisor_restarts_a_server_whose_engine_broke(model_dir, tmp_path):
    FaultySource.faults = {"raise_at": 3}
    source = FaultySource(FaultySource.Config(servers=1, restarts=1, max_len=128))
    with capture_logs() as logs:
        try:
            (url,) = source.start(model_dir, tmp_path / "logs")
            first = source.processes[0].pid

            async def ask():
                async with aiohttp.ClientSession() as session:
                    return await post(session, url, {"prompt": [1, 2], "max_tokens": 50, "stop_token_ids": []})

            assert asyncio.run(ask())[0] == 503
            deadline = time.monotonic() + 60
            while source.processes[0].pid == first and time.monotonic() < deadline:
                time.sleep(0.1)
            wait_healthy(url)
            assert asyncio.run(ask())[0] == 503  # the restarted engine breaks on its third forward again
        finally:
            source.close()
    (restarted,) = [e for e in logs if e["event"] == "inference server crashed; restarting"]
    assert restarted["returncode"] == 1
    assert "error: the engine failed" in (tmp_path / "logs" / "inference-0.log").read_text()


# -- local: the same engine in the orchestrator's process --------------------------------------------------------


def local_client(model_dir: Path, **faults) -> LocalClient:
    return LocalClient(faulty_server(model_dir, **faults), build_tokenizer(), stop_token_ids=[])


def test_local_a_nan_sequence_fails_its_rollout_alone(model_dir):
    client = local_client(model_dir, nan_token=POISON)

    async def scenario():
        try:
            return await asyncio.gather(client.complete_ids([1, POISON], max_tokens=20, temperature=1.0),
                                        client.complete_ids([1, 2], max_tokens=20, temperature=1.0),
                                        return_exceptions=True)
        finally:
            await client.close()

    bad, good = asyncio.run(scenario())
    assert isinstance(bad, SequenceFailed) and "logits are not finite" in str(bad) and LOCAL_URL in str(bad)
    assert len(good.token_ids) == 20


def test_local_an_engine_that_breaks_fails_every_waiting_rollout_and_the_run(model_dir, tmp_path, builtins):
    from i3core.config import validate
    from i3core.loop.orchestrator import ClientSlot, Job, OpenGroup, Orchestrator

    client = local_client(model_dir, raise_at=4)
    env = make_component("env", "reverse-text", plugins=builtins)
    config = validate({"run": {"output_dir": str(tmp_path), "max_steps": 1}, "env": {"use": "reverse-text"}},
                      builtins)
    slot = ClientSlot(client, LOCAL_URL)
    orchestrator = Orchestrator(config, builtins, env, None, None, [slot], [])

    async def scenario():
        try:
            waiting = await asyncio.gather(*(client.complete_ids([1, 2, i], max_tokens=100, temperature=1.0)
                                             for i in range(3, 7)), return_exceptions=True)
            with pytest.raises(EngineFailed):
                await client.health()
            with pytest.raises(EngineFailed):
                await client.complete_ids([1, 2], max_tokens=2, temperature=1.0)
            example = env.examples()[0]
            group = OpenGroup(example, slot, outstanding=1, position=0)
            orchestrator._start(Job(group, slot))
            await asyncio.gather(*orchestrator._running, return_exceptions=True)
            with pytest.raises(EngineFailed, match="the engine failed: RuntimeError: injected fault"):
                orchestrator._collect()  # the run stops here with the engine's reason
            return waiting
        finally:
            await client.close()

    waiting = asyncio.run(scenario())
    assert all(isinstance(w, EngineFailed) and "injected fault" in str(w) for w in waiting), waiting


def test_a_temperature_of_1e_300_is_greedy_not_a_dead_engine(model_dir):
    """The issue's reproduction: it used to divide the logits by 1e-300 and end the engine task."""
    server = faulty_server(model_dir)

    async def scenario(session, url):
        tiny = await post(session, url, {**PLAIN, "temperature": 1e-300, "logprobs": 0})
        greedy = await post(session, url, {**PLAIN, "temperature": 0, "logprobs": 0})
        return tiny, greedy, await post(session, url, PLAIN)

    tiny, greedy, plain = asyncio.run(in_process(server, scenario))
    assert tiny[0] == greedy[0] == plain[0] == 200
    assert tiny[1]["choices"][0]["token_ids"] == greedy[1]["choices"][0]["token_ids"]


def test_the_sampler_isolates_a_row_it_cannot_sample(model_dir):
    """A row whose probabilities are not finite after temperature fails alone, in the engine itself."""
    import torch

    from i3core.plugins.inference.engine import Sequence, sample_rows

    seqs = [Sequence(i, Request([1], 4, temperature=t)) for i, t in enumerate((1.0, 1e-2, 0.0))]
    logits = torch.tensor([[0.0, 1.0, 2.0], [3e38, 0.0, -3e38], [1.0, 0.0, 0.0]])
    drawn = sample_rows(logits, seqs)
    assert isinstance(drawn[1], str) and drawn[1].startswith("sampling failed at completion token 0")
    assert drawn[0][0] in (0, 1, 2) and drawn[2][0] == 0
    nan = torch.tensor([[math_nan := float("nan"), 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    drawn = sample_rows(nan, seqs)
    assert "not finite" in drawn[0] and drawn[2][0] == 2 and math_nan != math_nan
