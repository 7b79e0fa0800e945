"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) over the builtin server's chat path.

What agent frameworks post by default (openai-agents' Responses model, inspect-ai's ``openai/`` provider):
``input`` as a string or a list of items (messages, ``function_call``, ``function_call_output``),
``instructions``, function ``tools`` with ``tool_choice``, ``max_output_tokens``, ``temperature``, ``top_p``,
``stream`` and ``previous_response_id``. The items become chat messages, the model's chat template renders them
and the same tool parser as chat reads the calls out of the text (:func:`~.protocol.split_tool_calls`); the
engine, the sampling and the streaming text are :class:`~.openai_api.OpenAIRoutes`' own. A stored response
(``store``, the default) is kept in a bounded in-memory store, so a later request may continue it by
``previous_response_id``. Built-in tools (web search, file search, ...) are refused by name.
"""

import contextlib
import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from aiohttp import web
from pydantic import StringConstraints

from i3core.plugins.inference.protocol import (
    MAX_TOKENS,
    STREAM_END,
    TOOL_CALL_OPEN,
    BadRequest,
    ChatRequest,
    RequestModel,
    StreamingFields,
    bounded,
    check_fields,
    error_response,
    parse,
    parse_json_object,
    split_tool_calls,
)
from i3core.text import end_ids

MAX_STORED = 1024
"""Responses kept for ``previous_response_id`` (the oldest is forgotten first): an agent continues its last one."""
FUNCTION = "function"


class ResponsesRequest(RequestModel):
    """The fields of ``POST /v1/responses`` that are the Responses API's own; the sampling fields (``temperature``,
    ``top_p``, ``stream``, vLLM's extensions...) are a chat request's, under the same names (:data:`SHARED`).
    ``user``, ``prompt_cache_key``, ``prompt_cache_retention`` and ``safety_identifier`` are accepted and ignored,
    ``metadata`` echoed; ``text``, ``truncation``, ``reasoning`` and ``service_tier`` are accepted at values that
    ask for nothing."""

    unsupported: ClassVar[dict] = {"text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": {},
                                   "service_tier": "auto"}

    input: str | list[dict[str, Any]] = bounded(..., "a string or a non-empty list of items", min_length=1)
    instructions: str | None = bounded(None, "a string", "A system message before the input.")
    tools: list[dict[str, Any]] | None = bounded(None, "a list of function tools")
    tool_choice: Literal["auto", "none"] | None = bounded(None, '"auto" or "none": this server cannot force a call')
    parallel_tool_calls: bool | None = bounded(None, "true or false", "Accepted, echoed.")
    max_output_tokens: int | None = bounded(None, "an integer in [1, max_len]", ge=1, le=MAX_TOKENS)
    previous_response_id: str | None = bounded(None, "the id of a stored response")
    store: bool = bounded(True, "true or false", f"Keep the response for previous_response_id (the last {MAX_STORED}).")
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = bounded(
        None, "an object of at most 16 strings, keys of up to 64 characters, values of up to 512",
        "Echoed and stored with the response (OpenAI's limits).", max_length=16)
    prompt_cache_key: str | None = bounded(None, "a string")
    prompt_cache_retention: str | None = bounded(None, "a string")
    include: list[Literal["reasoning.encrypted_content"]] | None = bounded(
        None, 'a list of "reasoning.encrypted_content" (this server writes no reasoning items; output logprobs and '
              "tool outputs are not available)", "What the output items should carry beyond the default.")
    safety_identifier: str | None = bounded(None, "a string")


SHARED = tuple(name for name in StreamingFields.model_fields if name not in ("n", "max_tokens"))
"""The chat request's fields a Responses request sends as they are (sampling, ``model``, ``stream``, ``user``)."""


