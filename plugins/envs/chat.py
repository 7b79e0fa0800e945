"""Chat rendering for multi-turn envs, tokens in and tokens out.

A multi-turn trajectory is one token sequence that only ever grows: the
prompt is rendered once (:meth:`prompt_ids`), each model turn is appended as
the exact token ids the server sampled (its stop token included), and each
env turn (tool results, feedback) is rendered on its own and appended
(:meth:`continuation_ids`). Earlier turns are never rendered again, so a chat
template that rewrites history (Qwen3's drops the ``<think>`` part of earlier
assistant turns) cannot break the prefix the model saw, and the logprobs the
server returned stay aligned with the tokens trained on.

Three renderers: :class:`ChatML` for a ``tokenizers.Tokenizer`` with
``<|im_start|>``/``<|im_end|>`` specials (the tiny model's), :class:`HFChatTemplate`
for a ``transformers`` tokenizer that has a chat template, and :class:`ModelTemplate`
for a tokenizer that carries its model's own chat template as ``render_chat`` and
``end_of_turn_ids`` (the ``hf`` model component's). :func:`renderer_for` picks one.
"""

from typing import Any, Protocol

from i3core.text import completion_text

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DUMMY_TURN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
"""A fixed conversation that env messages are rendered after, to find their tokens alone."""
PROBE_REPLY = "i3core-probe-reply"
PROBE_TURN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE_REPLY}]
"""A conversation whose assistant reply is found by its text, for :class:`ModelTemplate`."""


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (``tokenizers`` or ``transformers``)."""
    if hasattr(tokenizer, "apply_chat_template"):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def token_id(tokenizer, token: str) -> int | None:
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        found = tokenizer.convert_tokens_to_ids(token)
        return None if found == getattr(tokenizer, "unk_token_id", None) else found
    return tokenizer.token_to_id(token)


class ChatRenderer(Protocol):
    stop_ids: list[int]
    """Token ids that end an assistant turn."""

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The first prompt, ending with the assistant generation header."""

    def continuation_ids(self, messages: list[dict]) -> list[int]:
        """``messages`` (tool/user turns) appended after an assistant turn that ended with a stop token,
        followed by the next assistant generation header."""

    def reply_text(self, token_ids: list[int]) -> str:
        """The text of an assistant turn's content (its stop token left out)."""


def tools_text(tools: list[dict]) -> str:
    """Tool instructions for a system message, compact (one signature line per tool: small models have
    short contexts); a template with tool support renders the full JSON schemas itself."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        props = fn["parameters"]["properties"]
        args = ", ".join(f"{name}: {schema.get('type', 'any')}" for name, schema in props.items())
        lines.append(f"{fn['name']}({args}): {fn['description']}")
    return ("Tools:\n" + "\n".join(lines) + '\nCall: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')


class ChatML:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` over a ``tokenizers.Tokenizer`` (the tiny model's)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        end = token_id(tokenizer, IM_END)
        if end is None or token_id(tokenizer, IM_START) is None:
            raise ValueError(f"ChatML needs the {IM_START} and {IM_END} tokens in the vocabulary")
        self.stop_ids = [end]

    def _render(self, messages: list[dict]) -> str:
        return "".join(f"{IM_START}{m['role']}\n{m.get('content') or ''}{IM_END}\n" for m in messages)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if tools:
            if messages and messages[0]["role"] == "system":
                system = {"role": "system", "content": messages[0]["content"] + "\n\n" + tools_text(tools)}
                messages = [system, *messages[1:]]
            else:
                messages = [{"role": "system", "content": tools_text(tools)}, *messages]
        return encode(self.tokenizer, self._render(messages) + f"{IM_START}assistant\n")

    def continuation_ids(self, messages: list[dict]) -> list[int]:
        return encode(self.tokenizer, "\n" + self._render(messages) + f"{IM_START}assistant\n")

    def reply_text(self, token_ids: list[int]) -> str:
        return completion_text(self.tokenizer, token_ids, stop_token_ids=self.stop_ids)


class HFChatTemplate:
    """A ``transformers`` tokenizer's own chat template.

    Env messages are rendered after :data:`DUMMY_TURN` and cut just after the
    dummy assistant turn's end token, which is where the model's own stop
    token left the real trajectory: what lies between (a newline in ChatML
    templates) is part of the env's tokens.
    """

    def __init__(self, tokenizer, end_token: str | None = None):
        self.tokenizer = tokenizer
        self.end_token = end_token or tokenizer.eos_token
        end = token_id(tokenizer, self.end_token)
        if end is None:
            raise ValueError(f"the end-of-turn token {self.end_token!r} is not in the vocabulary")
        self.stop_ids = [end]

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode(self.tokenizer, self._render(messages, tools, generation=True))

    def continuation_ids(self, messages: list[dict]) -> list[int]:
        before = self._render(DUMMY_TURN, None, generation=False)
        cut = before.rindex(self.end_token) + len(self.end_token)
        after = self._render([*DUMMY_TURN, *messages], None, generation=True)
        if not after.startswith(before[:cut]):
            raise ValueError("the chat template renders the same turns differently when more follow")
        return encode(self.tokenizer, after[cut:])

    def reply_text(self, token_ids: list[int]) -> str:
        return completion_text(self.tokenizer, token_ids, stop_token_ids=self.stop_ids)


class ModelTemplate:
    """The chat template a model component hands over with its tokenizer: ``tokenizer.render_chat(messages,
    tools)`` (the prompt, the assistant's turn opened) and ``tokenizer.end_of_turn_ids`` (the template's end
    token first, then the model's other stop tokens).

    Env messages are rendered after :data:`PROBE_TURN` and cut just after the probe assistant turn's end token,
    which is where the model's own stop token left the real trajectory. Only what follows that token is taken,
    so a template that renders the earlier turns differently once more follow (Qwen3 drops the ``<think>`` block
    of an assistant turn that is no longer the last) does not matter: those turns are never rendered again.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stop_ids = list(tokenizer.end_of_turn_ids)
        if not self.stop_ids:
            raise ValueError("the model names no end-of-turn token")
        self.end_text = decode(tokenizer, self.stop_ids[:1])

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode(self.tokenizer, self.tokenizer.render_chat(messages, tools))

    def continuation_ids(self, messages: list[dict]) -> list[int]:
        after = self.tokenizer.render_chat([*PROBE_TURN, *messages])
        reply = after.rindex(PROBE_REPLY)
        end = after.find(self.end_text, reply)
        if end < 0:
            raise ValueError(f"the chat template does not close an assistant turn with {self.end_text!r}")
        return encode(self.tokenizer, after[end + len(self.end_text):])

    def reply_text(self, token_ids: list[int]) -> str:
        return completion_text(self.tokenizer, token_ids, stop_token_ids=self.stop_ids)


def renderer_for(tokenizer: Any) -> ChatRenderer:
    """:class:`HFChatTemplate` for a transformers tokenizer with a chat template, :class:`ModelTemplate` for a
    tokenizer that carries its model's template (``render_chat``), else :class:`ChatML`."""
    if getattr(tokenizer, "chat_template", None):
        return HFChatTemplate(tokenizer)
    if callable(getattr(tokenizer, "render_chat", None)):
        return ModelTemplate(tokenizer)
    return ChatML(tokenizer)
