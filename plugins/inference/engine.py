"""A continuous-batching generation engine over a KV cache, for the builtin inference server.

Scheduling: requests wait in a FIFO queue; before every decode step, waiting
requests take free cache slots (up to ``max_slots``) and are prefilled, prompts
of several lengths right-padded into one forward while the pads stay few
(:func:`prefill_batches`), a prompt several of them share (the ``n`` choices
of a request, a group's completions) once; then one decode
step runs every running sequence together. A request that asks for its prompt's
logprobs gets them from that same prefill forward (one LM head over the prompt's positions).
A finished sequence frees its slot at once, so a new request joins on the next
step. Sampling is batched: one set of tensor ops per group of sequences with
the same settings (:func:`sample`), a per-row draw only for seeded requests. vLLM's logits processors
(``min_tokens``, ``repetition_penalty``, ``presence_penalty``/``frequency_penalty``, ``logit_bias``) run before it
over the rows that set them, as tensor ops over the batch (:func:`process_logits`).

Stop strings are matched on the text, on the engine thread: a sequence with ``stop`` strings (or ``stream``)
carries an incremental :class:`~i3core.text.Detokenizer`, and the step that completes a stop string, across
whichever tokens hold it, finishes the sequence (``"stop"``) with the tokens up to that one. A finished
sequence's :attr:`Sequence.text` is :func:`~i3core.text.completion_text` of its tokens, the one text every
backend gives an env.

Faults: an error that belongs to one sequence (its row of logits is not finite, the sampler fails on its row)
finishes that sequence with ``finish_reason = "error"`` and a message in ``Sequence.error``; every other
sequence goes on. Anything else a step raises (the model's forward failing) breaks the engine: it propagates
out of :meth:`Engine.step` and whoever drives the engine fails every waiting caller.

Weights can be swapped between two steps (:meth:`Engine.load_state`): running
sequences keep their KV cache and continue under the new version, and every
generated token records the policy version that sampled it.

The engine knows a model only through :class:`~i3core.protocols.CausalLM`
(``new_kv_cache``, ``forward_cached``, ``logits``, ``state_dict_from_hf``), so it
runs any model component that meets :class:`~i3core.protocols.Model`.
"""

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

from i3core.protocols import CausalLM
from i3core.text import Detokenizer, completion_text
from i3core.weights import read_hf_tensors


@dataclass
class Request:
    """One generation request: prompt token ids and sampling settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to ``top_p``."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens; 0: all."""
    top_logprobs: int = 0
    """Alternatives recorded per generated token (``Sequence.top_logprobs``)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion, matched on its text; the tokens are kept up to the one that completed
    the first of them, and :attr:`Sequence.text` ends before it."""
    skip_special_tokens: bool = False
    """Leave special tokens out of the text (the stop token that ended it is left out either way)."""
    stream: bool = False
    """Build :attr:`Sequence.decoded` token by token for a stream (always done with ``stop`` strings)."""
    include_stop_str_in_output: bool = False
    """vLLM's: :attr:`Sequence.text` keeps the stop string that ended it."""
    prompt_logprobs: int | None = None
    """The prompt tokens' logprobs (``Sequence.prompt_logprobs``) with this many alternatives each, computed by the
    prefill; None: not computed."""
    min_tokens: int = 0
    """The stop tokens cannot be drawn before this many tokens (vLLM's ``min_tokens``)."""
    repetition_penalty: float = 1.0
    """vLLM's (CTRL's) penalty: the logit of a token already in the prompt or the completion is divided by it when
    positive, multiplied by it when negative; 1: off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token the completion already holds."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the completion holds it."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id -> a value added to its logit at every step."""

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor of :func:`process_logits` applies to this request."""
        return bool(self.min_tokens or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias)


@dataclass(eq=False)
class Sequence:
    """A request being served; ``token_ids``, ``logprobs``, ``versions`` grow one entry per step."""

    id: int
    request: Request
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per generated token, the ``top_logprobs`` most likely ``(token id, logprob)`` (empty when not asked)."""
    prompt_logprobs: list[float | None] = field(default_factory=list)
    """Per prompt token, its logprob given the tokens before it (None for the first), when the request asks."""
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per prompt token, the ``prompt_logprobs`` most likely ``(token id, logprob)`` at its place (the first: [])."""
    prompt_ranks: list[int | None] = field(default_factory=list)
    """Per prompt token, its rank at its place (1: the most likely; None for the first)."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort``, or ``error`` (then :attr:`error` says why)."""
    error: str | None = None
    """Why this sequence failed alone (non-finite logits, a sampler error); the engine went on."""
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    decoded: tuple[int, str] = (0, "")
    """``(tokens, their text)`` so far, whole characters only, replaced at once after each step that adds text
    (one attribute: a reader on another thread sees a consistent pair)."""
    text: str | None = None
    """The completion's text once it finished (:func:`~i3core.text.completion_text`); None on an engine without
    a tokenizer."""

    @property
    def length(self) -> int:
        """Tokens of this sequence in the cache plus the one waiting to be fed."""
        return len(self.request.prompt_ids) + len(self.token_ids)


