"""``hf``: any Hugging Face causal LM in a local directory, trained and served through the Model protocol.

``[model] use = "hf"``, ``path = DIR``: a directory with ``config.json``, safetensors and the tokenizer files
(nothing is downloaded). The module is the one ``transformers.AutoModelForCausalLM`` builds for that config,
dense or MoE, wrapped in :class:`HFCausalLM` so that it meets :class:`~i3core.protocols.CausalLM`:

- training forward over packed rows: transformers' own packed-sequence masking (a sample starts where its
  ``position_ids`` restart), so samples packed side by side never attend to each other, with sdpa or eager
  attention alike;
- cached decode: :class:`SlotCache`, a ``transformers.Cache`` whose layers keep ``[slots, kv_heads, max_len,
  head_dim]`` keys and values, scatter the new ones at their positions and hand back the slots' rows; the model
  gets an explicit mask (token ``(b, s)`` sees entries ``0..positions[b, s]`` of its own slot), so rotary,
  qk-norm and attention stay the architecture's own code;
- weights in the HF layout on disk: transformers 5 may hold weights fused in memory (a MoE's experts as one
  ``[E, 2I, H]`` tensor) and converts them on save and load; :meth:`HF.hf_tensors` and
  :meth:`HFCausalLM.state_dict_from_hf` apply the same conversions, so published directories are what
  ``save_pretrained`` writes and ``from_pretrained`` (and vLLM) load.

This module may import transformers, torch and :mod:`i3core`'s core; no other plugin.
"""

import functools
import inspect
import json
import re
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from i3core.errors import I3Error
from i3core.packed import attention_mask, has_branches
from i3core.plugins.models import lora
from i3core.plugins.models.kv_cache import reserved
from i3core.plugins.models.lora import LoraOptions
from i3core.weights import read_hf_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
END_OF_TURN_PROBE = "\x00i3core-reply\x00"
"""The content of a probe assistant turn: the token the chat template writes right after it closes the turn."""


def _layer_index(name: str) -> int | None:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (DTensor; a collective), or ``tensor`` itself, detached."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach()


# -- the KV cache -------------------------------------------------------------------------------------------------


class _Step:
    """What one :meth:`HFCausalLM.forward_cached` call writes and reads: its slots ``[B]`` and positions ``[B, S]``."""

    slots: torch.Tensor
    positions: torch.Tensor
    length: int


