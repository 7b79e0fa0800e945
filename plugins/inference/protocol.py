"""What the builtin server and the vLLM endpoints share: typed request models, errors, the response shape, version
waits.

Request bodies are parsed at the edge into typed models (pydantic, strict: no string for a number, no bool for an
integer, finite numbers only) whose fields carry their bounds; a body that breaks one is a :class:`BadRequest`
naming the field and the bound, answered as OpenAI answers it (:func:`error_body`). Bounds that depend on the
server (its ``max_len``, its vocabulary) are checked where the model meets the server (:meth:`SamplingFields.sampling`,
:meth:`CompletionRequest.prompt_ids`). :func:`openapi` publishes the models as the server's request schema.

The models are meant to grow: a new field is a typed, bounded attribute of the model (and, if it was refused
before, leaves :data:`UNSUPPORTED`). Pure Python: the vLLM API process imports this module without the builtin
engine.
"""

import asyncio
import difflib
import hmac
import json
import re
import time
import typing
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import models_json_schema

from i3core.errors import EngineFailed, I3Error, SequenceFailed

MAX_N = 64
"""Most completions one request may ask for (``n``)."""
MAX_TOP_LOGPROBS = 20
"""Alternatives per token (OpenAI's bound)."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
"""Longest stop string: a stop is a word or a marker, never a document."""
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
"""Messages in one chat: far more turns than any context holds, few enough to check at once."""
MAX_TOOLS = 128
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body (answered 413 beyond it): a full-context token-id prompt is far smaller."""
MAX_TOP_K = 1 << 30
MAX_TOKENS = 1 << 30
"""Bound on ``max_tokens`` as parsed; what fits the context is checked against each prompt (:meth:`Sampling.fit`)."""
MAX_PROMPTS = 256
"""Most prompts one completions request may batch."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a ``logit_bias`` value."""
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")
"""A ``logit_bias`` key: a token id in ASCII digits (``str.isdigit`` also takes "²")."""
MAX_PENALTY = 2.0
"""OpenAI's bound on ``presence_penalty`` and ``frequency_penalty``."""
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
"""A seed is a 64-bit integer (what torch's generator takes, ``seed + i`` of choice ``i`` included)."""
SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily (vLLM's epsilon): dividing logits by it overflows."""
MIN_TEMPERATURE = 1e-2
"""A temperature in [SAMPLING_EPS, MIN_TEMPERATURE) is raised to this (as vLLM does): logits divided by less
overflow float32 into inf and the softmax into NaN."""
FINITE_LOGPROB = -9999.0
"""Stands for a logprob of -inf (a token top_k or top_p ruled out) where JSON needs a number."""


class BadRequest(ValueError):
    """A client error: answered with ``status`` (400) and this message, ``param`` naming the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` (``kind``: ``server_error`` for
    a 5xx)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ShuttingDown(I3Error):
    """The server is shutting down (SIGTERM/SIGINT): answered 503."""


STREAM_END = web.RequestKey("i3core_stream_end", typing.Callable)
"""Set by a handler once its stream's 200 is sent: ``async (exc) -> StreamResponse`` ends the stream with ``exc`` as
its last event (a response cannot follow a started one; the error middleware calls it for what escapes the handler)."""


def error_response(exc: Exception) -> tuple[int, dict]:
    """The status and OpenAI-shaped body of an error a handler raised: a client's (400...), one sequence's
    (500, ``code: "sequence_failed"``), the engine's or a shutdown (503), anything else (500)."""
    if isinstance(exc, BadRequest):
        return exc.status, error_body(str(exc), exc.param, exc.code)
    if isinstance(exc, SequenceFailed):
        return 500, error_body(str(exc), kind="server_error", code="sequence_failed")
    if isinstance(exc, EngineFailed | ShuttingDown):
        return 503, error_body(str(exc), kind="server_error")
    return 500, error_body(f"internal error: {type(exc).__name__}: {first_line(exc)}", kind="server_error")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""

class ContextLengthExceeded(BadRequest):
    """A prompt and its completion that do not fit the context: OpenAI's ``context_length_exceeded``, worded as
    OpenAI and vLLM word it ("This model's maximum context length is N tokens", what litellm matches to raise
    ContextWindowExceededError)."""

    def __init__(self, max_len: int, prompt_tokens: int, max_tokens: int | None):
        if max_tokens is None:
            asked, param = f"your prompt has {prompt_tokens} tokens, which leaves no room for a completion", "messages"
        else:
            asked, param = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                            f"{max_tokens} in the completion)"), "max_tokens"
        super().__init__(f"This model's maximum context length is {max_len} tokens. However, {asked}. Please reduce "
                         "the length of the prompt or the completion.", param=param, code="context_length_exceeded")


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object (UTF-8, nested at most :data:`MAX_JSON_DEPTH` deep, every
    string valid Unicode: a lone surrogate escape such as ``"\\ud800"`` is refused, naming where it is)."""
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    except RecursionError:
        raise BadRequest(f"the body is nested more than {MAX_JSON_DEPTH} deep") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    # the walk only where it can find something: a body with fewer brackets than the depth allowed and no
    # surrogate escape (the only way JSON spells a surrogate) needs none (a 15 MB list of token ids: 3 s of walk)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or SURROGATE_ESCAPE.search(raw):
        _check_tree(body)
    return body


MAX_JSON_DEPTH = 64
"""How deep a request's JSON may nest: a chat template renders tools and tool-call arguments recursively, and a
body nested hundreds deep ran it out of Python's stack."""

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_tree(body: dict | list) -> None:
    """Refuse JSON nested more than :data:`MAX_JSON_DEPTH` deep, or a string (key or value) holding a UTF-16
    surrogate, which no tokenizer or UTF-8 writer can take; the refusal names where."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            field = _json_path(path[:1])
            raise BadRequest(f"the body is nested more than {MAX_JSON_DEPTH} deep (in {field})", param=field)
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, dict | list):
                stack.append(((*path, key), item))
            if isinstance(item, str) and not _encodable(item) or isinstance(key, str) and not _encodable(key):
                where = _json_path((*path, key))
                raise BadRequest(f"{where} holds a lone UTF-16 surrogate: not valid Unicode", param=where)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_path(path: tuple) -> str:
    """``messages[0].content``: a place in a JSON body (a surrogate in a key written as its escape)."""
    text = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_depth_within(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests at most ``limit`` deep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


UNSUPPORTED = {
    "response_format": {"type": "text"}, "best_of": 1, "suffix": None, "functions": None, "function_call": None,
    "audio": None, "modalities": ["text"], "prediction": None, "reasoning_effort": None, "web_search_options": None,
    "service_tier": None, "store": False, "metadata": None,
}
"""Standard fields this server does not implement, each with the value that asks for nothing (accepted as if the
field were absent); any other value is refused with a 400 naming the field. A model that implements one of them
declares it as a field: a declared field is never looked up here."""


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


# -- who may call what ----------------------------------------------------------------------------------------------

ADMIN_ROUTES = ("/update_weights", "/pause", "/resume", "/inference/v1/sessions/")
"""Routes (prefixes) that change or read the server's state for the run: they need the admin token."""


