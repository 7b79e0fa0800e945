"""The interfaces each component kind meets; nothing else.

A component is built as ``cls(config)`` from its registered class; these are
the methods the core calls on it afterwards.
"""

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from i3core.types import Completion, Example, ExecResult, LossInputs, LossOutput, Rollout


@runtime_checkable
class Loss(Protocol):
    def __call__(self, inputs: LossInputs) -> LossOutput:
        """The scalar loss over the packed tokens ``[T]`` and its metrics."""


@runtime_checkable
class Optimizer(Protocol):
    def build(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        """A torch optimizer over plain or FSDP2-sharded (DTensor) parameters."""


@runtime_checkable
class InferenceClient(Protocol):
    """One inference server, as an env sees it. Tokens in, tokens out: a multi-turn env keeps
    the token ids it was given and sends them back with ``complete_ids``, never re-tokenising."""

    tokenizer: Any
    """Encodes env text: ``tokenizer.encode(text).ids`` (``tokenizers``) or ``encode(text)`` (transformers). A
    tokenizer that also has ``render_chat(messages, tools)`` and ``end_of_turn_ids`` (a :class:`Model`'s, see
    :meth:`Model.tokenizer`) carries the model's chat template: chat envs render with it and stop there."""

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float) -> Completion:
        """Generate one completion of a text prompt with the client's default stops (as :meth:`complete_ids`);
        every token carries its logprob and policy version."""

    async def complete_ids(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                           stop_token_ids: list[int] | None = None, stop: list[str] | None = None) -> Completion:
        """Generate one completion of a token-id prompt, stopping at ``stop_token_ids`` or at the ``stop``
        strings, matched on the text (None: the client's defaults, the model's end ids and the env's stop text).
        The token that ended it is the last of ``token_ids``; ``text`` is
        :func:`i3core.text.completion_text` of them (that token left out, cut before a stop string)."""


@runtime_checkable
class Environment(Protocol):
    def examples(self) -> list[Example]:
        """The environment's dataset, in a seeded order."""

    async def rollout(self, client: InferenceClient, example: Example) -> Rollout:
        """Drive one rollout of ``example`` through ``client`` and score it."""


@runtime_checkable
class Scheduler(Protocol):
    """What the orchestrator asks its scheduler; ``step`` is the next batch to cut."""

    group_size: int
    groups_per_batch: int
    rollout_slots: int
    weight_update_lag: int

    def may_start_group(self, step: int, served_version: int, open_groups: int) -> bool:
        """Whether a new prompt group may start now (``open_groups``: started, not yet trained or dropped)."""

    def may_cut(self, step: int, served_version: int) -> bool:
        """Whether the batch of ``step`` may be handed to the trainer while the servers hold ``served_version``."""

    def is_stale(self, oldest_version: int, step: int) -> bool:
        """Whether a group whose oldest token is ``oldest_version`` is dropped instead of trained at ``step``."""


@runtime_checkable
class WeightReceiver(Protocol):
    """A server's end of a weight sync that delivers versions other than as a directory (a broadcast)."""

    def wait_round(self) -> int:
        """Block until the trainer announces its next version; that version (nothing is received yet)."""

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The next version and its whole set of HF-layout tensors on the CPU, once all of it is in."""


@runtime_checkable
class WeightSync(Protocol):
    """Moves each policy version from the trainer to the servers; ``root`` is the run's ``broadcasts/``.

    Versions on disk follow :mod:`i3core.weights` (a directory per version, STABLE marker, reader leases).
    """

    def publish(self, root: Path, weights) -> None:
        """Publish a :class:`~i3core.loop.trainer.PublishedWeights`; every trainer rank calls it."""

    def is_ready(self, root: Path, version: int) -> bool:
        """Whether ``version`` has reached the servers' side (the orchestrator then tells them to load it)."""

    def location(self, root: Path, version: int) -> Path | None:
        """The directory a server loads ``version`` from, or None when the transport delivers it."""

    def receiver(self, root: Path) -> dict | None:
        """What each server needs to receive weights other than from a path (JSON, with ``transport``: this
        component's registered name), or None."""

    @staticmethod
    def connect(spec: dict, rank: int) -> WeightReceiver:
        """In a server process: the receiving end described by ``spec`` (from :meth:`receiver`) as ``rank``
        (1..S); servers reach it through :func:`i3core.weights.connect_receiver`, never by import."""


