"""`i3core serve` judged by the official `openai` client (sync and async) and by vLLM's token-in wire format.

Two servers: `i3core serve` as a user runs it, on a saved tiny-moe (random weights: the text is noise, the shapes
and the equalities are what is checked), and, for what needs known output (tool calls, stop strings), the same
server code in-process over a scripted model plugin that writes a fixed text after the prompt.
"""

import asyncio
import json

import aiohttp
import openai
import pytest
import torch
from aiohttp.test_utils import TestServer
from openai.types import Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict
from torch import nn

from i3core import hookimpl
from i3core.plugins.inference.protocol import split_tool_calls
from i3core.plugins.inference.server import builtin_server, make_app, model_component
from i3core.plugins.models.tiny_moe import TinyMoE
from i3core.testing import make_component, plugin_manager

from .conftest import ADMIN_TOKEN, SERVED_MODEL, i3core_serve

NAME = "tiny-served"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Reverse 'abc'."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``i3core serve DIR`` in a subprocess; yields (base URL, model dir)."""
    directory = tmp_path_factory.mktemp("served") / "model"
    with i3core_serve(directory, NAME) as url:
        yield url, directory


@pytest.fixture(scope="module")
def builtin():
    """Whether the server is i3core's (its extras and exact token bytes are checked); tests/test_openai_vllm.py
    runs the tests that vLLM supports against a vLLM server with this False."""
    return True


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def test_models_lists_the_served_name_and_its_context(client):
    (card,) = client.models.list().data
    assert card.id == NAME and card.model_extra["max_model_len"] == 1024


def test_completions_strict_with_logprobs_in_openai_shape(client, builtin):
    raw = client.completions.with_raw_response.create(model=NAME, prompt="abc", max_tokens=6, temperature=0,
                                                      logprobs=3)
    data = json.loads(raw.text)
    completion = Completion.model_validate(data, strict=True)
    assert completion.id.startswith("cmpl-") and completion.model == NAME and completion.object == "text_completion"
    (choice,) = completion.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 6
    assert len(logprobs.top_logprobs) == 6 and all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens == 9
    if builtin:
        assert len(data["choices"][0]["versions"]) == len(data["choices"][0]["token_ids"]) == 6  # i3core's extras
    assert choice.finish_reason == "length"


def test_chat_strict_with_logprobs_and_text_parts(client, builtin):
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    chat = ChatCompletion.model_validate(json.loads(raw.text), strict=True)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.model == NAME
    (choice,) = chat.choices
    content = choice.logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in content)  # greedy: the most likely
    if builtin:  # each token's own bytes, also for a token holding part of a character (vLLM gives none there)
        assert all(entry.bytes for entry in content)
        assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", "replace") == choice.message.content
    lines = [MESSAGES[0], {"role": "user", "content": "Reverse\n'abc'."}]
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Reverse"},
                                                       {"type": "text", "text": "'abc'."}]}]  # joined by newlines
    one, other = (client.chat.completions.create(model=NAME, messages=m, max_completion_tokens=5, temperature=0)
                  for m in (lines, parts))
    assert one.choices[0].message.content == other.choices[0].message.content
    assert one.usage.prompt_tokens == other.usage.prompt_tokens == chat.usage.prompt_tokens  # a newline for a space