class Responses:
    """``/v1/responses`` of one :class:`~.openai_api.OpenAIRoutes` (its server, sequences and text streams)."""

    def __init__(self, routes, served):
        self.routes = routes
        self.served = served
        """``served(http, prompt_tokens, outputs)``: what the request line says of a served request."""
        self.server = routes.server
        self.stored: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        """Response id -> (the conversation it ended, as chat messages without instructions; the response)."""

    def web_routes(self) -> list:
        return [web.post("/v1/responses", self.create), web.get("/v1/responses/{response_id}", self.retrieve)]

    async def retrieve(self, http: web.Request) -> web.Response:
        found = self.stored.get(http.match_info["response_id"])
        if found is None:
            raise web.HTTPNotFound()
        return web.json_response(found[1])

    async def create(self, http: web.Request) -> web.StreamResponse:
        server = self.server
        body = parse_json_object(await http.read())
        check_fields(body, (*ResponsesRequest.model_fields, *SHARED), ResponsesRequest.unsupported)
        request = parse(ResponsesRequest, {k: v for k, v in body.items() if k in ResponsesRequest.model_fields})
        tools = _tools(request.tools)
        choice = request.tool_choice or "auto"
        history, places = self._history(request.previous_response_id), []
        conversation = [*history, *_messages(request.input, places)]
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        with _named_as_input(Places(len(system), len(history), places)):
            chat = parse(ChatRequest, {**{k: v for k, v in body.items() if k in SHARED},
                                       "messages": system + conversation, "tools": tools or None,
                                       "tool_choice": choice, "max_completion_tokens": request.max_output_tokens})
            offered = chat.offered_tools()
            prompt_ids = await server.encode(server.render_chat(chat.template_messages(), offered, param="input"),
                                             add_special_tokens=False, param="input")
            sampling = chat.stream_sampling(server.engine.max_len, server.engine.vocab_size,
                                            end_ids(server.model, chat=True), end_ids(server.model))
            (seq,) = self.routes._sequences([prompt_ids], sampling)
        instructions = request.instructions
        response = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": server.model_name, "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": instructions, "metadata": request.metadata or {}, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "tool_choice": choice,
            "tools": [{"type": FUNCTION, "name": t["function"]["name"],
                       "description": t["function"].get("description"), "parameters": t["function"].get("parameters"),
                       "strict": t["function"].get("strict", False)} for t in tools],
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id, "store": request.store,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
        }  # fmt: skip
        hold = TOOL_CALL_OPEN if offered else None
        if sampling.stream:
            return await self._stream(http, seq, sampling, hold, response, conversation, len(prompt_ids))
        out = await self.routes._run(seq, sampling, hold)
        self.served(http, len(prompt_ids), [out])
        server.requests_served += 1
        content, calls = split_tool_calls(out.text) if hold else (out.text, [])
        response["output"] = [*([_message(content)] if content else []), *(_call(c) for c in calls)]
        self._finish(response, out, len(prompt_ids), conversation)
        return web.json_response(response)

    def _history(self, previous: str | None) -> list[dict]:
        """The messages of a stored response that ``previous`` names (none without one)."""
        if previous is None:
            return []
        if previous not in self.stored:
            raise BadRequest(f"Previous response with id {previous!r} not found (this server keeps the last "
                             f"{MAX_STORED} stored responses, in memory)", param="previous_response_id")
        self.stored.move_to_end(previous)
        return self.stored[previous][0]

    def _finish(self, response: dict, out, prompt_tokens: int, conversation: list[dict]) -> None:
        """Fill ``response``'s status and usage; keep it if it is to be stored."""
        length = out.finish_reason == "length"
        response["status"] = "incomplete" if length else "completed"
        response["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
        response["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt_tokens + len(out.token_ids)}
        if response["store"]:
            self.stored[response["id"]] = ([*conversation, *_as_messages(response["output"])], response)
            while len(self.stored) > MAX_STORED:
                self.stored.popitem(last=False)

    async def _stream(self, http: web.Request, seq, sampling, hold: str | None, response: dict,
                      conversation: list[dict], prompt_tokens: int) -> web.StreamResponse:
        """The Responses event sequence: ``response.created``, ``response.in_progress``; for the text, a message
        item (``output_item.added``, ``content_part.added``, ``output_text.delta``..., ``output_text.done``,
        ``content_part.done``, ``output_item.done``); for each call, a function_call item
        (``output_item.added``, ``function_call_arguments.delta``/``.done``, ``output_item.done``); then
        ``response.completed`` (status ``incomplete`` when ``max_output_tokens`` ended it, as vLLM sends it). An
        error after the 200 (a failed sequence, the engine, a shutdown, a bug) ends the stream with
        ``response.failed`` (the response with status ``failed`` and its ``error``), through :data:`STREAM_END`."""
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(http)
        number = 0

        async def send(kind: str, **fields) -> None:
            nonlocal number
            event = {"type": kind, "sequence_number": number, **fields}
            number += 1
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

        async def failed(exc: Exception) -> web.StreamResponse:
            _, body = error_response(exc)
            response["status"] = "failed"
            response["error"] = {"code": body["error"]["code"] or body["error"]["type"],
                                 "message": body["error"]["message"]}
            await send("response.failed", response=response)
            await stream.write_eof()
            return stream

        http[STREAM_END] = failed
        await send("response.created", response=response)
        await send("response.in_progress", response=response)
        message = _message("")
        message["status"], text = "in_progress", ""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": message["id"], "output_index": 0, "content_index": 0}

        async def on_delta(piece: str, first: int, last: int) -> None:
            nonlocal text
            if not piece:
                return
            if not text:
                await send("response.output_item.added", output_index=0, item={**message, "content": []})
                await send("response.content_part.added", part=part, **where)
            text += piece
            await send("response.output_text.delta", delta=piece, logprobs=[], **where)

        out = await self.routes._run(seq, sampling, hold, on_delta)  # an error ends the stream: STREAM_END
        self.served(http, prompt_tokens, [out])
        output = []
        if text:
            done = _message(text)
            done["id"] = message["id"]
            await send("response.output_text.done", text=text, logprobs=[], **where)
            await send("response.content_part.done", part={**part, "text": text}, **where)
            await send("response.output_item.done", output_index=0, item=done)
            output.append(done)
        for call in split_tool_calls(out.text)[1] if hold else []:
            item, index = _call(call), len(output)
            await send("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"})
            await send("response.function_call_arguments.delta", delta=item["arguments"], item_id=item["id"],
                       output_index=index)
            await send("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"],
                       item_id=item["id"], output_index=index)
            await send("response.output_item.done", output_index=index, item=item)
            output.append(item)
        response["output"] = output
        self._finish(response, out, prompt_tokens, conversation)
        self.server.requests_served += 1
        await send("response.completed", response=response)
        await stream.write_eof()
        return stream


