"""Hook-level testing helpers for plugin authors (in the spirit of pytest's ``pytester``).

Every helper takes or builds its own :class:`~i3core.manager.Plugins`; nothing
is global, so tests never leak plugins into each other. The same helpers are
pytest fixtures (``i3_plugins``, ``i3_make_component``, ``i3_hook_recorder``)
through the ``pytest11`` entry point.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata

from i3core import PROJECT_NAME
from i3core.config import build_component
from i3core.errors import I3Error
from i3core.manager import ENTRY_POINT_GROUP, Plugins, load_plugins
from i3core.registry import KINDS, Provider
from i3core.text import Detokenizer, completion_text
from i3core.types import Completion


def plugin_manager(*plugins: object, installed: bool = True, disable: tuple[str, ...] = ()) -> Plugins:
    """A fresh plugin manager.

    :param plugins: plugin objects (modules, classes, instances) to register on top.
    :param installed: load every installed plugin; ``False`` loads only i3core's built-ins.
    :param disable: plugin or distribution names to block.
    """
    entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    if not installed:
        entry_points = [ep for ep in entry_points if ep.dist is not None and ep.dist.metadata["Name"] == PROJECT_NAME]
    manager = load_plugins(entry_points=entry_points, disable=disable, trace=False)
    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        manager.register(plugin, name=name, provider=Provider(name, "(test)", "-"))
    return manager


def make_component(kind: str, name: str, *, plugins: Plugins | None = None, **options: Any) -> Any:
    """Build one component from its registered class and validated options, with no run.

    :param kind: a component kind (``loss``, ``optimizer``, ``env``, ...).
    :param name: the registered name (``icepop``).
    :param plugins: the manager to look in; default: a fresh one with every installed plugin.
    :param options: the component's ``Config`` fields.
    :raises ConfigError: unknown name or invalid options, every problem listed.
    """
    if kind not in KINDS:
        raise I3Error(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    plugins = plugins if plugins is not None else plugin_manager()
    return build_component(KINDS[kind].section, {"use": name, **options}, plugins)


@dataclass
class HookCall:
    """One recorded hook call."""

    name: str
    kwargs: dict[str, Any]
    result: Any = None
    error: BaseException | None = None


class HookRecorder:
    """Records every hook call made through one plugin manager until :meth:`close`."""

    def __init__(self, plugins: Plugins):
        self.calls: list[HookCall] = []
        self._pending: list[HookCall] = []
        self._undo = plugins.pm.add_hookcall_monitoring(self._before, self._after)

    def _before(self, hook_name: str, hook_impls: list, kwargs: dict) -> None:
        self._pending.append(HookCall(hook_name, dict(kwargs)))

    def _after(self, outcome: Any, hook_name: str, hook_impls: list, kwargs: dict) -> None:
        call = self._pending.pop()
        call.error = outcome.exception
        call.result = None if call.error is not None else outcome.get_result()
        self.calls.append(call)

    def getcalls(self, name: str) -> list[HookCall]:
        """Every recorded call of hook ``name``, in order."""
        return [call for call in self.calls if call.name == name]

    def names(self) -> list[str]:
        """The hook names called, in order."""
        return [call.name for call in self.calls]

    def assert_called(self, name: str, times: int | None = None) -> list[HookCall]:
        """Assert ``name`` was called (exactly ``times`` times when given); return its calls."""
        calls = self.getcalls(name)
        if times is None:
            assert calls, f"hook {name} was never called; called: {self.names()}"
        else:
            assert len(calls) == times, f"hook {name} called {len(calls)} times, expected {times}"
        return calls

    def close(self) -> None:
        self._undo()


@dataclass
class ScriptedRequest:
    """One request a :class:`ScriptedClient` received."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    stop_token_ids: list[int] | None
    stop: list[str] = field(default_factory=list)


@dataclass
class ScriptedClient:
    """An inference client that answers with canned replies, for hook-level env tests without a model.

    Each request takes the next reply: a string, or a function of the
    request's prompt ids returning one. The reply is tokenized with
    ``tokenizer``; generation stops after the first stop token (the
    request's ``stop_token_ids``, else ``stop_token_ids`` here), after the
    token that completes a stop string (the request's ``stop``, else ``stop``
    here) or at ``max_tokens``, exactly as a server would, so a reply can be
    cut; its text is :func:`i3core.text.completion_text`'s. Every
    token gets logprob ``logprob`` and policy version ``version``. Every
    request is recorded in ``requests``, so a test can check what the env sent.
    Running out of replies is an error.

    :param tokenizer: a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer.
    """

    tokenizer: Any
    replies: Sequence[str | Callable[[list[int]], str]]
    version: int = 0
    logprob: float = -0.25
    stop_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    requests: list[ScriptedRequest] = field(default_factory=list)

    def _encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "apply_chat_template"):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float) -> Completion:
        return await self.complete_ids(self._encode(prompt), max_tokens=max_tokens, temperature=temperature)

    async def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                           stop_token_ids: list[int] | None = None, stop: list[str] | None = None) -> Completion:
        stop_ids = stop_token_ids if stop_token_ids is not None else self.stop_token_ids
        strings = list(stop if stop is not None else self.stop)
        self.requests.append(ScriptedRequest(list(prompt_ids), max_tokens, temperature, stop_ids, strings))
        index = len(self.requests) - 1
        if index >= len(self.replies):
            raise AssertionError(f"ScriptedClient: request {index + 1} but only {len(self.replies)} replies")
        reply = self.replies[index]
        text = reply(list(prompt_ids)) if callable(reply) else reply
        ids, finish = self._encode(text)[:max_tokens], "length"
        detokenizer = Detokenizer(self.tokenizer, stop=strings)
        for i, token in enumerate(ids):
            if not (stop_ids and token in stop_ids):
                detokenizer.add(token)
                if detokenizer.stop_at is None:
                    continue
            ids, finish = ids[: i + 1], "stop"
            break
        text = completion_text(self.tokenizer, ids, stop_token_ids=stop_ids or (), stop=strings)
        return Completion(text, list(prompt_ids), ids, [self.logprob] * len(ids), [self.version] * len(ids), finish)


__all__ = ["HookCall", "HookRecorder", "ScriptedClient", "ScriptedRequest", "make_component", "plugin_manager"]