def test_streamed_answers_equal_the_whole_ones(client):
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    text = client.completions.create(model=NAME, prompt="abc", max_tokens=10, temperature=0).choices[0].text
    pieces = client.completions.create(model=NAME, prompt="abc", max_tokens=10, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == text


def test_sampling_settings_seed_n_and_top_k(client):
    def sample(**kw):
        out = client.completions.create(model=NAME, prompt="abc", max_tokens=8, logprobs=0, **kw)
        return [c.logprobs.tokens for c in out.choices]

    assert sample(seed=7, n=2) == sample(seed=7, n=2)  # seeded: reproducible
    first, second = sample(seed=7, n=2)
    assert first != second  # choice i samples with seed + i
    greedy = sample(temperature=0)
    assert sample(extra_body={"top_k": 1}, temperature=1.0, seed=3) == greedy  # top_k = 1 is greedy
    assert sample(top_p=1e-6, temperature=1.0, seed=3) == greedy  # so is a nucleus of one token
    narrow = client.completions.create(model=NAME, prompt="abc", max_tokens=8, extra_body={"top_k": 1}, seed=3,
                                       logprobs=0)
    assert narrow.choices[0].logprobs.token_logprobs == pytest.approx([0.0] * 8, abs=1e-6)  # renormalised


def test_tool_calls_and_tool_messages_are_rendered_by_the_chat_template(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "reverse", "arguments": '{"text": "abc"}'}}
    tools = [{"type": "function", "function": {"name": "reverse", "description": "Reverse a string.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cba"}]
    out = client.chat.completions.create(model=NAME, messages=messages, tools=tools, max_completion_tokens=2)
    rendered = TinyMoE.render_chat([*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "cba"}], tools)
    assert "cba" in rendered and '"name": "reverse"' in rendered and "<tools>" in rendered
    assert out.usage.prompt_tokens == len(TinyMoE(TinyMoE.Config()).tokenizer().encode(rendered).ids)


def test_sixteen_concurrent_streamed_chats(served):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)
        prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(16)]

        async def streamed(messages):
            stream = await client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=16,
                                                          temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def whole(messages):
            out = await client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=16,
                                                       temperature=0)
            return out.choices[0].message.content

        streams = await asyncio.gather(*(streamed(m) for m in prompts))
        wholes = await asyncio.gather(*(whole(m) for m in prompts))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(scenario())
    assert streams == wholes


def _scored_by_the_weights(directory, prompt_ids):
    """Each prompt token's logprob given those before it, from one forward of the served weights."""
    component = make_component("model", "tiny-moe", **SERVED_MODEL)
    net = component.load_hf(directory).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(net.logits(net(torch.tensor([prompt_ids]))).float(), dim=-1)[0]
    return [logprobs[i - 1, token].item() for i, token in enumerate(prompt_ids) if i]


def _without_first_prompt_token(data: dict) -> dict:
    """``data`` with each choice's first echoed token left out of its logprobs: OpenAI's types say float, not null."""
    data = json.loads(json.dumps(data))
    for choice in data["choices"]:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            choice["logprobs"][key] = choice["logprobs"][key][1:]
    return data


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(client, served, builtin):
    prompt = [97, 98, 99, 100, 101, 33, 32]
    reference = _scored_by_the_weights(served[1], prompt)
    raw = client.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=0, echo=True,
                                                      logprobs=1, temperature=0)  # what lm-eval's loglikelihood sends
    data = json.loads(raw.text)
    Completion.model_validate(_without_first_prompt_token(data), strict=True)
    (choice,) = data["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # OpenAI's, vLLM's
    assert logprobs["token_logprobs"][1:] == [pytest.approx(r, abs=2e-4) for r in reference]
    assert len(logprobs["tokens"]) == len(prompt) and choice["finish_reason"] == "length"
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert not builtin or data["usage"]["completion_tokens"] == 0  # (vLLM counts 1)
    assert all(len(top) in ((1,) if builtin else (1, 2)) and max(top.values()) >= lp - 1e-6  # vLLM adds the token
               for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:]))
    one = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    (choice,) = one.choices
    assert choice.logprobs.token_logprobs[1:len(prompt)] == [pytest.approx(r, abs=2e-4) for r in reference]
    assert len(choice.logprobs.tokens) == len(prompt) + 1 and choice.text.startswith(choice.logprobs.tokens[0])
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    stream = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
    vllm = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    scored = vllm.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for entry, token, logprob in zip(scored[1:], prompt[1:], reference):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=2e-4)
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]  # the two most likely, and the token's own


def test_a_batch_of_prompts_answers_choice_p_times_n_plus_j(client):
    prompts = ["abc", "hello there"]
    batch = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=5, seed=11)
    Completion.model_validate(batch.model_dump(), strict=True)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=NAME, prompt=p, n=2, max_tokens=5, seed=11) for p in prompts]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = [[97, 98, 99], [104, 105]]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    streamed = {}
    for chunk in client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in by_ids.choices} and len(streamed) == 2