def _tools(tools) -> list[dict]:
    """Responses function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as chat
    tools; a built-in tool is refused by name."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("tools must be a list of tool objects", param="tools")
    builtin = sorted({str(t.get("type")) for t in tools if t.get("type") != FUNCTION})
    if builtin:
        raise BadRequest(f"tools of type {', '.join(builtin)} are not supported by this server: it runs function "
                         "tools only (the client executes them)", param="tools")
    if not all(isinstance(t.get("name"), str) and t["name"] for t in tools):
        raise BadRequest('a function tool needs a "name"', param="tools")
    return [{"type": FUNCTION, "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                            if t.get(k) is not None}} for t in tools]


@dataclass
class Place:
    """The ``input`` items one chat message was made of: ``item`` (None: ``input`` is a string), and the
    ``function_call`` items of its ``tool_calls``, in order."""

    item: int | None
    calls: list[int] = field(default_factory=list)


@dataclass
class Places:
    """Where the chat messages of a Responses request came from: ``system`` messages (``instructions``), then
    ``history`` ones (``previous_response_id``), then one :class:`Place` per message of ``input``."""

    system: int
    history: int
    input: list[Place]

    def param(self, param: str) -> str:
        """A field of the chat request (``messages[3].tool_calls[0].function.arguments``, ``max_tokens``) as
        the Responses request's (``input[4].arguments``, ``max_output_tokens``)."""
        if param in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        found = CHAT_MESSAGE.fullmatch(param)
        if found is None:
            return "input" if param.startswith("messages") else param
        index, call, rest = int(found[1]), found[2], found[3]
        if index < self.system:
            return "instructions"
        if index < self.system + self.history:
            return "previous_response_id"
        place = self.input[index - self.system - self.history]
        if place.item is None:
            return "input"
        if call is not None and int(call) < len(place.calls):
            return f"input[{place.calls[int(call)]}]" + ITEM_FIELDS.get(rest, "")
        return f"input[{place.item}]" + ITEM_FIELDS.get(rest, rest if call is None else "")


CHAT_MESSAGE = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)")
ITEM_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id",
               ".tool_call_id": ".call_id"}
"""A chat message's fields as the Responses item's (a tool call's ``function.arguments`` is a ``function_call``
item's ``arguments``...)."""


@contextlib.contextmanager
def _named_as_input(places: Places):
    """A Responses request is answered through a chat request: its errors name the Responses fields."""
    try:
        yield
    except BadRequest as exc:
        if not exc.param:
            raise
        param = places.param(exc.param)
        raise BadRequest(str(exc).replace(exc.param, param, 1), param=param, code=exc.code,
                         status=exc.status) from None


def _messages(items, places: list[Place] | None = None) -> list[dict]:
    """``input`` as chat messages: a string is one user message; items are messages (``role`` and ``content``,
    a string or ``input_text``/``output_text`` parts), ``function_call`` (joined to the assistant turn before it)
    and ``function_call_output`` (a tool message). ``places`` gets, per message, the items it was made of."""
    places = [] if places is None else places
    if isinstance(items, str):
        places.append(Place(None))
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
            places.append(Place(i))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest(f"{where}: a function_call needs call_id, name and arguments", param="input")
            call = {"id": item["call_id"], "type": FUNCTION,
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
                places.append(Place(i))
            last.setdefault("tool_calls", []).append(call)
            places[-1].calls.append(i)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call_output needs a call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content(item.get("output"), where)})
            places.append(Place(i))
        else:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported (messages, function_call and "
                             "function_call_output are)", param="input")
    return messages


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise BadRequest(f"{where}: content must be a string or a list of input_text/output_text parts", param="input")


def _message(text: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call(call: dict) -> dict:
    """A chat tool call (from :func:`split_tool_calls`) as a Responses ``function_call`` item."""
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that continue its conversation."""
    return _messages([{"role": "assistant", "content": item["content"]} if item["type"] == "message" else
                      {k: item[k] for k in ("type", "call_id", "name", "arguments")} for item in output] or
                     [{"role": "assistant", "content": ""}])