@functools.cache
def _cache_classes():
    """``(SlotLayer, SlotCache)``, defined once transformers is imported (this module imports it lazily, so
    loading the plugin stays cheap for runs that do not use ``hf``)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        """One attention layer's keys and values, ``[slots, kv_heads, capacity, head_dim]``, allocated at the first
        write (their heads, widths and dtype are the layer's own); the capacity grows with the longest position
        written, doubling, up to ``max_len`` (:func:`~i3core.plugins.models.kv_cache.grown`)."""

        is_sliding = False

        def __init__(self, step: _Step, slots: int, max_len: int):
            super().__init__()
            self.step, self.slots, self.max_len = step, slots, max_len

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            heads = key_states.shape[1]
            self.keys = key_states.new_zeros(self.slots, heads, 0, key_states.shape[-1])
            self.values = value_states.new_zeros(self.slots, heads, 0, value_states.shape[-1])
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Write ``[B, heads, S, D]`` new keys/values at the step's positions; the slots' first ``length``."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys = reserved(self.keys, self.step.length, self.max_len)
            self.values = reserved(self.values, self.step.length, self.max_len)
            slots, positions = self.step.slots, self.step.positions
            self.keys[slots[:, None], :, positions] = key_states.transpose(1, 2)
            self.values[slots[:, None], :, positions] = value_states.transpose(1, 2)
            return self.keys[slots, :, : self.step.length], self.values[slots, :, : self.step.length]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.step.length, 0

        def get_seq_length(self) -> int:
            return self.step.length

        def get_max_length(self) -> int:
            return self.max_len

    class SlotCache(Cache):
        """Keys and values of up to ``slots`` sequences of ``max_len`` tokens, one :class:`SlotLayer` per layer."""

        def __init__(self, num_layers: int, slots: int, max_len: int):
            self.step = _Step()
            super().__init__(layers=[SlotLayer(self.step, slots, max_len) for _ in range(num_layers)])
            self.slots, self.max_len = slots, max_len

        def copy_slots(self, source: torch.Tensor, target: torch.Tensor, length: int) -> None:
            """Entries ``0..length-1`` of slots ``source`` ``[B]`` into slots ``target`` ``[B]`` (a shared prompt)."""
            for layer in self.layers:
                if layer.is_initialized:
                    for cache in (layer.keys, layer.values):
                        cache[target, :, :length] = cache[source, :, :length]

        def clear_slots(self, slots: torch.Tensor) -> None:
            """Zero every entry of ``slots`` ``[B]`` (a failed sequence may have left NaN there)."""
            for layer in self.layers:
                if layer.is_initialized:
                    for cache in (layer.keys, layer.values):
                        cache[slots] = 0

    return SlotLayer, SlotCache


def new_slot_cache(num_layers: int, slots: int, max_len: int):
    """A :class:`SlotCache` (built on first use: transformers is imported lazily)."""
    return _cache_classes()[1](num_layers, slots, max_len)


# -- the module ---------------------------------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` as a :class:`~i3core.protocols.CausalLM`.

    Its children are the transformers model's own (``model``, ``lm_head``...), so ``state_dict`` names are the
    ones transformers holds in memory; the transformers model itself is kept as :attr:`hf` (not a child).
    """

    def __init__(self, causal_lm, adapter=None):
        super().__init__()
        self.__dict__["hf"] = causal_lm
        self.adapter = adapter
        """The PEFT ``LoraConfig`` of the adapter injected into ``causal_lm`` (its base frozen), or None."""
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        self.config = causal_lm.config.get_text_config()
        self.vocab_size = self.config.vocab_size
        base = causal_lm.base_model
        self.__dict__["base"] = base
        self.__dict__["head"] = causal_lm.get_output_embeddings()
        params = inspect.signature(type(base).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        layer_types = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        self._window = "layers" if layer_types and "sliding_attention" in layer_types else None
        """How the cached decode's mask applies a sliding window: to the layers whose type says so (a mask per
        layer type), to every layer (a config with ``sliding_window`` and no layer types: Mistral, Qwen3-MoE), or
        not at all."""
        if not layer_types and window is not None:
            self._window = "all"

    def layers(self) -> nn.ModuleList:
        """The decoder layers (what FSDP2 and activation checkpointing wrap one by one)."""
        for name in ("layers", "h", "blocks"):
            found = getattr(self.base, name, None)
            if isinstance(found, nn.ModuleList):
                return found
        raise I3Error(f"model hf: cannot find the decoder layers of {type(self.hf).__name__}")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[R, S, H]`` after the final norm of packed rows; a sample starts where its positions
        restart (transformers' packed-sequence mask keeps samples apart). Rows with prefix trees (completions
        sharing their prompt, :mod:`i3core.packed`) get that layout's mask instead: transformers' would cut each
        branch off its prompt. No ``position_ids``: one sample a row."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        mask = None
        if has_branches(position_ids):
            distance = position_ids[:, None, :, None] - position_ids[:, None, None, :]
            mask = self._masks(attention_mask(position_ids), distance, input_ids.device)
        return self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                         use_cache=False).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head ``[..., H]`` -> ``[..., V]``, with the architecture's logit scale or soft cap if it has one."""
        logits = self.head(hidden)
        scale = getattr(self.config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_kv_cache(self, slots: int, max_len: int):
        return new_slot_cache(self.config.num_hidden_layers, slots, max_len)

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, slots: torch.Tensor):
        """Hidden states ``[B, S, H]`` of new tokens of the sequences in ``slots`` ``[B]`` at ``positions``
        ``[B, S]`` (any B and S); keys and values go into ``cache``."""
        step = cache.step
        step.slots, step.positions, step.length = slots, positions, int(positions.max()) + 1
        kv = torch.arange(step.length, device=positions.device)
        seen = kv[None, None, :] <= positions[:, :, None]  # [B, S, L]: its own slot, up to its own position
        mask = self._masks(seen[:, None], positions[:, None, :, None] - kv, input_ids.device)
        out = self.base(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                        **{self._cache_kwarg: cache}, use_cache=True)
        return out.last_hidden_state

    def _masks(self, allowed: torch.Tensor, distance: torch.Tensor, device) -> Any:
        """The mask(s) the layers take for ``allowed`` ``[B, 1, S, L]``, ``distance`` the query's position minus the
        key's: with the sliding window on every layer, or one mask per layer type, where the architecture has one."""
        if self._window is None:
            return self._mask(allowed, device)
        windowed = allowed & (distance < self.config.sliding_window)
        if self._window == "all":
            return self._mask(windowed, device)
        return {"full_attention": self._mask(allowed, device), "sliding_attention": self._mask(windowed, device)}

    def _mask(self, allowed: torch.Tensor, device) -> torch.Tensor:
        """``allowed`` ``[B, 1, S, L]`` as the attention implementation takes it (bool, or additive for eager)."""
        if self.config._attn_implementation == "eager":
            dtype = next(self.parameters()).dtype
            return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        return allowed

    def tied_names(self) -> set[str]:
        """State-dict names that alias another parameter (a tied LM head): HF files leave them out."""
        every = {name for name, _ in self.named_parameters(remove_duplicate=False)}
        return every - {name for name, _ in self.named_parameters()}

    def state_dict_from_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's ``state_dict`` holding HF-layout ``tensors`` (names and layout as on disk), converted
        with transformers' own load-time conversions (fused experts stacked, renamings applied).

        With an adapter, ``tensors`` are the adapter's (named as in PEFT's files) and the state holds them alone.

        :raises ValueError: a missing, unexpected or wrongly shaped tensor (the first of each kind named).
        """
        if self.adapter is not None:
            return lora.state_from_files(self, tensors)
        state = self.state_dict()
        tied = self.tied_names()
        converted, unexpected = from_hf_layout(self.hf, tensors, state)
        missing = sorted(set(state) - tied - set(converted))
        wrong = sorted(n for n in set(converted) & set(state) if tuple(converted[n].shape) != tuple(state[n].shape))
        if missing or unexpected or wrong:
            problems = []
            if missing:
                problems.append(f"missing {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
            if unexpected:
                problems.append(f"unexpected {unexpected[0]}" + (f" (+{len(unexpected) - 1} more)"
                                                                if len(unexpected) > 1 else ""))
            if wrong:
                problems.append(f"wrong shape {wrong[0]}: {tuple(converted[wrong[0]].shape)} where the model has "
                                f"{tuple(state[wrong[0]].shape)}")
            raise ValueError("HF weights do not fit the model: " + "; ".join(problems))
        dtype = {name: t.dtype for name, t in state.items()}
        out = {name: t.to(dtype[name]) for name, t in converted.items() if name in state}
        for name in tied:  # the alias gets the tensor it aliases
            source = next(n for n, p in self.named_parameters() if p is self.get_parameter(name))
            out[name] = out[source]
        return out


def from_hf_layout(causal_lm, tensors: dict[str, torch.Tensor],
                   state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(tensors in the in-memory layout, names that fit nothing)``: transformers' load-time conversion of
    ``causal_lm``'s architecture applied to on-disk ``tensors`` (what ``from_pretrained`` does, without a file)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    conversions = get_model_conversion_mapping(causal_lm, add_legacy=False)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = causal_lm.base_model_prefix
    pending: dict[str, Any] = {}
    unexpected = []
    for key, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = key, None
        if renamed not in state:
            unexpected.append(key)
            continue
        if pattern is not None:
            mapping = pending.setdefault(renamed, deepcopy(by_pattern[pattern]))
        else:
            mapping, pattern = pending.setdefault(renamed, WeightRenaming(key, renamed)), key
        mapping.add_tensor(renamed, key, pattern, tensor)
    out = {}
    for first, mapping in pending.items():
        try:  # e.g. experts of different shapes that cannot be stacked
            converted = mapping.convert(first, model=causal_lm, config=causal_lm.config)
        except (RuntimeError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"HF weights do not fit the model: {first} cannot be built from them "
                             f"({_first_line(exc)})") from None
        for name, value in converted.items():
            out[name] = value[0] if isinstance(value, list) else value
    return out, unexpected


def to_hf_layout(causal_lm, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory ``state`` (a whole layer at least) as ``save_pretrained`` writes it."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(causal_lm, state)


# -- the tokenizer as the protocol wants it ------------------------------------------------------------------------


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` (every method of it, by delegation) that also carries the model's chat template:
    :meth:`render_chat` and :attr:`end_of_turn_ids`, which multi-turn envs render with
    (:func:`i3core.plugins.envs.chat.renderer_for`)."""

    def __init__(self, backend, render_chat, end_of_turn_ids: list[int], eos_token_id: int):
        self.backend = backend
        self.render_chat = render_chat
        self.end_of_turn_ids = end_of_turn_ids
        self.eos_token_id = eos_token_id

    def __getattr__(self, name: str):
        backend = self.__dict__.get("backend")
        if backend is None:  # mid-copy or unpickling: nothing to delegate to yet
            raise AttributeError(name)
        return getattr(backend, name)