def test_vllm_sampling_extensions_steer_generation(client, served):
    eos = make_component("model", "tiny-moe", **SERVED_MODEL).eos_token_id

    def complete(**extra):
        return client.completions.create(model=NAME, prompt="abc", max_tokens=6, temperature=0,
                                         extra_body=extra).choices[0]

    first = client.completions.create(model=NAME, prompt="abc", max_tokens=1, temperature=0)
    first_token = (first.choices[0].model_extra.get("token_ids") or [None])[0]
    forced = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0.8, seed=1,
                                       logit_bias={"120": 100}, logprobs=0).choices[0]
    assert forced.text == "x" * 4 and forced.logprobs.token_logprobs == pytest.approx([0.0] * 4, abs=1e-4)
    assert complete(logit_bias={str(eos): 100}).finish_reason == "stop"  # the end-of-sequence token, by default
    assert complete(logit_bias={str(eos): 100}, ignore_eos=True).finish_reason == "length"
    assert complete(logit_bias={str(eos): 100}, stop_token_ids=[eos], ignore_eos=True).finish_reason == "stop"
    if first_token is not None:  # builtin: token ids to compare
        held = complete(stop_token_ids=[first_token], min_tokens=3)
        assert len(held.model_extra["token_ids"]) >= 3 and held.model_extra["token_ids"][0] != first_token
        distinct = complete(repetition_penalty=1e4)
        tokens = distinct.model_extra["token_ids"]
        assert len(set(tokens)) == len(tokens) and not set(tokens) & set(distinct.model_extra["prompt_token_ids"])


def test_context_overflow_is_openais_context_length_exceeded(client, builtin):
    with pytest.raises(openai.BadRequestError) as caught:  # a history over the context (an agent's)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a " * 1100}])
    assert "maximum context length is 1024 tokens" in caught.value.message  # what litellm matches (vLLM too)
    if builtin:  # OpenAI's code (vLLM answers code 400); vLLM 0.32 cuts max_tokens to fit instead of refusing
        assert caught.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=NAME, prompt=[97] * 1000, max_tokens=100)
        assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_tokens"
        assert "maximum context length is 1024 tokens" in caught.value.message
        with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
            client.completions.create(model=NAME, prompt="abc", max_tokens=5000)


@pytest.mark.parametrize("kwargs, words", [
    ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
    ({"logit_bias": {"5": 300}}, "logit_bias must map token ids to numbers in"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a finite number in"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio is not supported"),
    ({"tool_choice": "required", "tools": []}, "tool_choice must be"),
    ({"extra_body": {"max_tokns": 3}}, "did you mean 'max_tokens'"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
])
def test_refused_fields_are_400s_naming_them_and_the_server_keeps_serving(client, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=2, **kwargs)
    assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=2).choices


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=2, presence_penalty=0,
                                         frequency_penalty=0, response_format={"type": "text"}, user="u1")
    # sampled at temperature 1: the tiny model may end its turn within the two tokens (CI once drew that)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 2


def test_token_in_generate_as_vllm_serves_it_with_session_versions(served):
    url, _ = served
    body = {"model": NAME, "token_ids": [97, 98, 99],
            "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 1, "stop_token_ids": [],
                                "skip_special_tokens": False}}

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/inference/v1/generate", json=body,
                                    headers={"X-Session-ID": "episode-1"}) as response:
                assert response.status == 200
                data = await response.json()
            async with session.get(url + "/inference/v1/sessions/episode-1") as response:
                assert response.status == 401  # the session routes are the run's: they ask for the admin token
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with session.get(url + "/inference/v1/sessions/episode-1", headers=admin) as response:
                record = await response.json()
            async with session.delete(url + "/inference/v1/sessions/episode-1", headers=admin) as response:
                assert response.status == 200
            async with session.get(url + "/inference/v1/sessions/episode-1", headers=admin) as response:
                assert response.status == 404
        return data, record

    data, record = asyncio.run(scenario())
    (choice,) = data["choices"]
    assert data["prompt_token_ids"] == [97, 98, 99] and len(choice["token_ids"]) == 5
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]  # what renderers reads
    assert all(len(e["top_logprobs"]) == 1 for e in content)
    (turn,) = record["turns"]
    assert turn["token_ids"] == choice["token_ids"] and turn["versions"] == [0] * 5 and turn["prompt_len"] == 3
    completions = openai.OpenAI(base_url=url + "/v1", api_key="none").completions.create(
        model=NAME, prompt=[97, 98, 99], max_tokens=5, temperature=0)
    assert completions.choices[0].model_extra["token_ids"] == choice["token_ids"]


