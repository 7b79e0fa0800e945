"""What the builtin server and the vLLM endpoints share: request checking, the response shape, version waits.

Both answer ``POST /v1/completions`` with the same JSON (token ids, per-token
logprobs and versions), so the orchestrator's client is one class. Pure Python:
the vLLM API process imports it without the builtin engine.
"""

import asyncio
import difflib
import json
import math
import re
import time
import uuid
from dataclasses import dataclass

MAX_N = 64
"""Most completions one request may ask for (``n``)."""


class BadRequest(ValueError):
    """A client error: answered with 400 and this message, naming the request field at fault (``param``) and
    OpenAI's error ``code`` where one applies."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ContextLengthExceeded(BadRequest):
    """A prompt and its completion that do not fit the context: OpenAI's ``context_length_exceeded``, worded as
    OpenAI and vLLM word it (what litellm matches to raise ContextWindowExceededError)."""

    def __init__(self, max_len: int, prompt_tokens: int, max_tokens: int | None):
        if max_tokens is None:
            asked, param = f"your prompt has {prompt_tokens} tokens, which leaves no room for a completion", "messages"
        else:
            asked, param = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                            f"{max_tokens} in the completion)"), "max_tokens"
        super().__init__(f"This model's maximum context length is {max_len} tokens. However, {asked}. Please reduce "
                         "the length of the prompt or the completion.", param=param, code="context_length_exceeded")


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object (UTF-8, nested no deeper than Python's parser allows)."""
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


PROCESSORS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
"""The logits processors (OpenAI's and vLLM's) the engine runs."""
EXTENSIONS = (*PROCESSORS, "ignore_eos", "include_stop_str_in_output", "clip_max_tokens")
"""Sampling fields beyond the basic ones that both completion routes read."""
COMPLETION_FIELDS = ("model", "prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                     "stop_token_ids", "stream", "stream_options", "logprobs", "user", "skip_special_tokens", "echo",
                     "prompt_logprobs", *EXTENSIONS)
"""What ``/v1/completions`` reads (``model`` is echoed, not checked: one model per server; ``user`` is ignored)."""
CHAT_FIELDS = ("model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "seed", "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "top_logprobs", "tools",
               "tool_choice", "parallel_tool_calls", "user", "skip_special_tokens", *EXTENSIONS)
"""What ``/v1/chat/completions`` reads."""
UNSUPPORTED = {
    "response_format": {"type": "text"}, "best_of": 1, "suffix": None, "functions": None, "function_call": None,
    "audio": None, "modalities": ["text"], "prediction": None, "reasoning_effort": None, "web_search_options": None,
    "service_tier": None, "store": False, "metadata": None,
}
"""Standard fields this server does not implement, each with the value that asks for nothing (accepted as if the
field were absent); any other value is refused with a 400 naming the field."""
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
FINITE_LOGPROB = -9999.0
"""Stands for a logprob of -inf (a token top_k or top_p ruled out) where JSON needs a number."""


def check_fields(body: dict, known: tuple[str, ...], unsupported: dict | None = None) -> None:
    """Refuse fields the endpoint does not read (a typo would otherwise be silently ignored), and standard
    fields of ``unsupported`` asked for anything but their neutral value (those are then dropped from ``body``)."""
    for key in list(body):
        if key in known:
            continue
        if unsupported is not None and key in unsupported:
            if body[key] is None or body[key] == unsupported[key]:
                del body[key]
                continue
            raise BadRequest(f"{key} is not supported by this server", param=key)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BadRequest(f"unknown field {key!r}{hint}; this endpoint reads {', '.join(known)}", param=key)


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}]", param=key)
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or not (low < value if open_low else low <= value) or value > high):
        bounds = f">= {low:g}" if high == math.inf else f"in {'(' if open_low else '['}{low:g}, {high:g}]"
        raise BadRequest(f"{key} must be a finite number {bounds}", param=key)
    return float(value)


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", param=key)
    return value