# -- the component ------------------------------------------------------------------------------------------------


def hf_directory(path: Path) -> Path:
    """A Config field that names a Hugging Face model directory (``hf``'s ``path``, ``tiny-moe``'s ``init_from``),
    checked when the config is: resolved, so every role reads the same one whatever its working directory.

    :raises ValueError: not a directory, no config.json, or one that names no ``model_type``.
    """
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} has no config.json (not a Hugging Face model directory)")
    try:
        data = json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{config} is not JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{config} names no model_type")
    return path.resolve()


class HF:
    """A transformers causal LM from a local directory; meets :class:`i3core.protocols.Model`."""

    prefix_trees = True
    """Its training forward masks prefix trees (i3core.packed): one prompt's completions share it."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: Path = Field(description="Local HF directory: config.json, safetensors, tokenizer files (the starting "
                                       "policy; nothing is downloaded).")
        dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
        attn_implementation: Literal["sdpa", "eager"] = Field(
            "sdpa", description="transformers' attention implementation (both keep packed samples apart and serve "
                                "the builtin engine's cached decode).")
        trust_remote_code: bool = Field(False, description="Run the directory's own modeling code (custom models).")
        lora: LoraOptions | None = Field(
            None, description="[model.lora]: train a LoRA adapter on the frozen base at `path` instead of every "
                              "weight; checkpoints and published versions hold the adapter alone.")

        @field_validator("path")
        @classmethod
        def _directory(cls, path: Path) -> Path:
            return hf_directory(path)

        @model_validator(mode="after")
        def _known(self):
            if self.trust_remote_code:
                return self
            from transformers import CONFIG_MAPPING

            model_type = json.loads((self.path / "config.json").read_text())["model_type"]
            if model_type not in CONFIG_MAPPING:
                raise ValueError(f"transformers knows no model_type {model_type!r} (in {self.path}/config.json); "
                                 "set trust_remote_code = true for a directory with its own modeling code")
            return self

    def __init__(self, config: Config):
        self.config = config

    # -- building ------------------------------------------------------------------------------------------------

    def _from_pretrained(self, path: Path, adapter=None, seed: int = 0) -> HFCausalLM:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # a progress bar per load and save fills the servers' and the trainer's logs

        cfg = self.config
        try:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        except (ValueError, KeyError, OSError) as exc:
            raise I3Error(f"model hf: {path}: transformers cannot read its config.json ({_first_line(exc)})") from None
        if not cfg.trust_remote_code and type(hf_config) not in AutoModelForCausalLM._model_mapping:
            raise I3Error(f"model hf: {path}: transformers has no causal LM for model_type "
                          f"{hf_config.model_type!r}")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=DTYPES[cfg.dtype],
                                                         attn_implementation=cfg.attn_implementation,
                                                         trust_remote_code=cfg.trust_remote_code)
        except (ValueError, OSError) as exc:
            raise I3Error(f"model hf: {path}: {_first_line(exc)}") from None
        if adapter is not None:  # before FSDP2 wraps anything, and before the LM head is taken apart
            try:
                lora.inject(model, adapter, seed)
            except (ValueError, TypeError) as exc:
                raise I3Error(f"model hf: [model.lora] on {path}: {_first_line(exc)}") from None
        return HFCausalLM(model, adapter)

    def build(self, seed: int = 0) -> HFCausalLM:
        """The model at ``path``: its weights are the starting policy; with ``lora``, a new adapter on it,
        initialised from ``seed``."""
        adapter = self.config.lora.peft_config() if self.config.lora is not None else None
        return self._from_pretrained(self.config.path, adapter, seed)

    def load_hf(self, path: str | Path) -> HFCausalLM:
        """The weights of the HF directory ``path`` (what :meth:`save_hf` wrote), in this component's dtype; an
        adapter directory (``adapter_config.json``) is put on this component's base (``path`` of the config)."""
        path = Path(path)
        if not lora.is_adapter_dir(path):
            return self._from_pretrained(path)
        try:
            model = self._from_pretrained(self.config.path, lora.read_config(path))
            state = model.state_dict_from_hf(read_hf_tensors(path))
        except ValueError as exc:
            raise I3Error(f"model hf: adapter {path}: {_first_line(exc)}") from None
        model.load_state_dict(state, strict=False)
        return model

    def base_identity(self) -> dict | None:
        """With ``lora``: the base every checkpoint of the adapter belongs to (its path and a hash of its files)."""
        if self.config.lora is None:
            return None
        return self._base_identity

    @functools.cached_property
    def _base_identity(self) -> dict:
        return lora.base_identity(self.config.path)

    def save_merged(self, adapter_dir: Path, path: Path) -> Path:
        """The base with the adapter of ``adapter_dir`` merged into its weights, written as a plain HF directory
        (weights, config, tokenizer) that transformers and vLLM load; the merge is PEFT's own."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.config.path, dtype=DTYPES[self.config.dtype],
                                                    trust_remote_code=self.config.trust_remote_code)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        path = Path(path)
        merged.save_pretrained(path)
        self._hf_tokenizer.save_pretrained(path)
        return path

    @staticmethod
    def parallelize(model: HFCausalLM, *, world: int, checkpoint: bool, seq_len: int) -> None:
        """Activation checkpointing per decoder layer when ``checkpoint`` (transformers' own, non-reentrant);
        FSDP2 on every decoder layer and the root when ``world > 1`` (``seq_len`` does not matter here)."""
        if checkpoint:
            kwargs = {"use_reentrant": False}
            enable = getattr(model.hf, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers():
                fully_shard(layer)
            fully_shard(model)

    @staticmethod
    def train_flops(model: HFCausalLM, position_ids: torch.Tensor, real: torch.Tensor) -> float:
        """Model FLOPs of one training step (forward + backward = 3 x forward) over the ``real`` tokens.

        Forward per token: 2 x the active matrix parameters (every matrix of the decoder layers, a fused expert
        tensor ``[E, ...]`` counted for ``num_experts_per_tok`` of its ``E`` experts, and the LM head; embeddings
        are lookups) plus attention, 4 x heads x head_dim x context, the context a token's position + 1.
        """
        cfg = model.config
        top_k = getattr(cfg, "num_experts_per_tok", None)
        matrix = 0
        for name, param in model.layers().named_parameters():
            if param.dim() == 3 and top_k:  # fused experts: only top_k of them run per token
                matrix += param.numel() * top_k // param.shape[0]
            elif param.dim() == 2:
                matrix += param.numel()
        matrix += model.head.weight.numel()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        tokens = int(real.sum())
        context = float((position_ids[real] + 1).sum())
        forward = 2 * matrix * tokens + 4 * cfg.num_hidden_layers * heads * head_dim * context
        return 3 * forward

    # -- publishing ----------------------------------------------------------------------------------------------

    @staticmethod
    def hf_tensors(model: HFCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` as ``save_pretrained`` writes them (fused experts split, tied head left out), one
        decoder layer at a time; on an FSDP2-sharded model every rank iterates in step (each layer gathered in
        turn). With an adapter, its tensors alone, named as in PEFT's files."""
        if model.adapter is not None:
            yield from lora.named_file_tensors(model, _full)
            return
        tied = model.tied_names()
        group: dict[str, torch.Tensor] = {}
        current = None
        for name, tensor in model.state_dict().items():
            if name in tied:
                continue
            layer = _layer_index(name)
            if group and layer != current:
                yield from to_hf_layout(model.hf, group).items()
                group = {}
            current = layer
            group[name] = _full(tensor)
        if group:
            yield from to_hf_layout(model.hf, group).items()

    def save_hf(self, model: HFCausalLM, path: str | Path) -> Path:
        """``save_pretrained``: config.json, generation_config.json, safetensors in the on-disk layout; then the
        tokenizer of ``path`` (its files and chat template). With an adapter: the adapter directory alone
        (``adapter_config.json``, ``adapter_model.safetensors``), as PEFT writes it."""
        path = Path(path)
        if model.adapter is not None:
            return lora.save_adapter(dict(self.hf_tensors(model)), model.adapter, self.config.path, path)
        path.mkdir(parents=True, exist_ok=True)
        model.hf.save_pretrained(path)
        self._hf_tokenizer.save_pretrained(path)
        return path

    # -- text ----------------------------------------------------------------------------------------------------

    @functools.cached_property
    def _hf_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.config.path, trust_remote_code=self.config.trust_remote_code)
        except (ValueError, OSError, TypeError) as exc:
            raise I3Error(f"model hf: {self.config.path}: no tokenizer transformers can load "
                          f"({_first_line(exc)})") from None
        if not tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False):  # transformers builds an empty one
            raise I3Error(f"model hf: {self.config.path}: the tokenizer encodes text to no tokens (no tokenizer "
                          "files there: tokenizer.json, or tokenizer_config.json with its vocabulary)")
        return tokenizer

    @functools.cached_property
    def _generation_eos(self) -> list[int]:
        file = self.config.path / "generation_config.json"
        found = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
        if found is None:
            found = json.loads((self.config.path / "config.json").read_text()).get("eos_token_id")
        return [found] if isinstance(found, int) else list(found or [])

    def tokenizer(self) -> ChatTokenizer:
        """The fast tokenizer's ``tokenizers.Tokenizer``, carrying :meth:`render_chat` and the stop tokens."""
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise I3Error(f"model hf: {self.config.path}: the tokenizer has no fast (tokenizers) version")
        ends = self.end_of_turn_ids if self._hf_tokenizer.chat_template else [self.eos_token_id]
        return ChatTokenizer(backend, self.render_chat, ends, self.eos_token_id)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """``messages`` in the directory's chat template, the assistant's turn opened for generation."""
        tok = self._hf_tokenizer
        if not tok.chat_template:
            raise I3Error(f"model hf: {self.config.path} has no chat template (tokenizer_config.json "
                          "chat_template or chat_template.jinja): chat envs and /v1/chat/completions need one")
        return tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)

    @functools.cached_property
    def eos_token_id(self) -> int:
        """generation_config's (first) eos token, else the tokenizer's."""
        ids = self._generation_eos
        if ids:
            return ids[0]
        if self._hf_tokenizer.eos_token_id is None:
            raise I3Error(f"model hf: {self.config.path} names no eos token (generation_config.json, config.json "
                          "or the tokenizer)")
        return self._hf_tokenizer.eos_token_id

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """Every end-of-sequence token: generation_config's (all of them), then the tokenizer's (where vLLM stops
        a completion of this directory)."""
        ids = [*self._generation_eos, self._hf_tokenizer.eos_token_id]
        return list(dict.fromkeys(i for i in ids if i is not None)) or [self.eos_token_id]

    @functools.cached_property
    def end_of_turn_ids(self) -> list[int]:
        """The token the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``...), then
        generation_config's eos tokens and the tokenizer's."""
        tok = self._hf_tokenizer
        ids = []
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": END_OF_TURN_PROBE}], tokenize=False)
            rest = text[text.rindex(END_OF_TURN_PROBE) + len(END_OF_TURN_PROBE):]
            specials = sorted(set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values()},
                              key=len, reverse=True)
            end = next((t for t in specials if t and rest.startswith(t)), None)
            if end is not None:
                ids.append(tok.convert_tokens_to_ids(end))
        ids += self._generation_eos
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        return list(dict.fromkeys(ids))


TOKENIZER_PROBE = "hello"
"""Text any real tokenizer encodes to at least one token: one from a directory without tokenizer files (which
transformers loads without a complaint) encodes it to none, and every prompt with it."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