# -- a scripted model: known output for tool calls and stop strings ---------------------------------------------


class ScriptedLM(nn.Module):
    """Writes ``script`` (token ids) from position ``start`` on, whatever the prompt: token at position ``p``
    predicts ``script[p + 1 - start]``. Logits are one-hot times 50, so greedy and sampling agree."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.dummy = nn.Parameter(torch.zeros(1))
        self.script, self.start = [], 0

    def _hidden(self, positions):
        out = torch.zeros(*positions.shape, self.vocab_size)
        for index, position in enumerate(positions.reshape(-1).tolist()):
            k = position + 1 - self.start
            if 0 <= k < len(self.script):
                out.view(-1, self.vocab_size)[index, self.script[k]] = 50.0
        return out

    def forward(self, input_ids, position_ids):
        return self._hidden(position_ids)

    def logits(self, hidden):
        return hidden

    def new_kv_cache(self, slots, max_len):
        return None

    def forward_cached(self, input_ids, positions, cache, slots):
        return self._hidden(positions)

    def state_dict_from_hf(self, tensors):
        return {"dummy": tensors["dummy"]}


class Scripted(TinyMoE):
    """tiny-moe's tokenizer and chat template over :class:`ScriptedLM`."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def load_hf(self, path):
        return ScriptedLM(self.tokenizer().get_vocab_size())


class ScriptedPlugin:
    @hookimpl
    def i3_register_models(self, register):
        register("scripted", Scripted)


@pytest.fixture
def scripted(tmp_path):
    """An in-process server over the scripted model; yields (async client factory, set_script(messages, text))."""
    component = model_component("scripted", {}, plugin_manager(ScriptedPlugin(), installed=False))
    (tmp_path / "config.json").write_text("{}")
    server = builtin_server(tmp_path, component, max_slots=4, max_len=512, version=0, served_name="scripted")
    tokenizer = component.tokenizer()

    def set_script(messages, text, tools=None):
        model = server.engine.model
        model.start = len(tokenizer.encode(component.render_chat(messages, tools)).ids)
        model.script = [*tokenizer.encode(text).ids, *component.end_of_turn_ids]

    async def start():
        http = TestServer(make_app(server), host="127.0.0.1")
        await http.start_server()
        return http, openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)

    return start, set_script


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALLING = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'



async def tool_chat_whole_and_streamed(client, messages):
    """The scripted model's chat answer with :data:`TOOLS` offered, once whole and once as the streamed chunks."""
    whole = await client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0)
    stream = await client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0,
                                                  stream=True)
    return whole, [c async for c in stream]

def test_tool_calls_are_parsed_into_message_tool_calls_streamed_or_not(scripted):
    start, set_script = scripted
    messages = [{"role": "user", "content": "2 + 3?"}]
    set_script(messages, CALLING, TOOLS)

    async def scenario():
        http, client = await start()
        try:
            whole, chunks = await tool_chat_whole_and_streamed(client, messages)
            set_script(messages, CALLING)  # the same text without tools offered: no calls read out of it
            plain = await client.chat.completions.create(model="scripted", messages=messages, temperature=0)
        finally:
            await client.close()
            await http.close()
        return whole, chunks, plain

    whole, chunks, plain = asyncio.run(scenario())
    ChatCompletion.model_validate(whole.model_dump(), strict=True)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add. "
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "Let me add. " and "<tool_call" not in streamed  # the call is not streamed as text
    (streamed_call,) = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert streamed_call.function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == CALLING and plain.choices[0].finish_reason == "stop"  # no tools


