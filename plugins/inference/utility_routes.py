"""vLLM's utility routes on the builtin server: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Shapes as vLLM serves them, so a client (an evaluation harness counting tokens, a load generator sizing prompts)
moves between backends unchanged: ``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``, default true) or
chat ``messages`` (and ``tools``) rendered by the model's chat template with the assistant's turn opened, and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``; ``/version`` answers ``{"version"}`` (i3core's).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Literal

from aiohttp import web
from pydantic import model_validator

from i3core.plugins.inference.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    BadRequest,
    Message,
    RequestModel,
    Tool,
    bounded,
    parse,
    parse_json_object,
    prompt_token_ids,
)


class TokenizeRequest(RequestModel):
    """``POST /tokenize``: a prompt, or chat messages as the chat route renders them."""

    model: str | None = bounded(None, "a string")
    prompt: str | None = bounded(None, "a string")
    messages: list[Message] | None = bounded(None, f"a non-empty list of at most {MAX_MESSAGES} messages",
                                             min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = bounded(None, f"a list of at most {MAX_TOOLS} function tools", max_length=MAX_TOOLS)
    add_special_tokens: bool | None = bounded(None, "true or false",
                                              "Default: true for a prompt, false for messages (the template writes "
                                              "its own).")
    add_generation_prompt: Literal[True] = bounded(
        True, "true (the chat template always opens the assistant's turn)")
    return_token_strs: bool = bounded(False, "true or false", "Each token's text too.")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give either prompt or messages", param="prompt")
        return self


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``."""

    model: str | None = bounded(None, "a string")
    tokens: list[int] = bounded(..., "a list of token ids")


class UtilityRoutes:
    """The utility routes of one :class:`~i3core.plugins.inference.server.Server`."""

    def __init__(self, server):
        self.server = server

    def routes(self) -> list:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                web.get("/version", self.version)]

    async def tokenize(self, http: web.Request) -> web.Response:
        server = self.server
        request = parse(TokenizeRequest, parse_json_object(await http.read()))
        if request.messages is not None:
            tools = [tool.model_dump(exclude_unset=True) for tool in request.tools or []] or None
            text = server.render_chat([m.for_template() for m in request.messages], tools)
            special = bool(request.add_special_tokens)
        else:
            text, special = request.prompt, request.add_special_tokens is not False
        param = "messages" if request.messages is not None else "prompt"
        tokens = await server.encode(text, add_special_tokens=special, param=param)
        strs = [server.tokenizer.id_to_token(t) for t in tokens] if request.return_token_strs else None
        return web.json_response({"count": len(tokens), "max_model_len": server.engine.max_len, "tokens": tokens,
                                  "token_strs": strs})

    async def detokenize(self, http: web.Request) -> web.Response:
        server = self.server
        request = parse(DetokenizeRequest, parse_json_object(await http.read()))
        if len(request.tokens) > server.engine.max_len:  # no sequence of this server is longer
            raise BadRequest(f"tokens: at most {server.engine.max_len} (the server's --max-len)", param="tokens")
        tokens = prompt_token_ids(request.tokens, server.engine.vocab_size, None, param="tokens")
        return web.json_response({"prompt": server.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def version(self, http: web.Request) -> web.Response:
        return web.json_response({"version": i3core_version()})


def i3core_version() -> str:
    """The installed i3core's version ("unknown" from a source tree that is not installed)."""
    try:
        return version("i3core")
    except PackageNotFoundError:
        return "unknown"