class EngineBase(ABC):
    """What every engine behind :class:`~i3core.plugins.inference.server.Server` shares.

    A FIFO ``waiting`` queue, up to ``max_slots`` ``running`` sequences, request
    validation, aborts and the finish rule. Subclasses define :meth:`step`,
    :meth:`stage` (read and check new weights, off the engine task) and
    :meth:`load_state` (swap them in between two steps).
    """

    computes_logits = True
    """Whether the engine runs a model's logits (prompt logprobs and logits processors need them)."""

    def __init__(self, *, max_slots: int, max_len: int, vocab_size: int, version: int, tokenizer=None):
        self.max_slots, self.max_len, self.vocab_size = max_slots, max_len, vocab_size
        self.tokenizer = tokenizer
        """Decodes completions (``decode(ids, skip_special_tokens=...)``); None: no text, no stop strings."""
        self.version = version
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}
        self._free = list(range(max_slots))
        self._ids = itertools.count()
        self.steps = 0

    def add(self, request: Request) -> Sequence:
        """Queue ``request``; it joins the running batch at the next step with a free slot."""
        seq = self.new_sequence(request)
        self.waiting.append(seq)
        return seq

    def new_sequence(self, request: Request) -> Sequence:
        """Validate ``request`` and wrap it, without queueing it.

        :raises ValueError: an empty or too long prompt, a negative temperature, stop strings without a tokenizer, a
            setting this engine lacks.
        """
        if not self.computes_logits and (request.prompt_logprobs is not None or request.processes_logits):
            raise ValueError(f"{type(self).__name__} computes no logits: prompt logprobs, min_tokens, penalties and "
                             "logit_bias are not available on it")
        if request.logit_bias and any(not 0 <= t < self.vocab_size for t in request.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_ids) >= self.max_len:
            raise ValueError(f"the prompt has {len(request.prompt_ids)} tokens; this server holds at most {self.max_len - 1}")
        if request.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < request.top_p <= 1 or request.top_k < 0 or request.top_logprobs < 0:
            raise ValueError("top_p must be in (0, 1], top_k and top_logprobs >= 0")
        if (request.stop or request.stream) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: it cannot match stop strings or stream text")
        seq = Sequence(next(self._ids), request)
        if request.stop or request.stream:
            seq.detokenizer = Detokenizer(self.tokenizer, skip_special_tokens=request.skip_special_tokens,
                                          stop=request.stop)
        if request.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.seed)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @abstractmethod
    def step(self) -> list[Sequence]:
        """Admit waiting sequences to free slots, then generate one token for every running one.

        :return: the sequences that finished in this step.
        """

    @abstractmethod
    def stage(self, path: Path):
        """Read and validate the weights under ``path``; what :meth:`load_state` takes.

        :raises ValueError: missing or mismatched weights (the live engine is untouched).
        """

    @abstractmethod
    def stage_tensors(self, tensors: dict[str, torch.Tensor]):
        """Validate HF-layout ``tensors`` that arrived some other way (a broadcast); what :meth:`load_state` takes.

        :raises ValueError: missing or mismatched weights (the live engine is untouched).
        """

    @abstractmethod
    def load_state(self, state, version: int) -> None:
        """Swap in what :meth:`stage` returned, between two steps; running sequences continue under ``version``."""

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (a client went away)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif self.running.pop(seq.id, None) is not None:
            self._free.append(seq.slot)
        seq.finish_reason = seq.finish_reason or "abort"

    def _fail(self, seq: Sequence, message: str) -> None:
        """Finish ``seq`` alone with ``message`` (it was not sampled this step); its slot is freed and cleared."""
        seq.finish_reason, seq.error = "error", message
        self.running.pop(seq.id, None)
        if seq.slot >= 0:
            self._clear_slot(seq.slot)
            self._free.append(seq.slot)

    def _clear_slot(self, slot: int) -> None:
        """Leave nothing of a failed sequence (NaN keys and values) for the slot's next occupant."""

    def _maybe_finish(self, seq: Sequence) -> bool:
        """After a token was added: whether ``seq`` ends here (a stop token, a stop string, its length, a failure);
        a finished sequence gets its :attr:`~Sequence.text` and frees its slot."""
        if seq.finish_reason == "error":  # failed while sampling (:meth:`_fail`)
            return True
        if not seq.token_ids:  # max_tokens 0: the prompt alone (its logprobs), nothing generated
            seq.text, seq.finish_reason = "", "length"
            if seq.slot >= 0:
                self._free.append(seq.slot)
            return True
        token, request, detokenizer = seq.token_ids[-1], seq.request, seq.detokenizer
        if token in request.stop_token_ids:
            reason = "stop"
        else:
            if detokenizer is not None and detokenizer.add(token):
                seq.decoded = (len(seq.token_ids), detokenizer.text)
            if detokenizer is not None and detokenizer.stop_at is not None:
                reason = "stop"
            elif len(seq.token_ids) >= request.max_tokens or seq.length >= self.max_len:
                reason = "length"
            else:
                return False
        if self.tokenizer is not None:  # before the finish reason: a reader that sees one finds the text
            seq.text = completion_text(self.tokenizer, seq.token_ids, stop_token_ids=request.stop_token_ids,
                                       stop=request.stop, skip_special_tokens=request.skip_special_tokens)
            if request.include_stop_str_in_output and reason == "stop" and request.stop:
                whole = completion_text(self.tokenizer, seq.token_ids, stop_token_ids=request.stop_token_ids,
                                        skip_special_tokens=request.skip_special_tokens)
                rest = whole[len(seq.text):]
                seq.text += next((stop for stop in request.stop if rest.startswith(stop)), "")
        seq.finish_reason = reason
        if seq.slot >= 0:
            self._free.append(seq.slot)
        return True