def test_stop_strings_cut_the_text_streamed_or_not(scripted):
    start, set_script = scripted
    messages = [{"role": "user", "content": "count"}]
    set_script(messages, "one, two, three, four")

    async def scenario():
        http, client = await start()
        try:
            whole = await client.chat.completions.create(model="scripted", messages=messages, stop=[", thr", "zzz"],
                                                         temperature=0)
            stream = await client.chat.completions.create(model="scripted", messages=messages, stop=", thr",
                                                          temperature=0, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            kept = await client.chat.completions.create(model="scripted", messages=messages, stop=", thr",
                                                        temperature=0, extra_body={"include_stop_str_in_output": True})
            late = await client.chat.completions.create(model="scripted", messages=messages, temperature=0,
                                                        extra_body={"ignore_eos": True, "max_tokens": 30})
        finally:
            await client.close()
            await http.close()
        return whole, streamed, kept, late

    whole, streamed, kept, late = asyncio.run(scenario())
    assert whole.choices[0].message.content == "one, two" and whole.choices[0].finish_reason == "stop"
    assert streamed == "one, two"
    assert kept.choices[0].message.content == "one, two, thr"  # vLLM's include_stop_str_in_output
    # ignore_eos: the model's end-of-sequence ids (here also the end of the turn) no longer stop it, as on vLLM
    assert late.choices[0].finish_reason == "length"
    assert late.choices[0].message.content.startswith("one, two, three, four")
    assert whole.usage.completion_tokens == len("one, two, thr")  # cut after the token that completed it


@pytest.mark.parametrize("arguments", ["[" * 100_000, "9" * 5000, "NaN", "-Infinity", "[1, 2]", "3"])
def test_a_block_the_json_parser_refuses_or_that_is_no_call_stays_text(arguments):
    """Nesting past the parser's depth, an integer past int()'s digits, NaN, arguments that are no object: text,
    not an error of the server's."""
    text = 'A <tool_call>{"name": "add", "arguments": ' + arguments + '}</tool_call>'
    assert split_tool_calls(text) == (text, [])


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>{"name": "add", "arguments": </tool_call> and then more text',  # not JSON
    "Sure. <tool_call> never closed, and text after it",
    'A <tool_call>{"arguments": {}}</tool_call> call without a name',
    'A <tool_call>{"name": "add", "arguments": NaN}</tool_call> call whose arguments are not JSON',
    'A <tool_call>{"name": "add", "arguments": [1, 2]}</tool_call> call whose arguments are no object',
])
def test_a_malformed_tool_block_stays_text_streamed_exactly_as_not(scripted, text):
    start, set_script = scripted
    messages = [{"role": "user", "content": "2 + 3?"}]
    set_script(messages, text, TOOLS)

    async def scenario():
        http, client = await start()
        try:
            whole, chunks = await tool_chat_whole_and_streamed(client, messages)
        finally:
            await client.close()
            await http.close()
        return whole, chunks

    whole, chunks = asyncio.run(scenario())
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "stop"
    assert not whole.choices[0].message.tool_calls
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # nothing held back
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [
    {"max_tokens": 12, "stop_token_ids": []},  # finish_reason length
    {"max_tokens": 40},  # stop at the end-of-sequence token, or length
    {"max_tokens": 10, "temperature": 0},
    {"max_tokens": 1000, "stop_token_ids": []},  # max_len ends it
    {"max_tokens": 80, "stop": ["e", "a"], "stop_token_ids": []},  # stop strings (matched in the engine)
    {"max_tokens": 80, "stop": "\u00e9", "stop_token_ids": []},  # a stop string of a two-byte character
])
def test_streamed_completions_equal_whole_ones_in_text_ids_logprobs_and_versions(served, extra):
    """For the same seed and n = 3: the concatenated stream is the whole answer, choice by choice (i3core's extras
    included), with the same finish reason."""
    url, _ = served
    body = {"prompt": [97, 98, 99], "n": 3, "seed": 11, "logprobs": 2, "temperature": 1.0, **extra}

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body) as response:
                whole = await response.json()
            async with session.post(url + "/v1/completions", json={**body, "stream": True}) as response:
                events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
        return whole, events

    whole, events = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    pieces = {i: {"text": "", "token_ids": [], "versions": [], "logprobs": [], "tokens": [], "finish": None}
              for i in range(3)}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            piece = pieces[choice["index"]]
            piece["text"] += choice["text"]
            piece["token_ids"] += choice.get("token_ids", [])
            piece["versions"] += choice.get("versions", [])
            if choice["logprobs"]:
                piece["logprobs"] += choice["logprobs"]["token_logprobs"]
                piece["tokens"] += choice["logprobs"]["tokens"]
            piece["finish"] = choice["finish_reason"] or piece["finish"]
    for choice in whole["choices"]:
        piece = pieces[choice["index"]]
        assert piece["text"] == choice["text"]
        assert piece["token_ids"] == choice["token_ids"] and piece["versions"] == choice["versions"]
        assert piece["logprobs"] == choice["logprobs"]["token_logprobs"]
        assert piece["tokens"] == choice["logprobs"]["tokens"]
        assert piece["finish"] == choice["finish_reason"]
    if body["temperature"]:
        assert len({tuple(c["token_ids"]) for c in whole["choices"]}) == 3  # seed + i: three different samples