@dataclass
class Sampling:
    """A completion request's settings, checked."""

    n: int
    max_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    seed: int | None
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion; the text stops before them (the token ids keep the token that ended it)."""
    logprobs: int | None = None
    """Alternatives to return per token (OpenAI's ``logprobs``/``top_logprobs``); None: logprobs not asked for."""
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    """vLLM's: the text keeps the stop string that ended it."""
    echo: bool = False
    """Completions: the prompt's text (and, with ``logprobs``, its tokens and their logprobs) before each choice's."""
    prompt_logprobs: int | None = None
    """vLLM's: the prompt tokens' logprobs, with this many alternatives each; None: not asked."""
    clip_max_tokens: bool = False
    """i3core's: a prompt + ``max_tokens`` over the context generates up to it (``finish_reason`` length) instead
    of a ``context_length_exceeded`` 400 (the orchestrator's client asks for this)."""

    def fit(self, prompt_tokens: int, max_len: int) -> int:
        """``max_tokens`` for a prompt of ``prompt_tokens``: as many as fit when unset (chat), cut to what fits
        with ``clip_max_tokens``.

        :raises ContextLengthExceeded: the prompt and ``max_tokens`` exceed ``max_len`` (a prompt that generates
            must leave room for one token; ``max_tokens`` 0 only reads the prompt).
        """
        room = max_len - prompt_tokens
        if self.max_tokens < 0 or (self.clip_max_tokens and room >= 1):
            if room < 1:
                raise ContextLengthExceeded(max_len, prompt_tokens, None)
            max_tokens = room if self.max_tokens < 0 else min(self.max_tokens, room)
        elif prompt_tokens + max(self.max_tokens, 1) > max_len:
            raise ContextLengthExceeded(max_len, prompt_tokens, self.max_tokens)
        else:
            max_tokens = self.max_tokens
        if self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})",
                             param="min_tokens")
        return max_tokens

    def seed_of(self, i: int) -> int | None:
        """Completion ``i`` of ``n`` samples with its own seed (``seed + i``)."""
        return None if self.seed is None else self.seed + i


MAX_LOGIT_BIAS = 100.0
MAX_TOKENS = 1 << 30
"""Bound on ``max_tokens`` as parsed; what fits the context is checked against each prompt (:meth:`Sampling.fit`)."""


def parse_sampling(body: dict, max_len: int, default_stop: list[int], chat: bool = False,
                   eos_token_id: int | None = None) -> Sampling:
    """The sampling settings of a request body (completions, or chat with ``chat``); ``ignore_eos`` drops
    ``eos_token_id`` from the stop tokens. ``max_tokens`` is checked against each prompt by :meth:`Sampling.fit`
    (chat's default: as many as fit, OpenAI's; completions': OpenAI's 16).

    :raises BadRequest: a field of the wrong type or out of range.
    """
    n = _int(body, "n", 1, 1, MAX_N)
    echo = not chat and _bool(body, "echo", False)
    least = 0 if echo else 1  # max_tokens 0: the prompt alone (its logprobs), what evaluation harnesses ask
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 0, 1, MAX_TOKENS)
    elif chat and body.get("max_tokens") is None:
        max_tokens = -1  # as many as fit: set per prompt (Sampling.fit)
    else:
        max_tokens = _int(body, "max_tokens", 16, least, MAX_TOKENS)
    temperature = _number(body, "temperature", 1.0, 0.0, math.inf)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    top_k = _int(body, "top_k", 0, -1, 1 << 30)
    stop_ids = body.get("stop_token_ids", default_stop)
    if stop_ids is None:
        stop_ids = default_stop
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed must be an integer")
    if chat:
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if _bool(body, "logprobs", False) else None
        if body.get("top_logprobs") and logprobs is None:
            raise BadRequest("top_logprobs needs logprobs = true")
    else:
        logprobs = None if body.get("logprobs") is None else _int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest("stream_options needs stream = true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest('stream_options must be {"include_usage": true|false}')
    include_usage = _bool(options or {}, "include_usage", False)
    if _bool(body, "ignore_eos", False):
        stop_ids = [t for t in stop_ids if t != eos_token_id]
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        prompt_logprobs = _int(body, "prompt_logprobs", 0, -1, MAX_TOP_LOGPROBS)
        prompt_logprobs = MAX_TOP_LOGPROBS if prompt_logprobs == -1 else prompt_logprobs
    return Sampling(n, max_tokens, temperature, tuple(stop_ids), seed, top_p=top_p, top_k=max(top_k, 0),
                    stop=tuple(stop), logprobs=logprobs, skip_special_tokens=_bool(body, "skip_special_tokens", True),
                    stream=stream, include_usage=include_usage, min_tokens=_int(body, "min_tokens", 0, 0, MAX_TOKENS),
                    repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, math.inf, open_low=True),
                    presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                    logit_bias=_logit_bias(body.get("logit_bias")),
                    include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False), echo=echo,
                    prompt_logprobs=prompt_logprobs, clip_max_tokens=_bool(body, "clip_max_tokens", False))


