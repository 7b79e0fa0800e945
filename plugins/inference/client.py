"""The orchestrator's client for one inference server (builtin or vLLM: the same HTTP API).

Tokens in, tokens out: the client tokenizes a prompt once and sends token ids;
completions come back as token ids with logprobs and per-token versions.
"""

import os

import aiohttp

from i3core.errors import RequestRefused, SequenceFailed, ServerError
from i3core.lifetime import ADMIN_TOKEN_ENV
from i3core.types import Completion

REFUSALS = frozenset({400, 401, 403, 404, 413, 422})
"""Statuses that refuse the request itself (its fields, its size, its credentials, its route): raised as
:class:`~i3core.errors.RequestRefused`, the server not marked down (it answers, and would answer the same again)."""
REQUEST_TIMEOUT_S = 600.0
"""A generation may wait behind a full batch; the default bound only catches a dead server."""


class InferenceClient:
    def __init__(self, base_url: str, tokenizer, *, stop_token_ids: list[int] | None = None, stop: list[str] = (),
                 timeout_s: float = REQUEST_TIMEOUT_S, completions_path: str = "/v1/completions",
                 admin_token: str | None = None):
        self.base_url = base_url.rstrip("/")
        token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        """Sent with every request: the run's admin token (weights, pause, sessions), default ``$I3CORE_ADMIN_TOKEN``."""
        self.completions_path = completions_path
        """Where the server answers token-id completions with versions (the builtin server's OpenAI route;
        i3core's own route inside vLLM)."""
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop = list(stop)
        """Stop strings sent with every request that names none (the env's stop text)."""
        self._session: aiohttp.ClientSession | None = None

    async def _post(self, path: str, body: dict) -> dict:
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  headers=self.headers)
        try:
            async with self._session.request(method, self.base_url + path, json=body) as response:
                data = await response.json(content_type=None)
                if response.status >= 400:
                    error = data.get("error") if isinstance(data, dict) else None
                    message = error.get("message", data) if isinstance(error, dict) else data
                    if isinstance(error, dict) and error.get("code") == "sequence_failed":  # the server goes on
                        raise SequenceFailed(f"{self.base_url}{path}: {response.status} {message}")
                    if response.status in REFUSALS:  # this request's fault: the server goes on
                        raise RequestRefused(f"{self.base_url}{path}: {response.status} {message}")
                    raise ServerError(f"{self.base_url}{path}: {response.status} {message}")
                return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a body that is not JSON
            raise ServerError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float, seed: int | None = None) -> Completion:
        return await self.complete_ids(self.tokenizer.encode(prompt).ids, max_tokens=max_tokens,
                                       temperature=temperature, seed=seed)

    async def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                           stop_token_ids: list[int] | None = None, stop: list[str] | None = None,
                           seed: int | None = None) -> Completion:
        """One completion of ``prompt_ids``, sent as ids (a multi-turn env's trajectory so far, untouched); its
        text is the server's (:func:`i3core.text.completion_text`: special tokens kept, the stop token not)."""
        prompt_ids = list(prompt_ids)
        body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                "skip_special_tokens": False,
                "clip_max_tokens": True}  # a prompt near the context ends there ("length"), never a 400
        stop_ids = stop_token_ids if stop_token_ids is not None else self.stop_token_ids
        if stop_ids is not None:
            body["stop_token_ids"] = stop_ids
        stop = stop if stop is not None else self.stop
        if stop:
            body["stop"] = list(stop)
        if seed is None:
            del body["seed"]
        choice = (await self._post(self.completions_path, body))["choices"][0]
        return Completion(
            text=choice["text"],
            prompt_ids=prompt_ids,
            token_ids=choice["token_ids"],
            logprobs=choice["logprobs"]["token_logprobs"],
            versions=choice["versions"],
            finish_reason=choice["finish_reason"],
        )

    async def health(self) -> dict:
        return await self._request("GET", "/health")

    async def update_weights(self, path: str | None, version: int) -> dict:
        """Load ``version`` from the directory ``path``, or (``path`` None) wait until it arrives by broadcast."""
        body = {"version": version} if path is None else {"path": path, "version": version}
        return await self._post("/update_weights", body)

    async def pause(self) -> dict:
        return await self._post("/pause", {})

    async def resume(self) -> dict:
        return await self._post("/resume", {})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