RESPONSE_TOOLS = [{"type": "function", "name": "add", "description": "Add.", "strict": False, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


def _strict_events(raw: str) -> list:
    """Every server-sent event of a Responses stream, each validated strictly by the openai client's own types."""
    from openai.types.responses.response_stream_event import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        event = adapter.validate_python(json.loads(lines["data"]), strict=True)
        assert event.type == lines["event"]
        events.append(event)
    return events


def test_responses_api_calls_a_function_tool_and_continues_by_previous_response_id(scripted):
    from openai.types.responses import Response

    start, set_script = scripted
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")}}
                  for t in RESPONSE_TOOLS]
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]

    async def scenario():
        http, client = await start()
        try:
            set_script(first, CALLING, chat_tools)
            whole = await client.responses.with_raw_response.create(
                model="scripted", instructions="Be brief.", input="2 + 3?", tools=RESPONSE_TOOLS,
                max_output_tokens=150, temperature=0)
            stream = await client.responses.with_raw_response.create(
                model="scripted", instructions="Be brief.", input=[{"role": "user", "content": "2 + 3?"}],
                tools=RESPONSE_TOOLS, temperature=0, stream=True)
            raw_events = await stream.http_response.aread()
            called = Response.model_validate(json.loads(whole.text), strict=True)
            (call,) = [item for item in called.output if item.type == "function_call"]
            follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
            history = [*first, {"role": "assistant", "content": called.output_text, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
            set_script(history, "It is 5.", chat_tools)
            answer = await client.responses.create(model="scripted", instructions="Be brief.", input=follow,
                                                   tools=RESPONSE_TOOLS, previous_response_id=called.id,
                                                   temperature=0)
            again = await client.responses.create(  # the same conversation sent whole: the same prompt
                model="scripted", instructions="Be brief.", tools=RESPONSE_TOOLS, temperature=0, input=[
                    {"role": "user", "content": "2 + 3?"},
                    {"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": called.output_text, "annotations": []}]},
                    {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
                    *follow])
            with pytest.raises(openai.BadRequestError, match="web_search are not supported") as refused:
                await client.responses.create(model="scripted", input="hi", tools=[{"type": "web_search"}])
            with pytest.raises(openai.BadRequestError, match="not found"):
                await client.responses.create(model="scripted", input="hi", previous_response_id="resp_nope")
        finally:
            await client.close()
            await http.close()
        return called, raw_events.decode(), answer, again, refused.value

    called, raw_events, answer, again, refused = asyncio.run(scenario())
    assert called.status == "completed" and called.output_text == "Let me add. "  # the text before the call
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3} and call.call_id.startswith("call_")
    assert called.usage.total_tokens == called.usage.input_tokens + called.usage.output_tokens
    events = _strict_events(raw_events)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-8:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == called.output_text and "<tool_call" not in deltas  # a stream sends the same bytes
    done = events[-1].response
    assert done.output[-1].name == "add" and json.loads(done.output[-1].arguments) == {"a": 2, "b": 3}
    assert answer.output_text == again.output_text == "It is 5."  # the stored conversation is the one sent whole
    assert answer.usage.input_tokens == again.usage.input_tokens and answer.previous_response_id == called.id
    assert refused.param == "tools"


