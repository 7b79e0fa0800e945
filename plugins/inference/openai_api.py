"""The builtin server's OpenAI surface, a thin adapter over :class:`~i3core.plugins.inference.server.Server`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``), ``GET /v1/models``, and
vLLM's token-in ``POST /inference/v1/generate`` (what verifiers' training client and the ``renderers`` package
post), with ``GET``/``DELETE /inference/v1/sessions/{id}`` for the per-token policy versions recorded under a
request's ``X-Session-ID``. Request fields are checked by :mod:`~i3core.plugins.inference.protocol`; the engine
knows nothing of HTTP, JSON or chat. What is supported, refused and added is in docs/serving.md.

Stop strings are the engine's: it matches them on the text as it decodes (and cuts the text and the tokens); a
handler only formats what the engine found. A sequence is only followed step by step (:meth:`Server.follow`) when
the request streams; otherwise the handler waits for it once.
"""

import asyncio
import functools
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from i3core.errors import SequenceFailed
from i3core.plugins.inference.engine import Request, Sequence
from i3core.plugins.inference.observability import TRACE
from i3core.text import end_ids, stop_index
from i3core.plugins.inference.protocol import (
    REQUEST_MODELS,
    STREAM_END,
    error_response,
    TOOL_CALL_OPEN,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    Sampling,
    completion_choice,
    finite,
    openapi,
    parse,
    parse_json_object,
    prompt_token_ids,
    split_tool_calls,
    usage,
)
from i3core.plugins.inference.responses import Responses

SESSION_HEADER = "X-Session-ID"
MAX_SESSIONS = 4096
"""Sessions whose versions are kept (the oldest is forgotten first): an env adapter reads its own at once."""
MAX_SESSION_TURNS = 1024


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (what ``tokenizers``' ByteLevel pre-tokenizer maps to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_level_table()


@dataclass
class Output:
    """One finished choice: its tokens (cut after a stop string), its text and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top: list[list[tuple[int, float]]]
    text: str
    finish_reason: str

    @classmethod
    def of(cls, seq: Sequence, count: int, text: str, finish_reason: str) -> "Output":
        return cls(seq.token_ids[:count], seq.logprobs[:count], seq.versions[:count], seq.top_logprobs[:count],
                   text, finish_reason)


@dataclass
class Echo:
    """The prompt a completion choice echoes: its text and, with ``logprobs``, OpenAI's legacy logprobs of it."""

    text: str
    logprobs: dict | None


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Where each token's text starts, from ``start`` (OpenAI's ``text_offset``)."""
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def _joined(first: dict, then: dict) -> dict:
    """Two spans of legacy logprobs (an echoed prompt, its completion) as one."""
    return {key: [*(first[key] or []), *(then[key] or [])] for key in first}


class TextStream:
    """What of a growing sequence's text (the engine's, whole characters only) may be streamed.

    ``hold`` is a marker after which nothing is streamed as content (``<tool_call>`` when tools are offered);
    a suffix that could still become a stop string or the marker is held back until the next tokens decide it.
    """

    def __init__(self, sampling: Sampling, hold: str | None = None):
        self.sampling, self.hold = sampling, hold

    def sendable(self, text: str) -> int:
        """How much of ``text`` may be streamed now: never a stop string (the engine may have found one a step
        later than the follower looks), nor what could still begin one."""
        end = stop_index(text, self.sampling.stop)
        if self.hold is not None and self.hold in text:
            end = min(end, text.index(self.hold))
        for marker in (*self.sampling.stop, *([self.hold] if self.hold else [])):
            end -= _begun(text, end, marker)
        return end


def _begun(text: str, end: int, marker: str) -> int:
    """The length of the longest part of ``marker`` short of the whole that ``text[:end]`` ends with: where the
    text's last ``len(marker) - 1`` characters hold the marker's first one, no more (16 stop strings of 256
    characters, each cut tried in turn, slowed every stream of the server fourfold)."""
    start = max(end - len(marker) + 1, 0)
    at = text.find(marker[0], start, end)
    while at != -1:
        if marker.startswith(text[at:end]):
            return end - at
        at = text.find(marker[0], at + 1, end)
    return 0


class PerPrompt:
    """``make(seq)`` once per prompt of a request whose sequence ``i`` is choice ``i % n`` of prompt ``i // n``."""

    def __init__(self, make, n: int):
        self.make, self.n, self.made = make, n, {}

    def __call__(self, i: int, seq: Sequence):
        prompt = i // self.n
        if prompt not in self.made:
            self.made[prompt] = self.make(seq)
        return self.made[prompt]