def is_admin_route(path: str) -> bool:
    return path in ADMIN_ROUTES[:3] or path.startswith(ADMIN_ROUTES[3])


def bearer_matches(authorization: str | None, *tokens: str | None) -> bool:
    """Whether an ``Authorization: Bearer <token>`` header holds one of ``tokens`` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    given_bytes = given.strip().encode("utf-8", "surrogateescape")  # the header's own bytes, whatever they are
    return any(token and hmac.compare_digest(given_bytes, token.encode("utf-8", "surrogateescape")) for token in tokens)


def unauthorized(what: str) -> BadRequest:
    return BadRequest(f"{what}: send Authorization: Bearer <token>", code="invalid_api_key", status=401)


def weights_path(path: str, roots: list[Path]) -> Path:
    """``path`` if it lies under one of ``roots`` (the run's weight directories), resolved.

    :raises BadRequest: 403 for any other path (``/update_weights`` must not read anything else on this disk).
    """
    if "\x00" in path:
        raise BadRequest("path must not hold a NUL character", param="path")
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise BadRequest(f"path {path!r} is outside the weight directories this server reads from "
                         f"({', '.join(str(r) for r in roots)})", param="path", code="forbidden", status=403)
    return resolved


# -- typed request models ------------------------------------------------------------------------------------------


def bounded(default: Any = ..., bound: str = "", description: str | None = None, **constraints) -> Any:
    """A model field whose error message says ``<field> must be <bound>``; ``bound`` is published in the schema
    as ``x-bound``."""
    return Field(default, description=description, json_schema_extra={"x-bound": bound}, **constraints)


class RequestModel(BaseModel):
    """A request body (or a part of one): strict types, finite numbers, no unknown fields (a typo gets a "did you
    mean"), :attr:`unsupported` standard fields accepted only at their neutral value."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    unsupported: ClassVar[dict] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            data = dict(data)
            check_fields(data, tuple(cls.model_fields), cls.unsupported)
        return data


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` (a parsed JSON object) as ``model``.

    :raises BadRequest: naming the first fields that break their bounds (at most three), ``param`` the first.
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _bad_request(model, exc) from None


def _bad_request(model: type[BaseModel], exc: ValidationError) -> BadRequest:
    messages: dict[str, str] = {}
    for error in exc.errors(include_url=False):
        path, named, bound = _where(model, error["loc"])
        if bound and error["type"] not in ("value_error", "extra_forbidden"):
            path = named  # the bound is the field's: stop_token_ids[3] is refused as stop_token_ids
        if any(path == seen or path.startswith((f"{seen}[", f"{seen}.")) for seen in messages):
            continue  # one message per field (a union reports each of its members)
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, BadRequest) and cause.param:  # raised with its own field (a nested check_fields)
            param = f"{path}.{cause.param}" if path else cause.param
            messages[param] = f"{path}: {cause}" if path else str(cause)
        elif isinstance(cause, ValueError):
            messages[path] = _at(path, str(cause))
        elif error["type"] == "extra_forbidden":
            messages[path] = f"unknown field {path!r}"
        elif bound:
            messages[path] = f"{path} must be {bound}"
        elif error["type"] == "missing":
            messages[path] = f"{path} is required"
        else:
            messages[path] = f"{path}: {error['msg']}"
        if len(messages) == 3:
            break
    if not messages:  # pragma: no cover - pydantic reports at least one error
        return BadRequest(str(exc))
    first = next(iter(messages))
    return BadRequest("; ".join(messages.values()), param=first or None)


def _at(path: str, message: str) -> str:
    """A validator's ``message`` placed at ``path``: ``content must be...`` at ``messages[0].content`` reads
    ``messages[0].content must be...``."""
    if not path or message.startswith(path):
        return message
    last = re.split(r"[.\[]", path)[-1]
    if message.startswith(f"{last} "):
        return path + message[len(last):]
    return f"{path}: {message}"


def _where(model: type[BaseModel], loc: tuple) -> tuple[str, str, str]:
    """The field path of an error location (``messages[2].content``: union member tags left out), the path to the
    last field named in it and that field's bound ("" if it has none)."""
    path, named, bound, current = "", "", "", model
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            continue
        fields = current.model_fields if isinstance(current, type) and issubclass(current, BaseModel) else {}
        if item not in fields:
            continue  # a union member's tag such as 'str' or 'list[int]'
        info = fields[item]
        path += f".{item}" if path else item
        bound = (info.json_schema_extra or {}).get("x-bound", "") if isinstance(info.json_schema_extra, dict) else ""
        named, current = path, _inner_model(info.annotation)
    return path, named, bound


def _inner_model(annotation) -> type[BaseModel] | None:
    """The first model class inside a field's annotation (``list[Message] | None`` -> ``Message``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


class StreamOptions(RequestModel):
    include_usage: bool = bounded(False, "true or false", "A last chunk with choices [] and the usage.")
    continuous_usage_stats: bool = bounded(False, "true or false", "Accepted; usage is sent in the last chunk.")


@dataclass
class Sampling:
    """A completion request's settings, checked: what the engine's requests are made of."""

    n: int
    max_tokens: int
    temperature: float
    """0: greedy."""
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
        """``max_tokens`` for a prompt of ``prompt_tokens``: as many as fit when unset (-1, chat's default), cut
        to what fits with ``clip_max_tokens``.

        :raises ContextLengthExceeded: the prompt and ``max_tokens`` exceed ``max_len`` (a prompt that generates
            must leave room for one token; so must one that is only scored, ``max_tokens`` 0, as the engine's
            cache holds ``max_len`` tokens).
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


def effective_temperature(temperature: float) -> float:
    """A temperature as the sampler takes it: below :data:`SAMPLING_EPS` greedy (0), below
    :data:`MIN_TEMPERATURE` raised to it."""
    if temperature < SAMPLING_EPS:
        return 0.0
    return max(temperature, MIN_TEMPERATURE)


class SamplingFields(RequestModel):
    """The sampling settings every generation route reads (OpenAI's names, vLLM's extensions)."""

    unsupported: ClassVar[dict] = UNSUPPORTED

    n: int = bounded(1, f"an integer in [1, {MAX_N}]", "Completions of the prompt.", ge=1, le=MAX_N)
    max_tokens: int | None = bounded(None, "an integer in [1, max_len]",
                                     "Most tokens to generate; with the prompt at most the server's max_len "
                                     "(else a context_length_exceeded 400).", ge=1, le=MAX_TOKENS)
    temperature: float = bounded(1.0, "a finite number >= 0",
                                 f"0 (or below {SAMPLING_EPS:g}) is greedy; below {MIN_TEMPERATURE:g} is raised "
                                 f"to {MIN_TEMPERATURE:g}.", ge=0)
    top_p: float = bounded(1.0, "a finite number in (0, 1]", "Nucleus sampling.", gt=0, le=1)
    top_k: int = bounded(0, f"-1, 0 (off) or an integer in [1, {MAX_TOP_K}]", "vLLM's extension.", ge=-1,
                         le=MAX_TOP_K)
    seed: int | None = bounded(None, f"an integer in [{SEED_MIN}, {SEED_MAX}]", "Choice i samples with seed + i.",
                               ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = bounded(
        None, f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, each at most {MAX_STOP_CHARS} "
              "characters", "Strings that end the text (left out of it).")
    stop_token_ids: list[int] | None = bounded(
        None, f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, vocab_size)", "vLLM's extension.",
        max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = bounded(True, "true or false", "vLLM's extension.")
    ignore_eos: bool = bounded(False, "true or false", "vLLM's: the end-of-sequence token does not stop by default "
                                                       "(stop_token_ids given still do).")
    min_tokens: int = bounded(0, "an integer >= 0 and at most max_tokens",
                              "vLLM's: no stop token is drawn before this many tokens.", ge=0, le=MAX_TOKENS)
    repetition_penalty: float = bounded(1.0, "a finite number > 0", "vLLM's: a positive logit of a token in the "
                                        "prompt or completion divided by it, a negative one multiplied.", gt=0)
    presence_penalty: float = bounded(0.0, f"a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                                      "OpenAI's: subtracted once from the logit of a token already generated.",
                                      ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = bounded(0.0, f"a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                                       "OpenAI's: subtracted from a token's logit per time it was generated.",
                                       ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = bounded(
        None, f"an object of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        "OpenAI's: added to the logits of those tokens.")
    include_stop_str_in_output: bool = bounded(False, "true or false", "vLLM's: the text keeps its stop string.")
    clip_max_tokens: bool = bounded(False, "true or false", "i3core's: max_tokens cut to what fits the context "
                                                            "instead of a context_length_exceeded 400.")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        if bias and not all(TOKEN_ID_KEY.fullmatch(key) and abs(value) <= MAX_LOGIT_BIAS
                            for key, value in bias.items()):
            raise ValueError(f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
                             f"each at most {MAX_STOP_CHARS} characters")
        return stop

    def logprobs_asked(self) -> int | None:
        """Alternatives per token the request asks for (None: no logprobs)."""
        return None

    def default_max_tokens(self, max_len: int) -> int:
        return 16  # OpenAI's completions default

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_len: int, vocab_size: int, default_stop: list[int], stream: bool = False,
                 include_usage: bool = False, eos_token_ids: Collection[int] = ()) -> Sampling:
        """The settings as the engine takes them, checked against the server's ``vocab_size``; ``max_tokens`` is
        checked against each prompt and ``max_len`` by :meth:`Sampling.fit`. ``ignore_eos`` drops
        ``eos_token_ids`` from the default stop tokens (``stop_token_ids`` given stay as given, as on vLLM).

        :raises BadRequest: a stop or ``logit_bias`` token id outside the vocabulary.
        """
        max_tokens = self.max_tokens_asked()
        if max_tokens is None:
            max_tokens = self.default_max_tokens(max_len)
        stop_ids = default_stop if self.stop_token_ids is None else self.stop_token_ids
        if any(not 0 <= t < vocab_size for t in stop_ids):
            raise BadRequest(f"stop_token_ids must be token ids in [0, {vocab_size})", param="stop_token_ids")
        if self.ignore_eos and self.stop_token_ids is None:  # as vLLM: stop_token_ids asked for still stop
            stop_ids = [t for t in stop_ids if t not in eos_token_ids]
        bias = {int(token): value for token, value in (self.logit_bias or {}).items()} or None
        if bias and any(not 0 <= t < vocab_size for t in bias):
            raise BadRequest(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return Sampling(self.n, max_tokens, effective_temperature(self.temperature), tuple(stop_ids), self.seed,
                        top_p=self.top_p, top_k=max(self.top_k, 0), stop=tuple(stop), logprobs=self.logprobs_asked(),
                        skip_special_tokens=self.skip_special_tokens, stream=stream, include_usage=include_usage,
                        min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        logit_bias=bias, include_stop_str_in_output=self.include_stop_str_in_output,
                        echo=getattr(self, "echo", False), prompt_logprobs=self.prompt_logprobs_asked(),
                        clip_max_tokens=self.clip_max_tokens)

    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt token (vLLM's ``prompt_logprobs``; -1: the most there are); None: not asked."""
        asked = getattr(self, "prompt_logprobs", None)
        return MAX_TOP_LOGPROBS if asked == -1 else asked


class StreamingFields(SamplingFields):
    """The OpenAI routes' common fields beyond sampling: the model's name, streaming, the end user."""

    model: str | None = bounded(None, "a string", "Echoed, not checked: one model per server.")
    stream: bool = bounded(False, "true or false", "Server-sent events in OpenAI's chunk shapes.")
    stream_options: StreamOptions | None = bounded(None, '{"include_usage": true|false}')
    user: str | None = bounded(None, "a string", "Accepted, ignored.")

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options needs stream = true", param="stream_options")
        return self

    def stream_sampling(self, max_len: int, vocab_size: int, default_stop: list[int],
                        eos_token_ids: Collection[int] = ()) -> Sampling:
        options = self.stream_options
        return self.sampling(max_len, vocab_size, default_stop, self.stream, bool(options and options.include_usage),
                             eos_token_ids)


class CompletionRequest(StreamingFields):
    """``POST /v1/completions`` (OpenAI's legacy completions): one prompt or a batch of them."""

    prompt: str | list[int] | list[str] | list[list[int]] = bounded(
        ..., f"a non-empty string, a non-empty list of token ids, or a list of at most {MAX_PROMPTS} of either")
    max_tokens: int | None = bounded(None, "an integer in [1, max_len] (0 with echo: the prompt scored alone)",
                                     "Most tokens to generate (default 16); with the prompt at most the server's "
                                     "max_len (else a context_length_exceeded 400).", ge=0, le=MAX_TOKENS)
    logprobs: int | None = bounded(None, f"an integer in [0, {MAX_TOP_LOGPROBS}]",
                                   "Alternatives per token; the sampled token's logprob always.", ge=0,
                                   le=MAX_TOP_LOGPROBS)
    echo: bool = bounded(False, "true or false", "The prompt (with logprobs: its tokens' logprobs, from the prefill) "
                                                 "before the completion.")
    prompt_logprobs: int | None = bounded(None, f"an integer in [-1, {MAX_TOP_LOGPROBS}]",
                                          "vLLM's: the prompt tokens' logprobs with this many alternatives "
                                          "(-1: the most).", ge=-1, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        if not 0 < len(batch) <= MAX_PROMPTS or not all(batch):
            raise ValueError(f"prompt must be a non-empty string, a non-empty list of token ids, or a list of at "
                             f"most {MAX_PROMPTS} of either")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be an integer in [1, max_len] (0 only with echo)", param="max_tokens")
        return self

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def batch(self) -> list[str | list[int]]:
        """The request's prompts, each a string or token ids."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) and isinstance(prompt[0], str | list) else [prompt]

    def texts(self) -> list[str]:
        """The request's prompts given as strings (to be encoded)."""
        return [p for p in self.batch() if isinstance(p, str)]

    def prompts(self, vocab_size: int, encode) -> list[list[int]]:
        """Every prompt of the request as token ids (a string through ``encode``).

        :raises BadRequest: an id outside ``[0, vocab_size)``, a string that encodes to nothing.
        """
        prompts = [prompt_token_ids(p, vocab_size, encode) for p in self.batch()]
        if not all(prompts):
            raise BadRequest("a prompt encodes to no tokens", param="prompt")
        return prompts

    def prompt_ids(self, vocab_size: int, encode) -> list[int]:
        """The one prompt of a request that batches none, as token ids.

        :raises BadRequest: a batch of several, an id outside ``[0, vocab_size)``.
        """
        prompts = self.prompts(vocab_size, encode)
        if len(prompts) > 1:
            raise BadRequest("this route takes one prompt a request", param="prompt")
        return prompts[0]


def prompt_token_ids(prompt: str | list[int], vocab_size: int, encode, param: str = "prompt") -> list[int]:
    """``prompt`` as token ids (a string through ``encode``), every id checked against the vocabulary."""
    ids = encode(prompt) if isinstance(prompt, str) else prompt
    if any(not 0 <= t < vocab_size for t in ids):
        raise BadRequest(f"prompt token ids must be in [0, {vocab_size})", param=param)
    return ids


class UpdateWeightsRequest(RequestModel):
    """``POST /update_weights``: a version directory to load, or (no path) a broadcast version to wait for."""

    path: str | None = bounded(None, "a string: a STABLE weight version directory under the run's directories")
    version: int = bounded(..., "an integer >= 0", ge=0)


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


class FunctionCall(RequestModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = bounded(..., "a string")
    arguments: str = bounded(..., "a string encoding a JSON object")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ValueError("arguments is not JSON") from None
        except RecursionError:
            value = None
        if not isinstance(value, dict):
            raise ValueError("arguments must encode a JSON object")
        if not json_depth_within(value):
            raise ValueError(f"arguments is nested more than {MAX_JSON_DEPTH} deep")
        return arguments or "{}"


class ToolCall(RequestModel):
    """A call an assistant message made (sent back in a later request)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str = bounded("", "a string")
    type: Literal["function"] = bounded("function", '"function"')
    function: FunctionCall = bounded(..., '{"name", "arguments"}')


class Message(RequestModel):
    """One chat message; fields OpenAI's SDKs send back that a template does not read (``name``, ``refusal``...)
    are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[ROLES] = bounded(..., f"one of {', '.join(ROLES)}")
    content: str | None = bounded(None, 'a string or a list of {"type": "text", "text": ...} parts')
    tool_calls: list[ToolCall] | None = bounded(None, "a list of tool calls, on an assistant message")
    tool_call_id: str | None = bounded(None, "a string")

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content):
        """Text parts joined by newlines (as vLLM joins them, so both backends render the same prompt)."""
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("content must be a string or a list of text parts")

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls must be a list on an assistant message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs a string tool_call_id")
        return self

    def for_template(self) -> dict:
        """The message as a chat template reads it: ``content`` a string, ``developer`` as ``system``."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = bounded(..., "a string")


class Tool(RequestModel):
    """A tool offered to the model; handed to the chat template as sent."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"] = bounded(..., '"function"')
    function: FunctionSpec = bounded(..., '{"name", "description", "parameters"}')


class ChatRequest(StreamingFields):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = bounded(..., f"a non-empty list of at most {MAX_MESSAGES} messages", min_length=1,
                                      max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = bounded(None, "an integer in [1, max_len]", "Wins over max_tokens.", ge=1,
                                                le=MAX_TOKENS)
    logprobs: bool | None = bounded(None, "true or false")
    top_logprobs: int | None = bounded(None, f"an integer in [0, {MAX_TOP_LOGPROBS}]", ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = bounded(None, f'a list of at most {MAX_TOOLS} {{"type": "function", "function": '
                                             '{"name", ...}}', max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none"] | None = bounded(
        None, '"auto" or "none": this server cannot force a call')
    parallel_tool_calls: bool | None = bounded(None, "true or false", "Accepted, ignored.")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs = true", param="top_logprobs")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def default_max_tokens(self, max_len: int) -> int:
        return -1  # as many as fit the prompt (OpenAI's chat default): Sampling.fit

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def offered_tools(self) -> list[dict] | None:
        """The tools offered to the model as sent (None: none, or ``tool_choice = "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]


class GenerateSamplingParams(SamplingFields):
    """The ``sampling_params`` of ``/inference/v1/generate`` (vLLM's names)."""

    logprobs: int | None = bounded(None, f"an integer in [0, {MAX_TOP_LOGPROBS}]", ge=0, le=MAX_TOP_LOGPROBS)
    detokenize: Literal[True] = bounded(True, "true (false is not supported)")
    prompt_logprobs: int | None = bounded(None, f"an integer in [-1, {MAX_TOP_LOGPROBS}]",
                                          "vLLM's: the prompt tokens' logprobs with this many alternatives.", ge=-1,
                                          le=MAX_TOP_LOGPROBS)

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class GenerateRequest(RequestModel):
    """``POST /inference/v1/generate``: vLLM's token-in generation (``cache_salt``, ``priority`` accepted,
    ignored)."""

    token_ids: list[int] = bounded(..., "a non-empty list of token ids", min_length=1)
    sampling_params: GenerateSamplingParams = bounded(GenerateSamplingParams(), "an object of vLLM's sampling "
                                                                                "params")
    model: str | None = bounded(None, "a string")
    request_id: str | None = bounded(None, "a string")
    stream: Literal[False] = bounded(False, "false (streaming is not supported on /inference/v1/generate)")
    output_mode: Literal["tokens", "text"] = bounded("tokens", '"tokens" or "text"')
    return_token_ids: bool | None = bounded(None, "true or false")
    cache_salt: str | None = bounded(None, "a string")
    priority: int | None = bounded(None, "an integer")

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _null_params(cls, params):
        return {} if params is None else params


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/inference/v1/generate": GenerateRequest,
    "/update_weights": UpdateWeightsRequest,
}
"""Each POST route's request body, as :func:`openapi` publishes it."""


def openapi(routes: dict[str, type[BaseModel]], title: str, version: str = "0.1.0") -> dict:
    """An OpenAPI 3.1 document of ``routes`` (path -> request model): each POST's body schema, with the
    bounds (``minimum``, ``maximum``, ``x-bound``...), and OpenAI's error shape for a 400."""
    keys = [(model, "validation") for model in dict.fromkeys(routes.values())]
    refs, defs = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    paths = {
        path: {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": "OK"},
                          "400": {"description": "a field out of its bounds, named",
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
        }}
        for path, model in routes.items()
    }  # fmt: skip
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {**defs.get("$defs", {}), "Error": error}}}


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Generated text as (content, OpenAI ``tool_calls``): the well-formed ``<tool_call>{"name", "arguments"}
    </tool_call>`` blocks become calls and the content is the text before the first block (None when empty);
    text without a well-formed block is all content (a malformed block stays text)."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:  # strict JSON: NaN and Infinity are not; a model's deep nesting or a huge integer is not parsed
            body = json.loads(raw, parse_constant=_not_json)
        except (ValueError, RecursionError):
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", {})
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        elif not isinstance(arguments, str):  # arguments are an object, or its JSON text (OpenAI's own form)
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_OPEN)]  # as vLLM's hermes parser: what a stream sends, to the byte
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