def test_responses_api_on_the_served_model_strict_and_streamed(client, builtin):
    from openai.types.responses import Response

    raw = client.responses.with_raw_response.create(model=NAME, input="abc", max_output_tokens=6, temperature=0)
    whole = Response.model_validate(json.loads(raw.text), strict=True)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6
    streamed = list(client.responses.create(model=NAME, input="abc", max_output_tokens=6, temperature=0,
                                            stream=True))
    assert streamed[-1].type == "response.completed"
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == whole.output_text
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=NAME, input="a " * 1100)
    assert "maximum context length is 1024 tokens" in caught.value.message
    assert not builtin or caught.value.code == "context_length_exceeded"


def test_tokenize_detokenize_and_version_as_vllm_serves_them(served, client, builtin):
    url, _ = served
    tokenizer = make_component("model", "tiny-moe", **SERVED_MODEL).tokenizer()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async def post(path, body):
                async with session.post(url + path, json=body) as response:
                    return response.status, await response.json()

            text = await post("/tokenize", {"model": NAME, "prompt": "hello"})
            chat = await post("/tokenize", {"model": NAME, "messages": MESSAGES})
            back = await post("/detokenize", {"model": NAME, "tokens": text[1]["tokens"]})
            both = await post("/tokenize", {"prompt": "x", "messages": MESSAGES})
            async with session.get(url + "/version") as response:
                version = await response.json()
        return text, chat, back, both, version

    text, chat, back, both, version = asyncio.run(scenario())
    assert text[0] == 200 and text[1]["tokens"] == tokenizer.encode("hello").ids
    assert text[1]["count"] == len(text[1]["tokens"]) and text[1]["max_model_len"] == 1024
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=1)
    assert chat[1]["count"] == reply.usage.prompt_tokens  # the chat route's own rendering
    assert back == (200, {"prompt": tokenizer.decode(text[1]["tokens"], skip_special_tokens=False)})
    if builtin:  # i3core refuses the ambiguous request by name
        assert both[0] == 400 and both[1]["error"]["param"] == "prompt"
    assert isinstance(version["version"], str) and version["version"]


def test_serve_refuses_a_max_len_above_the_models_positions(tmp_path):
    import subprocess
    import sys

    model = make_component("model", "tiny-moe", **SERVED_MODEL)
    model.save_hf(model.build(seed=0), tmp_path)
    result = subprocess.run([sys.executable, "-m", "i3core.cli", "serve", str(tmp_path), "--max-len", "8192",
                             "--model-option", f"hidden_size={SERVED_MODEL['hidden_size']}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--max-len 8192 exceeds the model's max_position_embeddings (2048)" in line


def test_a_stream_holds_back_exactly_the_longest_start_of_a_stop_string_its_text_ends_with():
    """:func:`_begun` (the held-back part of a streamed text: where the last characters hold a stop string's first
    one, no more) against its definition, every proper prefix of the stop tried in turn, on random texts."""
    import random

    from i3core.plugins.inference.openai_api import _begun

    def definition(text: str, end: int, marker: str) -> int:
        return next((cut for cut in range(min(len(marker) - 1, end), 0, -1) if text[:end].endswith(marker[:cut])), 0)

    rng = random.Random(0)
    for _ in range(20_000):
        marker = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        end = rng.randint(0, len(text))
        assert _begun(text, end, marker) == definition(text, end, marker), (text, end, marker)