async def together(coroutines) -> list:
    """Await every coroutine (one a choice); the first failure cancels the others (their sequences are aborted)
    and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def send_error(response: web.StreamResponse, exc: Exception) -> web.StreamResponse:
    """End a stream whose 200 is already sent with the error as an event (as vLLM does), then ``[DONE]``."""
    _, body = error_response(exc)
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def served(http: web.Request, prompt_tokens: int, outputs: list[Output]) -> None:
    """What the request line says of a served request: its tokens and finish reasons."""
    http[TRACE].update(prompt_tokens=prompt_tokens, completion_tokens=sum(len(o.token_ids) for o in outputs),
                       finish_reason=",".join(dict.fromkeys(o.finish_reason for o in outputs)))


def _check(seq: Sequence) -> None:
    """:raises SequenceFailed: ``seq`` failed alone in the engine (answered 500; the server goes on)."""
    if seq.finish_reason == "error":
        raise SequenceFailed(f"generation failed: {seq.error}")


class OpenAIRoutes:
    """The OpenAI and token-in routes of one :class:`~i3core.plugins.inference.server.Server`."""

    def __init__(self, server):
        self.server = server
        self.sessions: OrderedDict[str, list[dict]] = OrderedDict()
        self._token_texts: dict[int, str] = {}
        """Each token id's text, as logprobs show it (ids are checked against the vocabulary: bounded by it)."""

    def routes(self) -> list:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            *Responses(self, served).web_routes(),
            web.get("/v1/models", self.models),
            web.post("/inference/v1/generate", self.generate),
            web.get("/inference/v1/sessions/{session_id}", self.session),
            web.delete("/inference/v1/sessions/{session_id}", self.forget_session),
            web.get("/openapi.json", self.schema),
        ]

    async def schema(self, http: web.Request) -> web.Response:
        """The request schema: every POST route's body model with its bounds (OpenAPI 3.1)."""
        return web.json_response(openapi(REQUEST_MODELS, f"i3core server: {self.server.model_name}"))

    # -- requests into sequences ------------------------------------------------------------------------------

    def _sequences(self, prompts: list[list[int]], sampling: Sampling) -> list[Sequence]:
        """The ``n`` sequences of each prompt (sequence ``p * n + j``: choice ``j`` of prompt ``p``, OpenAI's
        index), checked before anything is queued or any byte is sent.

        :raises ContextLengthExceeded: a prompt with its ``max_tokens`` does not fit the context.
        """
        prompt_logprobs = sampling.prompt_logprobs
        if sampling.echo and sampling.logprobs is not None:  # the echoed prompt's logprobs, from its prefill
            prompt_logprobs = max(prompt_logprobs or 0, sampling.logprobs)
        return [
            self.server.new_sequence(Request(
                list(prompt_ids), sampling.fit(len(prompt_ids), self.server.engine.max_len), sampling.temperature,
                sampling.stop_token_ids, sampling.seed_of(j), top_p=sampling.top_p, top_k=sampling.top_k,
                top_logprobs=sampling.logprobs or 0, stop=sampling.stop,
                skip_special_tokens=sampling.skip_special_tokens, stream=sampling.stream,
                include_stop_str_in_output=sampling.include_stop_str_in_output,
                prompt_logprobs=prompt_logprobs, min_tokens=sampling.min_tokens,
                repetition_penalty=sampling.repetition_penalty, presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty, logit_bias=sampling.logit_bias,
            ))
            for prompt_ids in prompts for j in range(sampling.n)
        ]  # fmt: skip

    async def _run(self, seq: Sequence, sampling: Sampling, hold: str | None = None, on_delta=None) -> Output:
        """Generate ``seq`` to its end: a stop token, ``max_tokens``, ``max_len`` or a stop string (the engine
        cuts the tokens after the one that completed it, and the text before it). ``on_delta(text, first, last)``
        gets each piece of text that may be streamed with the tokens ``[first, last)`` produced since the
        previous call."""
        if on_delta is None:
            seq = await self.server.generate(seq)
            _check(seq)
            return Output.of(seq, len(seq.token_ids), seq.text, seq.finish_reason)
        stream = TextStream(sampling, hold)
        sent_text, sent_tokens = 0, 0
        async for count, finish_reason in self.server.follow(seq):
            # ``count`` and ``finish_reason`` are what the step left; the engine thread may already be appending
            if finish_reason == "error":
                _check(seq)
            if finish_reason is not None:  # all of it, up to the first well-formed tool call (the engine set
                output = Output.of(seq, count, seq.text, finish_reason)  # the text before the finish reason)
                text, end = output.text, len(output.text)
                if hold is not None and split_tool_calls(text)[1]:
                    end = text.index(hold)
            else:
                output = None
                count, text = seq.decoded  # the engine's text so far and the tokens it covers: one pair
                end = stream.sendable(text)
            if end > sent_text or count > sent_tokens:
                await on_delta(text[sent_text:end] if end > sent_text else "", sent_tokens, count)
                sent_text, sent_tokens = max(sent_text, end), count
            if output is not None:
                return output
        raise AssertionError("a followed sequence ended without finishing")  # follow() yields it finished last

    # -- /v1/completions --------------------------------------------------------------------------------------

    async def completions(self, http: web.Request) -> web.StreamResponse:
        server = self.server
        request = parse(CompletionRequest, parse_json_object(await http.read()))
        engine, eos = server.engine, end_ids(server.model)
        texts = request.texts()
        encoded = dict(zip(texts, await server.encode_many(texts)))
        prompts = request.prompts(engine.vocab_size, encoded.__getitem__)
        sampling = request.stream_sampling(engine.max_len, engine.vocab_size, eos, eos)
        seqs = self._sequences(prompts, sampling)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if sampling.stream:
            return await self._stream(http, seqs, sampling, prompts, request_id, "text_completion", created)
        outputs = await together(self._run(seq, sampling) for seq in seqs)
        served(http, sum(map(len, prompts)), outputs)
        server.requests_served += 1
        choices = []
        # a prompt's echo and prompt logprobs are the same for its n choices: built once (64 choices of a
        # 1023-token prompt with 20 alternatives held the event loop 8 s when each built its own)
        echoes = PerPrompt(lambda seq: self._echo(seq, sampling), sampling.n)
        prompt_logprobs = PerPrompt(lambda seq: self._vllm_prompt_logprobs(seq, sampling.prompt_logprobs), sampling.n)
        for i, (seq, out) in enumerate(zip(seqs, outputs)):
            prompt = echoes(i, seq)
            logprobs = None
            if sampling.logprobs is not None:
                logprobs = self._completion_logprobs(out, len(prompt.text) if prompt else 0)
                if prompt is not None:
                    logprobs = _joined(prompt.logprobs, logprobs)
            choice = completion_choice(i, (prompt.text if prompt else "") + out.text, seq.request.prompt_ids,
                                       out.token_ids, out.logprobs, out.versions, out.finish_reason, logprobs)
            if sampling.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(i, seq)
            choices.append(choice)
        return web.json_response(self._envelope(request_id, "text_completion", created, choices, prompts,
                                                sampling.n))

    def _echo(self, seq: Sequence, sampling: Sampling) -> "Echo | None":
        """The prompt a choice echoes (``echo``): its text and, with ``logprobs``, OpenAI's legacy logprobs of its
        tokens (the first one's logprob and alternatives null, as OpenAI and vLLM give them)."""
        if not sampling.echo:
            return None
        ids = seq.request.prompt_ids
        text = self.server.tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        if sampling.logprobs is None:
            return Echo(text, None)
        k = sampling.logprobs
        tokens = [self._token_text(t) for t in ids]
        top = [None] + [{self._token_text(t): finite(lp) for t, lp in alternatives[:k]}
                        for alternatives in seq.prompt_top_logprobs[1:]]
        logprobs = {"tokens": tokens, "token_logprobs": [None, *(finite(lp) for lp in seq.prompt_logprobs[1:])],
                    "top_logprobs": top, "text_offset": _offsets(tokens, 0)}
        return Echo(text, logprobs)

    def _vllm_prompt_logprobs(self, seq: Sequence, k: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) ``{token id: {"logprob", "rank",
        "decoded_token"}}`` holding the token itself and the ``k`` most likely at its place."""
        out: list[dict | None] = [None]
        for token, logprob, rank, alternatives in zip(seq.request.prompt_ids[1:], seq.prompt_logprobs[1:],
                                                      seq.prompt_ranks[1:], seq.prompt_top_logprobs[1:]):
            entry = {str(t): {"logprob": finite(lp), "rank": r + 1, "decoded_token": self._token_text(t)}
                     for r, (t, lp) in enumerate(alternatives[:k])}
            entry[str(token)] = {"logprob": finite(logprob), "rank": rank, "decoded_token": self._token_text(token)}
            out.append(entry)
        return out

    def _completion_logprobs(self, out: Output, offset: int, first: int = 0, last: int | None = None) -> dict:
        """OpenAI's legacy logprobs of tokens ``[first, last)``: ``tokens``, ``token_logprobs``,
        ``top_logprobs`` (token text -> logprob), ``text_offset`` (from ``offset`` in the completion's text)."""
        last = len(out.token_ids) if last is None else last
        tokens = [self._token_text(t) for t in out.token_ids[first:last]]
        top = [{self._token_text(t): finite(lp) for t, lp in alternatives} for alternatives in out.top[first:last]]
        return {"tokens": tokens, "token_logprobs": [finite(lp) for lp in out.logprobs[first:last]],
                "top_logprobs": top or None, "text_offset": _offsets(tokens, offset)}

    # -- /v1/chat/completions ---------------------------------------------------------------------------------

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        server = self.server
        request = parse(ChatRequest, parse_json_object(await http.read()))
        tools = request.offered_tools()
        # the template writes its own special tokens (a BOS): the tokenizer adds none
        prompt_ids = await server.encode(server.render_chat(request.template_messages(), tools),
                                         add_special_tokens=False, param="messages")
        # by default: the end of the assistant's turn, or of the text
        sampling = request.stream_sampling(server.engine.max_len, server.engine.vocab_size,
                                           end_ids(server.model, chat=True), end_ids(server.model))
        seqs = self._sequences([prompt_ids], sampling)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        hold = TOOL_CALL_OPEN if tools else None
        if sampling.stream:
            return await self._stream(http, seqs, sampling, [prompt_ids], request_id, "chat.completion.chunk",
                                      created, hold)
        outputs = await together(self._run(seq, sampling, hold) for seq in seqs)
        served(http, len(prompt_ids), outputs)
        server.requests_served += 1
        choices = []
        for i, out in enumerate(outputs):
            content, calls = split_tool_calls(out.text) if tools else (out.text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({
                "index": i, "message": message,
                "logprobs": self._chat_logprobs(out) if sampling.logprobs is not None else None,
                "finish_reason": "tool_calls" if calls else out.finish_reason,
                **self._extras(out),
            })  # fmt: skip
        return web.json_response(self._envelope(request_id, "chat.completion", created, choices, [prompt_ids],
                                                sampling.n))

    def _chat_logprobs(self, out: Output, first: int = 0, last: int | None = None) -> dict:
        """OpenAI's chat logprobs of tokens ``[first, last)``: ``content[{token, logprob, bytes, top_logprobs}]``."""
        last = len(out.token_ids) if last is None else last
        content = []
        for token, logprob, alternatives in zip(out.token_ids[first:last], out.logprobs[first:last],
                                                out.top[first:last] or [[]] * (last - first)):
            entry = self._token_entry(token, logprob)
            entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in alternatives]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _token_entry(self, token: int, logprob: float) -> dict:
        return {"token": self._token_text(token), "logprob": finite(logprob), "bytes": self._token_bytes(token)}

    def _token_bytes(self, token: int) -> list[int]:
        """The token's own bytes: exact for a byte-level tokenizer (a token may hold part of a character),
        else its text in UTF-8."""
        tokenizer = self.server.tokenizer
        if type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel":
            piece = tokenizer.id_to_token(token) or ""
            if all(ch in _UNICODE_TO_BYTE for ch in piece):
                return [_UNICODE_TO_BYTE[ch] for ch in piece]
        return list(self._token_text(token).encode("utf-8", "surrogatepass"))

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:  # one tokenizer call per token id of the vocabulary, ever
            text = self._token_texts[token] = self.server.tokenizer.decode([token], skip_special_tokens=False)
        return text

    @staticmethod
    def _extras(out: Output) -> dict:
        """i3core's fields on a choice: the sampled token ids, their logprobs and policy versions."""
        return {"token_ids": out.token_ids, "token_logprobs": out.logprobs, "versions": out.versions}

    # -- streaming --------------------------------------------------------------------------------------------

    async def _stream(self, http: web.Request, seqs: list[Sequence], sampling: Sampling, prompts: list[list[int]],
                      request_id: str, kind: str, created: int, hold: str | None = None) -> web.StreamResponse:
        """Server-sent events: one chunk per piece of each choice, a last chunk per choice with its
        ``finish_reason`` (and, with tools, its ``tool_calls``), a usage chunk when asked, then ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        http[STREAM_END] = functools.partial(send_error, response)
        lock = asyncio.Lock()
        chat = kind == "chat.completion.chunk"

        async def send(choices: list[dict], **extra) -> None:
            chunk = {"id": request_id, "object": kind, "created": created, "model": self.server.model_name,
                     "choices": choices, **extra}
            async with lock:
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        async def one(index: int, seq: Sequence) -> Output:
            offset = 0
            if chat:
                await send([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
            echoing = not chat and sampling.echo

            async def echo() -> None:
                """The echoed prompt, first (as vLLM streams it), once the prefill gave its logprobs."""
                nonlocal echoing, offset
                if echoing:
                    echoing, prompt = False, self._echo(seq, sampling)
                    offset = len(prompt.text)
                    await send([{"index": index, "text": prompt.text, "logprobs": prompt.logprobs,
                                 "finish_reason": None, "token_ids": [], "versions": []}])

            async def on_delta(text: str, first: int, last: int) -> None:
                nonlocal offset
                await echo()
                partial = Output.of(seq, last, "", "")
                choice = {"index": index, "finish_reason": None, "token_ids": partial.token_ids[first:last],
                          "versions": partial.versions[first:last]}
                if chat:
                    choice["delta"] = {"content": text} if text else {}
                    choice["logprobs"] = (self._chat_logprobs(partial, first, last)
                                          if sampling.logprobs is not None else None)
                else:
                    choice["text"] = text
                    choice["logprobs"] = (self._completion_logprobs(partial, offset, first, last)
                                          if sampling.logprobs is not None else None)
                offset += len(text)
                await send([choice])

            out = await self._run(seq, sampling, hold, on_delta)
            await echo()
            last = {"index": index, "finish_reason": out.finish_reason, "logprobs": None}
            if chat:
                _, calls = split_tool_calls(out.text) if hold else (None, [])
                last["delta"] = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]} if calls else {}
                if calls:
                    last["finish_reason"] = "tool_calls"
            else:
                last["text"] = ""
            await send([last])
            return out

        # an error from here on (a failed sequence, the engine, a shutdown) is the stream's last event: STREAM_END
        outputs = await together(one(i, seq) for i, seq in enumerate(seqs))
        served(http, sum(map(len, prompts)), outputs)
        self.server.requests_served += 1
        if sampling.include_usage:
            await send([], usage=usage(sum(map(len, prompts)), sum(len(o.token_ids) for o in outputs)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _envelope(self, request_id: str, kind: str, created: int, choices: list[dict], prompts: list[list[int]],
                  n: int) -> dict:
        """A whole response; its usage counts each prompt once (not once per choice), as OpenAI does."""
        return {"id": request_id, "object": kind, "created": created, "model": self.server.model_name,
                "choices": choices, "usage": usage(sum(map(len, prompts)), sum(len(c["token_ids"]) for c in choices))}

    # -- /v1/models -------------------------------------------------------------------------------------------

    async def models(self, http: web.Request) -> web.Response:
        card = {"id": self.server.model_name, "object": "model", "created": int(self.server.started),
                "owned_by": "i3core", "max_model_len": self.server.engine.max_len}
        return web.json_response({"object": "list", "data": [card]})

    # -- /inference/v1/generate (vLLM's token-in endpoint) ----------------------------------------------------

    async def generate(self, http: web.Request) -> web.Response:
        server = self.server
        request = parse(GenerateRequest, parse_json_object(await http.read()))
        engine, eos = server.engine, server.model.eos_token_id
        prompt_ids = prompt_token_ids(request.token_ids, engine.vocab_size, None, param="token_ids")
        output_mode = request.output_mode
        eos = end_ids(server.model)
        sampling = request.sampling_params.sampling(engine.max_len, engine.vocab_size, eos, eos_token_ids=eos)
        sampling.clip_max_tokens = True  # a growing multi-turn prompt (verifiers' training client) ends at the
        # context, as before: never a 400
        seqs = self._sequences([prompt_ids], sampling)
        outputs = await together(self._run(seq, sampling) for seq in seqs)
        served(http, len(prompt_ids), outputs)
        server.requests_served += 1
        request_id = request.request_id or uuid.uuid4().hex
        choices = []
        for i, out in enumerate(outputs):
            choice = {"index": i, "finish_reason": out.finish_reason, "stop_reason": None,
                      "token_ids": out.token_ids, "versions": out.versions,
                      "logprobs": self._generate_logprobs(out) if sampling.logprobs is not None else None}
            if output_mode == "text":
                choice["text"] = out.text
            choices.append(choice)
        session = http.headers.get(SESSION_HEADER)
        if session:
            self._record(session, request_id, len(prompt_ids), outputs)
        response = {
            "request_id": request_id, "model": server.model_name, "created": int(time.time()),
            "prompt_token_ids": prompt_ids, "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
        }  # fmt: skip
        if sampling.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(seqs[0], sampling.prompt_logprobs)
        return web.json_response(response)

    @staticmethod
    def _generate_logprobs(out: Output) -> dict:
        """vLLM's token-in logprobs: per token its id (also as ``"token_id:N"``, what ``renderers`` checks)."""
        def entry(token: int, logprob: float) -> dict:
            return {"token": f"token_id:{token}", "token_id": token, "logprob": finite(logprob)}

        content = []
        for token, logprob, alternatives in zip(out.token_ids, out.logprobs, out.top or [[]] * len(out.token_ids)):
            content.append({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives]})
        return {"content": content}

    def _record(self, session: str, request_id: str, prompt_len: int, outputs: list[Output]) -> None:
        turns = self.sessions.pop(session, [])
        turns.extend({"request_id": request_id, "index": i, "prompt_len": prompt_len, "token_ids": out.token_ids,
                      "versions": out.versions} for i, out in enumerate(outputs))
        self.sessions[session] = turns[-MAX_SESSION_TURNS:]
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    async def session(self, http: web.Request) -> web.Response:
        """The turns generated under one ``X-Session-ID``: token ids and the policy version of each token."""
        session = http.match_info["session_id"]
        if session not in self.sessions:
            raise web.HTTPNotFound()
        return web.json_response({"session_id": session, "turns": self.sessions[session]})

    async def forget_session(self, http: web.Request) -> web.Response:
        self.sessions.pop(http.match_info["session_id"], None)
        return web.json_response({"status": "ok"})