@runtime_checkable
class MetricSink(Protocol):
    def open(self, output_dir: Path) -> None:
        """Start writing under the run's output directory."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Record one trainer step's metrics. A sink may also have ``write_rollouts(step, lines)``: the step's
        rollouts as :mod:`i3core.loop.rollouts` writes them (dicts, trained ones first), called just before
        ``write`` for the same step (e.g. the wandb sink's sample table)."""

    def close(self) -> None:
        """Flush and release; called once, also after a failure."""


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run model-written code, with a private work directory.

    Paths given to ``write_file``/``read_file`` are relative to the work
    directory (which is also each command's working directory); anything that
    leaves it, directly or through a symlink, raises
    :class:`~i3core.errors.SandboxFileError`. A failure of the sandbox itself
    raises :class:`~i3core.errors.SandboxError`; a failing command does not.
    """

    id: str

    async def exec(self, cmd: str | Sequence[str], timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` (an argv list, or a string for ``/bin/sh -c``) in the work directory.

        ``timeout`` in seconds (None: the backend's default); on expiry every
        process the command started is killed and ``timed_out`` is set.
        """

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace ``path`` (str is written as UTF-8); parent directories are made."""

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path``, at most the backend's ``max_file_bytes``."""

    async def reset(self) -> None:
        """Kill every process of the sandbox and empty its work directory, for reuse by another rollout."""

    async def alive(self) -> bool:
        """Whether the sandbox still works (cheap; the pool polls it during a rollout)."""

    async def close(self) -> None:
        """Kill every process the sandbox started and free it; idempotent."""

    async def __aenter__(self) -> "Sandbox": ...

    async def __aexit__(self, *exc_info) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes sandboxes; the ``[sandbox]`` component."""

    async def create(self) -> Sandbox:
        """A new, started sandbox; raises :class:`~i3core.errors.SandboxError` if it cannot start."""

    async def aclose(self) -> None:
        """Close every sandbox this backend made that is still open, and release the backend."""


# -- models ------------------------------------------------------------------------------------------------------
# Shapes: R packed rows of S tokens, H hidden size, V vocabulary; B sequences of a decode step.


@runtime_checkable
class CausalLM(Protocol):
    """The ``torch.nn.Module`` a :class:`Model` builds: a causal LM whose LM head stands apart.

    ``forward`` stops at the final norm so the trainer can apply :meth:`logits` a chunk of tokens at a time
    (a batch's ``[R, S, V]`` float32 logits never exist at once).
    """

    vocab_size: int

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[R, S, H]`` of packed rows ``input_ids`` ``[R, S]`` (int64).

        ``position_ids`` ``[R, S]`` restart at 0 where each sample of a row starts; a token attends only to
        earlier tokens of its own sample, so a sample's outputs do not depend on what is packed beside it.
        """

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: ``[..., H]`` -> ``[..., V]``."""

    def new_kv_cache(self, slots: int, max_len: int) -> Any:
        """An empty KV cache for :meth:`forward_cached`: ``slots`` sequences of up to ``max_len`` tokens each.

        Optional: a cache with ``copy_slots(source [B], target [B], length)`` (entries ``0..length-1`` of slots
        ``source`` copied into slots ``target``) lets the builtin engine prefill a prompt once for all the
        sequences that share it (a group's completions); without it each is prefilled.
        """

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                       slots: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, S, H]`` of new tokens ``input_ids`` ``[B, S]`` of the sequences held in cache
        ``slots`` ``[B]`` at ``positions`` ``[B, S]``; their keys and values are written into the cache, and
        token ``(b, s)`` attends to entries ``0..positions[b, s]`` of its own slot. A prefill passes one
        prompt or several of the same length ``S`` (``B >= 1``, positions ``0..S-1`` each; the builtin engine pads
        shorter prompts at their end, so the entries a slot holds past its sequence's position are left for its
        own later tokens to write over before they read them); a decode step one token of every running sequence
        (``S = 1``). Run under
        ``torch.no_grad``; the outputs equal :meth:`forward`'s for the same tokens.
        """

    def state_dict_from_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's ``state_dict`` holding the HF-layout ``tensors`` (the inverse of
        :meth:`Model.hf_tensors`), for ``load_state_dict(..., assign=True)``; the module is untouched.

        :raises ValueError: a missing, unexpected or wrongly shaped tensor.
        """


@runtime_checkable
class Model(Protocol):
    """The ``[model]`` component: what the trainer, the weight sync and the builtin server call on a model.

    Trainer: :meth:`build`, :meth:`parallelize`, :meth:`train_flops`, :meth:`tokenizer` (SFT). Weight sync:
    :meth:`hf_tensors`, :meth:`save_hf`. Builtin server: :meth:`load_hf`, :meth:`tokenizer`,
    :meth:`render_chat`, :attr:`eos_token_id`, :attr:`end_of_turn_ids`, and the
    module's cached decode
    (:class:`CausalLM`). A model served only by vLLM may leave the builtin server's part out; the builtin
    server then refuses it with one line.

    Optional: a ``prefix_trees = True`` attribute says the model's training forward masks attention as
    :func:`i3core.packed.attention_mask` does (prefix trees as well as packed samples); the orchestrator then
    packs the completions of one prompt as a tree (``[trainer] share_prompts``). Without it, samples are packed
    side by side.

    Optional: ``eos_token_ids``, every end-of-sequence token (generation_config's ``eos_token_id``, all of them,
    and the tokenizer's), where every completion stops by default as vLLM stops it (:func:`i3core.text.end_ids`);
    a model without it stops at :attr:`eos_token_id` alone.

    Optional, for a model that trains an adapter on a frozen base (``hf``'s ``[model.lora]``): its module's frozen
    parameters have ``requires_grad`` off, so the trainer's optimizer, checkpoints and versions hold the trainable
    tensors alone; ``base_identity()`` (``{"path", "sha256"}``) is saved with each checkpoint and a resume onto
    another base is refused; :meth:`save_hf` and :meth:`hf_tensors` give the adapter (PEFT's directory and
    names) and ``state_dict_from_hf`` turns those back into a state of the adapter's tensors alone, which the
    builtin engine swaps in without touching the base; ``save_merged(adapter_dir, path)`` writes the base with
    the adapter merged (``i3core export --merge``).
    """

    def build(self, seed: int = 0) -> CausalLM:
        """A new model for training, initialised from ``seed`` (or from the component's own checkpoint)."""

    def parallelize(self, model: CausalLM, *, world: int, checkpoint: bool, seq_len: int) -> None:
        """Prepare ``model`` in place for ``world`` trainer ranks: FSDP2 on every decoder layer and the root when
        ``world > 1``; activation checkpointing per layer when ``checkpoint``; ``seq_len`` is the packed row."""

    def train_flops(self, model: CausalLM, position_ids: torch.Tensor, real: torch.Tensor) -> float:
        """Model FLOPs of one training step (forward and backward) over the tokens where ``real`` ``[R, S]``
        (bool) is set, with their ``position_ids`` ``[R, S]`` (attention's cost grows with the context)."""

    def hf_tensors(self, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` in the Hugging Face layout, layer by layer; on an FSDP2-sharded model every rank
        iterates in step (each tensor is gathered when its turn comes)."""

    def save_hf(self, model: CausalLM, path: Path) -> Path:
        """Write ``model`` as a directory that ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` load (config.json, safetensors, the tokenizer and its chat template)."""

    def load_hf(self, path: Path) -> CausalLM:
        """A model holding the weights of the HF directory ``path`` (what :meth:`save_hf` wrote)."""

    def tokenizer(self) -> Any:
        """The model's tokenizer, a ``tokenizers.Tokenizer`` (or an object that delegates to one): ``encode(text).ids``,
        ``decode(ids, skip_special_tokens=...)``, ``get_vocab_size()``. One that also has :meth:`render_chat` and
        :attr:`end_of_turn_ids` hands the model's chat template to the envs (a bare ``tokenizers.Tokenizer`` gets
        ChatML)."""

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of OpenAI-style ``messages`` in the model's chat template, with the assistant's turn
        opened for generation. Each message has ``role`` and ``content`` (a string; may be empty on an
        assistant turn with ``tool_calls``, OpenAI's ``[{"id", "type": "function", "function": {"name",
        "arguments"}}]``); a ``tool`` message has ``tool_call_id``. ``tools``: OpenAI function specs offered to
        the model. A call the model writes is read back as ``<tool_call>{"name", "arguments"}</tool_call>``
        (the Hermes/Qwen format)."""

    @property
    def eos_token_id(self) -> int:
        """The end-of-sequence token: where a plain completion stops by default."""

    @property
    def end_of_turn_ids(self) -> list[int]:
        """The tokens that close an assistant turn of the chat template: where a chat completion stops."""
