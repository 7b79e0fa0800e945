"""What the builtin server and the vLLM endpoints share: request checking, the response shape, version waits.

Both answer ``POST /v1/completions`` with the same JSON (token ids, per-token
logprobs and versions), so the orchestrator's client is one class. Pure Python:
the vLLM API process imports it without the builtin engine.
"""

import asyncio
import difflib
import json
import math
import time
from dataclasses import dataclass

MAX_N = 64
"""Most completions one request may ask for (``n``)."""


class BadRequest(ValueError):
    """A client error: answered with 400 and this message."""


def error_body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


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


COMPLETION_FIELDS = ("model", "prompt", "n", "max_tokens", "temperature", "stop_token_ids", "seed")
"""What ``/v1/completions`` reads (``model`` is accepted and ignored: one model per server)."""
CHAT_FIELDS = ("model", "messages", "n", "max_tokens", "temperature", "stop_token_ids", "seed")


def check_fields(body: dict, known: tuple[str, ...]) -> None:
    """Refuse fields the endpoint does not read (a typo would otherwise be silently ignored)."""
    for key in body:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BadRequest(f"unknown field {key!r}{hint}; this endpoint reads {', '.join(known)}")


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}]")
    return value


@dataclass
class Sampling:
    """A completion request's settings, checked."""

    n: int
    max_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    seed: int | None

    def seed_of(self, i: int) -> int | None:
        """Completion ``i`` of ``n`` samples with its own seed (``seed + i``)."""
        return None if self.seed is None else self.seed + i


def parse_sampling(body: dict, max_len: int, default_stop: list[int]) -> Sampling:
    """``n``, ``max_tokens``, ``temperature``, ``stop_token_ids``, ``seed`` of a request body.

    :raises BadRequest: a field of the wrong type or out of range.
    """
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = _int(body, "max_tokens", 16, 1, max_len)
    temperature = body.get("temperature", 1.0)
    if (not isinstance(temperature, int | float) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or temperature < 0):
        raise BadRequest("temperature must be a finite number >= 0")
    stop = body.get("stop_token_ids", default_stop)
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise BadRequest("stop_token_ids must be a list of integers")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed must be an integer")
    return Sampling(n, max_tokens, float(temperature), tuple(stop), seed)


def parse_prompt(body: dict, vocab_size: int, encode) -> list[int]:
    """The prompt as token ids: a list of ids as given, a string through ``encode``."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt_ids = encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = prompt
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise BadRequest(f"prompt token ids must be in [0, {vocab_size})")
    return prompt_ids


def completion_choice(index: int, text: str, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
                      versions: list[int], finish_reason: str | None) -> dict:
    return {
        "index": index,
        "text": text,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
        "logprobs": {"token_logprobs": logprobs},
        "versions": versions,
        "finish_reason": finish_reason,
    }


def envelope(kind: str, request_id: str, model: str, choices: list[dict], prompt_ids: list[int]) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": sum(len(c["token_ids"]) for c in choices),
        },
    }


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