def _logit_bias(value) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (JSON keys, so strings) to values in [-100, 100]."""
    if not value:
        return None
    problem = BadRequest(f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                         param="logit_bias")
    if not isinstance(value, dict):
        raise problem
    bias = {}
    for key, number in value.items():
        try:
            token = int(key)
        except ValueError:
            raise problem from None
        if (not isinstance(number, int | float) or isinstance(number, bool) or not math.isfinite(number)
                or abs(number) > MAX_LOGIT_BIAS):
            raise problem
        bias[token] = float(number)
    return bias


MAX_PROMPTS = 256
"""Most prompts one completions request may batch."""


def parse_prompts(body: dict, vocab_size: int, encode) -> list[list[int]]:
    """The prompts as token ids: ``prompt`` a string, a list of token ids, or a batch (a list of strings or of
    token-id lists); strings go through ``encode``.

    :raises BadRequest: anything else, an empty prompt, a token id outside the vocabulary.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        batch = prompt
    else:
        batch = []
    if not batch or len(batch) > MAX_PROMPTS or not all(_one_prompt(p) for p in batch):
        raise BadRequest("prompt must be a non-empty string, a non-empty list of token ids, or a list of at most "
                         f"{MAX_PROMPTS} of either", param="prompt")
    prompts = [encode(p) if isinstance(p, str) else p for p in batch]
    if any(not 0 <= t < vocab_size for ids in prompts for t in ids):
        raise BadRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if not all(prompts):
        raise BadRequest("a prompt encodes to no tokens", param="prompt")
    return prompts


def parse_prompt(body: dict, vocab_size: int, encode) -> list[int]:
    """One prompt as token ids (:func:`parse_prompts` of a request that batches none)."""
    prompts = parse_prompts(body, vocab_size, encode)
    if len(prompts) > 1:
        raise BadRequest("this route takes one prompt a request", param="prompt")
    return prompts[0]


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_prompt(prompt) -> bool:
    return (isinstance(prompt, str) and bool(prompt)) or (isinstance(prompt, list) and bool(prompt)
                                                          and all(_is_id(t) for t in prompt))


def completion_choice(index: int, text: str, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
                      versions: list[int], finish_reason: str | None, openai_logprobs: dict | None = None) -> dict:
    """A ``/v1/completions`` choice: OpenAI's fields, ``logprobs.token_logprobs`` always (the training client
    reads it), and i3core's extras: ``token_ids``, ``prompt_token_ids``, ``versions``."""
    return {
        "index": index,
        "text": text,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
        "logprobs": openai_logprobs or {"token_logprobs": logprobs},
        "versions": versions,
        "finish_reason": finish_reason,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, request_id: str, model: str, choices: list[dict], prompt_ids: list[int]) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(c["token_ids"]) for c in choices)),
    }