class Engine(EngineBase):
    """The engine over a model's cached decode: :meth:`add` requests, call :meth:`step` until they finish."""

    def __init__(self, model: CausalLM, *, max_slots: int = 32, max_len: int = 512, version: int = 0,
                 tokenizer=None):
        super().__init__(max_slots=max_slots, max_len=max_len, vocab_size=model.vocab_size, version=version,
                         tokenizer=tokenizer)
        self.model = model.eval()
        self.cache = model.new_kv_cache(max_slots, max_len)
        self._tensors = dict(model.named_parameters())

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Admit and prefill waiting sequences, then decode one token for every running one.

        :return: the sequences that finished in this step.
        """
        finished = []
        admitted: list[Sequence] = []
        while self.waiting and self._free:
            seq = self.waiting.pop(0)
            seq.slot = self._free.pop(self._free.index(min(self._free)))  # the lowest: live slots stay packed
            admitted.append(seq)
        if admitted:
            seqs, hidden = self._prefill(admitted)
            generating = [i for i, seq in enumerate(seqs) if seq.request.max_tokens > 0]
            if len(generating) < len(seqs):
                hidden = hidden[torch.tensor(generating, dtype=torch.long)]
            self._sample([seqs[i] for i in generating], hidden)
            for seq in seqs:
                if self._maybe_finish(seq):
                    finished.append(seq)
                else:
                    self.running[seq.id] = seq
        decoding = sorted(self.running.values(), key=lambda s: s.slot)  # consecutive slots: the cache is read in place
        if decoding:
            tokens = torch.tensor([[s.token_ids[-1]] for s in decoding])
            positions = torch.tensor([[s.length - 1] for s in decoding])
            slots = torch.tensor([s.slot for s in decoding])
            hidden = self.model.forward_cached(tokens, positions, self.cache, slots)
            self._sample(decoding, hidden[:, -1])
            for seq in decoding:
                if self._maybe_finish(seq):
                    finished.append(seq)
                    self.running.pop(seq.id, None)
        self.steps += 1
        return finished

    def _clear_slot(self, slot: int) -> None:
        clear = getattr(self.cache, "clear_slots", None)  # optional, like copy_slots
        if callable(clear):
            clear(torch.tensor([slot]))

    def _prefill(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """Prefill ``seqs``; ``(seqs, hidden [B, H])`` of each one's last prompt token, in a new order.

        A prompt several of them share (a group's completions) is computed once and its cache entries copied to
        the others' slots, where the cache can (``copy_slots``). The prompts computed go in as few forwards as
        :func:`prefill_batches` allows, each right-padded to its longest prompt: a token attends to its own
        slot's entries up to its position only, so no prompt token sees a pad, and a pad's entries, past its
        prompt, are written over by the sequence's own tokens before anything reads them.
        """
        share = callable(getattr(self.cache, "copy_slots", None))
        unique: list[Sequence] = []
        row: dict = {}  # a prompt and its prompt_logprobs (each sequence its own where the cache cannot copy) -> row
        copies: list[tuple[Sequence, int]] = []  # a sequence and the row of the prompt it shares
        for seq in seqs:
            key = (tuple(seq.request.prompt_ids), seq.request.prompt_logprobs) if share else id(seq)
            if key in row:
                copies.append((seq, row[key]))
            else:
                row[key] = len(unique)
                unique.append(seq)
        computed: list[Sequence] = []
        last: list[torch.Tensor] = []
        for batch in prefill_batches(unique):
            lengths = [len(seq.request.prompt_ids) for seq in batch]
            width = max(lengths)
            prompts = torch.tensor([seq.request.prompt_ids + seq.request.prompt_ids[-1:] * (width - length)
                                    for seq, length in zip(batch, lengths)])
            positions = torch.arange(width).expand(len(batch), width)
            hidden = self.model.forward_cached(prompts, positions, self.cache, torch.tensor([s.slot for s in batch]))
            self._prompt_logprobs(batch, prompts, hidden, lengths)
            last.append(hidden[torch.arange(len(batch)), torch.tensor(lengths) - 1])
            computed += batch
        hidden = torch.cat(last) if len(last) > 1 else last[0]
        for seq, r in copies:
            seq.prompt_logprobs, seq.prompt_top_logprobs = unique[r].prompt_logprobs, unique[r].prompt_top_logprobs
            seq.prompt_ranks = unique[r].prompt_ranks
        if copies:
            at = {id(seq): i for i, seq in enumerate(computed)}
            rows = torch.tensor([at[id(unique[r])] for _, r in copies])
            length = max(len(seq.request.prompt_ids) for seq, _ in copies)  # entries past a prompt: written over
            self.cache.copy_slots(torch.tensor([unique[r].slot for _, r in copies]),
                                  torch.tensor([seq.slot for seq, _ in copies]), length)
            hidden = torch.cat([hidden, hidden[rows]])
        return computed + [seq for seq, _ in copies], hidden

    def _prompt_logprobs(self, seqs: list[Sequence], prompts: torch.Tensor, hidden: torch.Tensor,
                         lengths: list[int]) -> None:
        """Fill ``prompt_logprobs`` of the ``seqs`` that ask, from their prefill's hidden states ``[B, L, H]``
        (``prompts`` ``[B, L]``, each ``lengths`` tokens long and padded past them): each token's logprob under the
        model given the tokens before it."""
        rows = [i for i, seq in enumerate(seqs) if seq.request.prompt_logprobs is not None]
        if not rows:
            return
        index = torch.tensor(rows)
        logprobs = torch.log_softmax(self.model.logits(hidden[index, :-1]).float(), dim=-1)  # [R, L-1, V]
        chosen = logprobs.gather(2, prompts[index, 1:, None])  # [R, L-1, 1]
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        chosen = chosen.squeeze(2).tolist()
        k = max(seqs[i].request.prompt_logprobs for i in rows)
        best, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k else (None, None)
        for j, i in enumerate(rows):
            seq, asked, n = seqs[i], seqs[i].request.prompt_logprobs, lengths[i] - 1  # the pads' places left out
            seq.prompt_logprobs, seq.prompt_ranks = [None, *chosen[j][:n]], [None, *ranks[j][:n]]
            seq.prompt_top_logprobs = [[]] + ([list(zip(t, b)) for t, b in zip(ids[j, :n, :asked].tolist(),
                                                                                best[j, :n, :asked].tolist())]
                                              if asked else [[] for _ in range(n)])

    def stage(self, path: Path) -> dict[str, torch.Tensor]:
        """Load the safetensors of the HF directory ``path`` into a state of this model: every name and shape is
        checked."""
        return self.stage_tensors(read_hf_tensors(Path(path)))

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-layout ``tensors`` as a state of this model (the model's own conversion): every name and shape is
        checked."""
        return self.model.state_dict_from_hf(tensors)

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap weights between two steps; running sequences continue under ``version``.

        The staged tensors become the live ones (no copy), so the engine stands still only for the swap. A state
        of the module's parameters, all of them or some (an adapter on a frozen base, already checked by
        ``state_dict_from_hf``), is swapped tensor by tensor: the pause is that of the tensors, not of a walk of the
        whole module.
        """
        if state.keys() <= self._tensors.keys():  # each tensor swapped in place (a module walk costs more)
            for name, tensor in state.items():
                self._tensors[name].data = tensor
        else:  # names beyond the parameters (a tied head's, buffers): the module places them
            self.model.load_state_dict(state, assign=True)
            self._tensors = dict(self.model.named_parameters())
        self.version = version

    def _sample(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """One token per sequence from ``hidden`` ``[B, H]`` (after the logits processors), recorded with its logprob
        and this version; a sequence whose row cannot be sampled fails alone (:meth:`_fail`)."""
        if not seqs:
            return
        logits = process_logits(self.model.logits(hidden).float(), seqs)
        for seq, drawn in zip(seqs, sample_rows(logits, seqs)):
            if isinstance(drawn, str):
                self._fail(seq, drawn)
                continue
            token, logprob, top = drawn
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            if seq.request.top_logprobs:
                seq.top_logprobs.append(top)


PREFILL_PADDING = 1.5
"""A prefill forward takes prompts of several lengths while its tokens, every prompt right-padded to the longest,
stay within this factor of the prompts' own: each forward costs a fixed dispatch of the whole model besides its
tokens (on a CPU, as much as its compute for short prompts), so fewer forwards outweigh a few pads."""


def prefill_batches(seqs: list[Sequence]) -> list[list[Sequence]]:
    """``seqs`` in the batches of one prefill forward each: by prompt length, shortest first, each batch taking
    the next longer prompt while its padded tokens (its rows x its longest prompt) stay within
    :data:`PREFILL_PADDING` x its prompts' own tokens."""
    batches: list[list[Sequence]] = []
    tokens = 0
    for seq in sorted(seqs, key=lambda s: len(s.request.prompt_ids)):
        length = len(seq.request.prompt_ids)
        if batches and (len(batches[-1]) + 1) * length <= PREFILL_PADDING * (tokens + length):
            batches[-1].append(seq)
            tokens += length
        else:
            batches.append([seq])
            tokens = length
    return batches


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, float, list] | str]:
    """:func:`sample` with each row's own failure as a message in its place: a row of ``logits`` ``[B, V]`` holding
    NaN or +inf (or nothing but -inf), or a row the sampler fails on (found by sampling the rows one at a time once
    the batch failed), never stops the other rows."""
    broken = ~logits.amax(-1).isfinite()  # a row's max is NaN if any entry is, +inf if any is, -inf if all are
    out: list = [None] * len(seqs)
    rows = list(range(len(seqs)))
    if bool(broken.any()):
        for row in broken.nonzero().flatten().tolist():
            out[row] = f"the model's logits are not finite (NaN or inf) at completion token {len(seqs[row].token_ids)}"
        rows = [row for row in rows if out[row] is None]
    if not rows:
        return out
    block = logits if len(rows) == len(seqs) else logits[rows]
    try:
        drawn = sample(block, [seqs[row] for row in rows])
    except Exception:  # one row's fault (non-finite probabilities after temperature...): find it
        drawn = []
        for i, row in enumerate(rows):
            try:
                drawn.extend(sample(block[i : i + 1], [seqs[row]]))
            except Exception as exc:  # noqa: BLE001 - the sampler's error is this sequence's
                drawn.append(f"sampling failed at completion token {len(seqs[row].token_ids)}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    for row, result in zip(rows, drawn):
        out[row] = result
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """One token for each row of ``logits`` ``[B, V]`` (float32) under the settings of ``seqs[b]``:
    ``(token, logprob, top)``, ``top`` the ``top_logprobs`` most likely ``(token, logprob)`` (empty when not asked).

    The logprob is under the distribution the token was drawn from: after temperature, and after top_k/top_p
    (renormalised over the tokens they keep) when those are set; greedy (temperature 0) takes the argmax and
    the untempered logprob. Rows with the same settings are computed together; a seeded sequence draws from
    its own generator, one row at a time, so its tokens do not depend on what else is in the batch.
    """
    groups: dict[tuple[float, int, float], list[int]] = {}
    for row, seq in enumerate(seqs):
        request = seq.request
        key = (request.temperature, request.top_k, request.top_p) if request.temperature else (0.0, 0, 1.0)
        groups.setdefault(key, []).append(row)
    tokens = torch.empty(len(seqs), dtype=torch.long)
    chosen = torch.empty(len(seqs))
    tops: dict[int, list[tuple[int, float]]] = {}
    for (temperature, top_k, top_p), rows in groups.items():
        index = torch.tensor(rows) if len(rows) < len(seqs) else None
        block = logits if index is None else logits.index_select(0, index)
        if temperature == 0:
            logprobs = torch.log_softmax(block, dim=-1)
            picked = block.argmax(-1)
        else:
            logprobs = torch.log_softmax(_truncate(block / temperature, top_k, top_p), dim=-1)
            probs = logprobs.exp()
            seeded = [i for i, row in enumerate(rows) if seqs[row].generator is not None]
            picked = draw(probs) if len(seeded) < len(rows) else tokens.new_empty(len(rows))
            for i in seeded:
                picked[i] = torch.multinomial(probs[i], 1, generator=seqs[rows[i]].generator)[0]
        values = logprobs.gather(1, picked[:, None]).squeeze(1)
        if index is None:
            tokens, chosen = picked, values
        else:
            tokens.index_copy_(0, index, picked)
            chosen.index_copy_(0, index, values)
        asked = [(i, seqs[row].request.top_logprobs) for i, row in enumerate(rows) if seqs[row].request.top_logprobs]
        if asked:
            best, ids = logprobs.topk(min(max(k for _, k in asked), logprobs.shape[-1]), dim=-1)
            for i, k in asked:
                tops[rows[i]] = list(zip(ids[i, :k].tolist(), best[i, :k].tolist()))
    return [(token, logprob, tops.get(row, [])) for row, (token, logprob)
            in enumerate(zip(tokens.tolist(), chosen.tolist()))]


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` drawn from it, by the inverse CDF: a uniform draw (from
    ``generator``, else torch's default one) scaled to the row's total, the first token whose cumulative probability
    exceeds it (so never a token of probability 0).
    ``torch.multinomial`` draws from the same distribution at several times the cost on a CPU (0.64 ms against 0.05
    for 128 rows of the quickstart's 260 tokens; 204 against 31 ms for 64 rows of 152k).

    :raises ValueError: a row whose probabilities are not finite or sum to 0 (the caller fails that row alone).
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if not bool(((total > 0) & total.isfinite()).all()):
        raise ValueError("the probabilities are not finite or sum to 0")
    drawn = torch.searchsorted(cdf, torch.rand(total.shape, generator=generator) * total, right=True).squeeze(1)
    past = drawn == probs.shape[-1]  # a draw that rounded up to the total: the last token of non-zero probability
    if bool(past.any()):
        drawn = torch.where(past, probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1), drawn)
    return drawn


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` ``[B, V]`` after vLLM's logits processors, for the rows whose request sets one (the others are
    left as they are): ``logit_bias`` added; ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: ``count *
    frequency + (count > 0) * presence`` subtracted, counting the completion's tokens); ``repetition_penalty``
    (divides a positive logit, multiplies a negative one, of every token in the prompt or the completion); the
    stop tokens masked to -inf while a completion is shorter than ``min_tokens``. Each is one set of tensor ops
    over those rows."""
    rows = [i for i, seq in enumerate(seqs) if seq.request.processes_logits]
    if not rows:
        return logits
    requests = [seqs[i].request for i in rows]
    outputs = [seqs[i].token_ids for i in rows]
    index = torch.tensor(rows)
    block = logits.index_select(0, index)
    vocab = logits.shape[-1]
    if any(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0 for r in requests):
        counts = _token_counts(outputs, vocab)  # [R, V]
        frequency = torch.tensor([r.frequency_penalty for r in requests])[:, None]
        presence = torch.tensor([r.presence_penalty for r in requests])[:, None]
        block = block - counts * frequency - (counts > 0) * presence
        repetition = torch.tensor([r.repetition_penalty for r in requests])[:, None]
        if (repetition != 1.0).any():
            seen = (counts + _token_counts([r.prompt_ids for r in requests], vocab)) > 0
            block = torch.where(seen, torch.where(block > 0, block / repetition, block * repetition), block)
            big = torch.finfo(block.dtype).max  # a penalty near 0 (below float32's least, it is 0) overflows
            block = block.clamp(-big, big)
    biased = [(j, token, value) for j, r in enumerate(requests) for token, value in (r.logit_bias or {}).items()]
    if biased:
        at, tokens, values = zip(*biased)
        block = block.index_put((torch.tensor(at), torch.tensor(tokens)), torch.tensor(values), accumulate=True)
    early = [(j, token) for j, r in enumerate(requests) if len(outputs[j]) < r.min_tokens
             for token in r.stop_token_ids if token < vocab]
    if early:
        at, tokens = zip(*early)
        block = block.index_put((torch.tensor(at), torch.tensor(tokens)), torch.tensor(-math.inf))
    return logits.index_copy(0, index, block)


def _token_counts(sequences: list[list[int]], vocab: int) -> torch.Tensor:
    """``[len(sequences), vocab]`` float: how often each token occurs in each sequence (one scatter)."""
    longest = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), longest), vocab, dtype=torch.long)  # pads count in a column cut off below
    for j, s in enumerate(sequences):
        ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab + 1)
    return counts.scatter_add_(1, ids, torch.ones(ids.shape))[:, :vocab]


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[B, V]`` with, in each row, every token outside the ``top_k`` most likely and outside the
    smallest set whose probability reaches ``top_p`` set to -inf (the most likely token always stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        drop = before >= top_p
        drop[..., 0] = False  # the most likely token stays, whatever top_p rounds to in float32 (1e-46 is 0)
        logits = logits.masked_fill(torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, drop), -math.inf)
    return logits
