"""``ToolEnv`` and ``StatefulToolEnv``: the model calls Python functions as tools, in OpenAI's tool-call format.

A function becomes a tool from its signature and docstring
(:func:`tool_schema`): the name, the first docstring paragraph as the
description, each parameter's JSON Schema from its annotation and its
description from a ``:param name:`` line (or a Google-style ``Args:`` entry).
Arguments are validated against the annotations before the call.

The model writes calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes/Qwen style; reasoning inside ``<think>`` is ignored); each becomes an
OpenAI ``tool_calls`` entry of the assistant message and is answered by a
``{"role": "tool", "tool_call_id": ..., "content": ...}`` message. A call
that does not parse, names no known tool, has bad arguments, raises or runs
past ``tool_timeout_s`` is answered with ``Error: ...`` in its tool message:
the model sees what went wrong, the rollout goes on. A turn without tool
calls ends the rollout.

``StatefulToolEnv`` adds arguments the model never sees: a tool's
parameters named in ``hidden`` are left out of its schema and filled from
the rollout state by :meth:`StatefulToolEnv.update_tool_args` (a sandbox id,
a session handle).
"""

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable

import pydantic
from pydantic import Field

from i3core.errors import RolloutMasked, SandboxError
from i3core.plugins.envs.multiturn import MultiTurnConfig, MultiTurnEnv

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
MAX_RESULT_CHARS = 2000
"""A tool result longer than this is cut (it would fill the context)."""


def _param_docs(doc: str) -> dict[str, str]:
    found = dict(re.findall(r":param (\w+):\s*(.+)", doc))
    args = re.search(r"\n\s*(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.DOTALL)
    if args:
        for name, text in re.findall(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", args.group(1), re.MULTILINE):
            found.setdefault(name, text.strip())
    return found


def tool_schema(func: Callable, hidden: tuple[str, ...] = ()) -> dict:
    """The OpenAI tool spec of ``func``; parameters in ``hidden`` are left out."""
    doc = inspect.getdoc(func) or ""
    description = doc.split("\n\n", 1)[0].strip()
    hints = typing.get_type_hints(func)
    docs = _param_docs(doc)
    properties, required = {}, []
    for name, param in inspect.signature(func).parameters.items():
        if name in hidden or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema = pydantic.TypeAdapter(hints.get(name, typing.Any)).json_schema()
        if name in docs:
            schema["description"] = docs[name]
        if param.default is param.empty:
            required.append(name)
        else:
            schema["default"] = param.default
        properties[name] = schema
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": func.__name__, "description": description,
                                             "parameters": parameters}}