def finite(logprob: float) -> float:
    """A logprob JSON can carry (-inf as :data:`FINITE_LOGPROB`)."""
    return logprob if logprob > FINITE_LOGPROB else FINITE_LOGPROB


ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def _text(content, where: str) -> str:
    """A message's content as one string: a string, or a list of ``{"type": "text", "text": ...}`` parts joined by
    newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins them, so both backends render the same prompt
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def parse_messages(messages) -> list[dict]:
    """OpenAI chat ``messages`` checked and normalised for a chat template: ``content`` always a string (text
    parts joined, null on an assistant turn with ``tool_calls`` as ""), ``developer`` as ``system``.

    :raises BadRequest: a malformed message, naming it.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where}: needs a role, one of {', '.join(ROLES)}")
        role, calls = m["role"], m.get("tool_calls")
        if m.get("content") is None and not (role == "assistant" and calls):
            raise BadRequest(f"{where}: content is missing")
        message = {"role": "system" if role == "developer" else role,
                   "content": "" if m.get("content") is None else _text(m["content"], where)}
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"{where}: tool_calls must be a list on an assistant message")
            message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"{where}: a tool message needs a string tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise BadRequest(f'{where}: needs {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    try:
        arguments = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        raise BadRequest(f"{where}: function.arguments is not JSON") from None
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}: function.arguments must encode a JSON object")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": fn["arguments"] or "{}"}}


def parse_tools(body: dict) -> list[dict] | None:
    """The ``tools`` offered to the model (None: none, or ``tool_choice = "none"``).

    :raises BadRequest: a malformed tool, or a ``tool_choice`` this server cannot enforce.
    """
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise BadRequest('tool_choice must be "auto" or "none": this server cannot force a call')
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name", ...}}')
    return tools or None


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Generated text as (content, OpenAI ``tool_calls``): the well-formed ``<tool_call>{"name", "arguments"}
    </tool_call>`` blocks become calls and the content is the text before the first of them (None when empty);
    text without a well-formed block is all content."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return content or None, calls


class VersionWaits:
    """``/update_weights {"version": n}`` on a server that receives by broadcast: wait until ``n`` is live."""

    KEEP = 8
    """Versions remembered behind the newest (a late waiter for an old version gets the live one)."""

    def __init__(self):
        self._futures: dict[int, asyncio.Future] = {}
        self.live = -1
        self.failure: str | None = None
        """Why no version can arrive any more (the receiver stopped); every wait then fails with it."""

    def wait(self, version: int) -> asyncio.Future:
        future = self._futures.get(version)
        if future is None:
            future = self._futures[version] = asyncio.get_running_loop().create_future()
            if self.live >= version:
                future.set_result(self.live)
            elif self.failure is not None:
                self._reject(future, self.failure)
        return future

    def fail(self, message: str) -> None:
        """The receiver is gone: pending and later waits for versions not yet live fail with ``message``."""
        self.failure = f"the weight receiver stopped: {message}"
        for future in self._futures.values():
            if not future.done():
                self._reject(future, self.failure)

    @staticmethod
    def _reject(future: asyncio.Future, message: str) -> None:
        future.set_exception(BadRequest(message))
        future.add_done_callback(lambda f: f.exception())  # retrieved even if nobody waits

    def arrived(self, version: int) -> None:
        self.live = max(self.live, version)
        for waiting, future in self._futures.items():
            if waiting <= version and not future.done():
                future.set_result(version)
        for old in [v for v in self._futures if v < version - self.KEEP]:
            self._futures.pop(old)

    def rejected(self, version: int, message: str) -> None:
        future = self.wait(version)
        if not future.done():
            self._reject(future, f"weights of version {version} rejected: {message}")


def report_receiver_stopped(waits: VersionWaits, loop: asyncio.AbstractEventLoop, exc: BaseException,
                            message: str | None = None) -> None:
    """From a receiver thread that has died: log one JSON line and fail every later version wait."""
    message = message or f"{type(exc).__name__}: {exc}"
    print(json.dumps({"event": "weight receiver stopped", "error": message}), flush=True)
    loop.call_soon_threadsafe(waits.fail, message)
