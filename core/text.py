"""Completion token ids as text: the one text an environment scores, and the engines' incremental detokenizer.

Every backend (the builtin engine under ``local`` and ``builtin``, the ``vllm`` source's route) hands an env
the text :func:`completion_text` makes of the token ids it sampled, so one token sequence is scored the same
wherever it was generated:

- the token that ended generation (one of the request's stop token ids: an eos or end-of-turn token) is never
  part of the text; other special tokens are written as themselves unless ``skip_special_tokens``;
- the text ends before the first stop string, wherever the tokenizer put its characters (the token ids keep the
  token that completed it, as vLLM returns them).

:class:`Detokenizer` gives the same text one token at a time, in time linear in the completion's length, so an
engine can match stop strings on every step. A tokenizer here is anything with
``decode(ids, skip_special_tokens=...)`` (``tokenizers.Tokenizer``, a transformers tokenizer).
"""

from collections.abc import Collection, Sequence

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""
MAX_SPLIT_TOKENS = 3
"""Tokens an unfinished character can span at the end of the text: a UTF-8 character has at most 4 bytes, and
a token at least one."""


def completion_text(tokenizer, token_ids: Sequence[int], *, stop_token_ids: Collection[int] = (),
                    stop: Sequence[str] = (), skip_special_tokens: bool = False) -> str:
    """The text of a completion's ``token_ids``: what an env scores and a server answers.

    A last token in ``stop_token_ids`` (it ended generation) is left out; the text is cut before the first of
    the ``stop`` strings it holds.
    """
    ids = list(token_ids)
    if ids and ids[-1] in stop_token_ids:
        ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return text[:stop_index(text, stop)]


def stop_index(text: str, stop: Sequence[str], start: int = 0) -> int:
    """Where the first of the ``stop`` strings begins in ``text`` (searched from ``start``), else ``len(text)``."""
    found = [at for at in (text.find(s, start) for s in stop) if at >= 0]
    return min(found, default=len(text))


class Detokenizer:
    """The text of a growing token sequence, one token at a time (as vLLM's incremental detokenizer).

    Each :meth:`add` decodes only a window of recent tokens: those since the last complete character, after a
    few already given out (the context some decoders need to place a leading space). A character split across
    byte-level tokens is held back until its last byte arrives, so :attr:`text` never ends in half of one.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = False, stop: Sequence[str] = ()):
        self.tokenizer, self.skip_special_tokens, self.stop = tokenizer, skip_special_tokens, tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        """Every whole character so far."""
        self.stop_at: int | None = None
        """Where the first stop string begins in :attr:`text`, once one has appeared."""
        self._prefix = 0
        """Start of the decoded window: tokens already given out, decoded again only as context."""
        self._read = 0
        """Tokens whose text is in :attr:`text`."""

    def add(self, token: int) -> str:
        """Take the next token; the text it completes (empty while a character is unfinished)."""
        self.ids.append(token)
        before = self._decode(self._read)
        window = self._decode(len(self.ids))
        end = len(self.ids)
        if window.endswith(REPLACEMENT):
            # Bytes not yet a character decode to one replacement character, the last: everything before it is
            # final. Give out the longest run of whole tokens whose text is a prefix of that, if any.
            final, end = window[:-1], None
            for cut in range(len(self.ids) - 1, max(self._read, len(self.ids) - 1 - MAX_SPLIT_TOKENS), -1):
                text = self._decode(cut)
                if len(text) > len(before) and final.startswith(text):
                    window, end = text, cut
                    break
            if end is None:
                return ""
        if len(window) < len(before):  # a decoder that needs more context: wait for it
            return ""
        delta = window[len(before):]
        self._prefix, self._read = self._read, end
        if self.stop and self.stop_at is None:
            start = max(0, len(self.text) - max(map(len, self.stop)) + 1)  # a stop string may begin earlier
            self.text += delta
            at = stop_index(self.text, self.stop, start)
            self.stop_at = at if at < len(self.text) else None
        else:
            self.text += delta
        return delta

    def _decode(self, end: int) -> str:
        """The text of the window's tokens up to ``end`` (from the context ones on)."""
        return self.tokenizer.decode(self.ids[self._prefix:end], skip_special_tokens=self.skip_special_tokens)


def end_ids(model, chat: bool = False) -> list[int]:
    """Where a completion of ``model`` (a :class:`~i3core.protocols.Model`) stops by default, as vLLM stops it:
    at every end-of-sequence id (``eos_token_ids``: generation_config's ``eos_token_id``, all of them, and the
    tokenizer's; ``[eos_token_id]`` for a model without it), and, for a ``chat``, at the chat template's
    end-of-turn tokens first."""
    ids = list(getattr(model, "eos_token_ids", None) or [model.eos_token_id])
    if chat:
        ids = [*model.end_of_turn_ids, *ids]
    return list(dict.fromkeys(ids))