def parse_tool_calls(text: str, turn: int) -> list[dict]:
    """The ``<tool_call>`` blocks of an assistant turn as OpenAI ``tool_calls`` entries.

    A block that is not ``{"name": str, "arguments": object}`` JSON keeps its
    raw text under ``function.arguments`` and the reason under ``error``.
    """
    calls = []
    for i, raw in enumerate(TOOL_CALL.findall(THINK.sub("", text))):
        call = {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": "", "arguments": raw.strip()}}
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                raise ValueError('expected {"name": "...", "arguments": {...}}')
            arguments = body.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be a JSON object")
            call["function"] = {"name": body["name"], "arguments": json.dumps(arguments)}
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            call["error"] = f"could not parse the tool call: {exc}"
        calls.append(call)
    return calls


class ToolConfig(MultiTurnConfig):
    tool_timeout_s: float = Field(10.0, gt=0, description="Limit of one tool call; past it the model gets an error.")


class ToolEnv(MultiTurnEnv):
    """A multi-turn env whose env turns are the results of the model's tool calls.

    Subclasses pass their tools (plain or async functions) to :meth:`add_tool`
    in ``__init__``, or list them in ``tools``.
    """

    Config = ToolConfig
    tools: tuple[Callable, ...] = ()

    def __init__(self, config: ToolConfig):
        super().__init__(config)
        self._tools: dict[str, Callable] = {}
        self._schemas: dict[str, dict] = {}
        self._hidden: dict[str, tuple[str, ...]] = {}
        for func in self.tools:
            self.add_tool(func)

    def add_tool(self, func: Callable, hidden: tuple[str, ...] = ()) -> None:
        """Offer ``func`` to the model; ``hidden`` parameters are not in its schema (StatefulToolEnv fills them)."""
        name = func.__name__
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        self._tools[name] = func
        self._hidden[name] = tuple(hidden)
        self._schemas[name] = tool_schema(func, hidden)

    def tool_specs(self) -> list[dict] | None:
        return list(self._schemas.values()) or None

    def parse_reply(self, message: dict, state: dict) -> dict:
        calls = parse_tool_calls(message["content"], state["turn"])
        if calls:
            message["tool_calls"] = calls
        return message

    async def is_completed(self, messages: list[dict], state: dict) -> bool:
        return not messages[-1].get("tool_calls")

    def update_tool_args(self, name: str, args: dict, messages: list[dict], state: dict) -> dict:
        """The arguments ``name`` is called with (ToolEnv: the model's own)."""
        return args

    async def env_response(self, messages: list[dict], state: dict) -> list[dict]:
        calls = messages[-1]["tool_calls"]
        results = await asyncio.gather(*(self._call(call, messages, state) for call in calls))
        metrics = state["metrics"]
        metrics["tool_calls"] = metrics.get("tool_calls", 0.0) + len(calls)
        errors = sum(result.startswith("Error:") for result in results)
        metrics["tool_errors"] = metrics.get("tool_errors", 0.0) + errors
        return [{"role": "tool", "tool_call_id": call["id"], "content": result} for call, result in zip(calls, results)]

    async def _call(self, call: dict, messages: list[dict], state: dict) -> str:
        if "error" in call:
            return f"Error: {call['error']}"
        name = call["function"]["name"]
        func = self._tools.get(name)
        if func is None:
            return f"Error: unknown tool {name!r}; tools: {', '.join(self._tools)}"
        args = json.loads(call["function"]["arguments"])
        offered = set(self._schemas[name]["function"]["parameters"]["properties"])
        if extra := sorted(set(args) - offered):
            return f"Error: {name} takes no argument {', '.join(extra)}"
        try:
            args = _validated(func, self.update_tool_args(name, args, messages, state))
        except TypeError as exc:
            return f"Error: bad arguments for {name}: {exc}"
        try:
            async with asyncio.timeout(self.config.tool_timeout_s):
                if inspect.iscoroutinefunction(func):
                    result = await func(**args)
                else:  # off the event loop, so a slow tool stalls only its own rollout, and only until the timeout
                    result = await asyncio.to_thread(func, **args)
                    if inspect.isawaitable(result):
                        result = await result
        except TimeoutError:
            return f"Error: {name} timed out after {self.config.tool_timeout_s:g}s"
        except (SandboxError, RolloutMasked):  # the sandbox failed, not the model's call: the rollout is masked
            raise
        except (Exception, SystemExit) as exc:  # the model's call failed: it reads why (sys.exit() in a tool,
            return f"Error: {type(exc).__name__}: {exc}"  # in a task of its own, would end the run)
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        return text[:MAX_RESULT_CHARS]


def _validated(func: Callable, args: dict) -> dict:
    """``args`` checked and converted against ``func``'s annotations (missing required ones are an error)."""
    signature = inspect.signature(func)
    bound = signature.bind(**args)  # TypeError on a missing argument
    hints = typing.get_type_hints(func)
    checked, problems = {}, []
    for name, value in bound.arguments.items():
        try:
            checked[name] = pydantic.TypeAdapter(hints.get(name, typing.Any)).validate_python(value)
        except pydantic.ValidationError as exc:
            problems += [f"{name}: {e['msg']}" for e in exc.errors()]
    if problems:
        raise TypeError("; ".join(problems))
    return checked


class StatefulToolEnv(ToolEnv):
    """Tools with arguments taken from the rollout state, hidden from the model's schema.

    ``add_tool(func, hidden=("sandbox_id",))`` leaves ``sandbox_id`` out of
    the schema the model sees; :meth:`update_tool_args` fills every hidden
    parameter from ``state`` under the same name (override it for anything
    else). A model that passes a hidden argument itself gets an error.
    """

    def update_tool_args(self, name: str, args: dict, messages: list[dict], state: dict) -> dict:
        missing = [p for p in self._hidden[name] if p not in state]
        if missing:
            raise TypeError(f"the rollout state has no {', '.join(missing)}")
        return {**args, **{p: state[p] for p in self._hidden[name]}}
