"""``tiny-moe``: a small Qwen3-MoE policy written in plain torch, trainable on a laptop CPU.

The defaults keep a forward+backward on 2 CPU cores fast while still using
head_dim 64 (vLLM's CPU attention rejects head_dim 16), so the same weights
can be served by the builtin server and by vLLM.
"""

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from i3core.errors import I3Error
from i3core.plugins.models import lora
from i3core.plugins.models.hf import hf_directory
from i3core.plugins.models.lora import LoraOptions
from i3core.plugins.models.tiny_moe import hf
from i3core.plugins.models.tiny_moe.modeling import TinyMoEModel
from i3core.plugins.models.tiny_moe.tokenizer import EOS, IM_END, IM_START, VOCAB_SIZE, build_tokenizer, token_id
from i3core.weights import read_hf_tensors


class TinyMoE:
    """Builds :class:`TinyMoEModel` and converts it to and from the HF Qwen3-MoE layout; meets
    :class:`i3core.protocols.Model` (its chat template is ChatML)."""

    prefix_trees = True
    """Its training forward masks prefix trees (i3core.packed): one prompt's completions share it."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        hidden_size: int = Field(128, ge=8, description="Residual stream width H.")
        num_layers: int = Field(2, ge=1, description="Transformer blocks.")
        num_heads: int = Field(2, ge=1, description="Query heads.")
        num_kv_heads: int = Field(1, ge=1, description="Key/value heads (grouped-query attention).")
        head_dim: int = Field(64, ge=2, description="Per-head width; vLLM's CPU attention needs 64 or more.")
        num_experts: int = Field(8, ge=1, description="Experts per MoE layer E.")
        experts_per_token: int = Field(2, ge=1, description="Top-k experts per token.")
        moe_intermediate_size: int = Field(128, ge=1, description="Expert SwiGLU width I.")
        norm_topk_prob: bool = Field(True, description="Renormalise the top-k router weights to sum to 1.")
        rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
        rope_theta: float = Field(10000.0, gt=0, description="Rotary embedding base.")
        max_position_embeddings: int = Field(2048, ge=1, description="Longest sample in tokens.")
        tie_word_embeddings: bool = Field(False, description="Share the embedding and LM head weights.")
        init_std: float = Field(0.02, gt=0, description="Std of the normal weight initialisation.")
        expert_backend: Literal["grouped_mm", "loop"] = Field(
            "grouped_mm", description="torch._grouped_mm over stacked experts, or a per-expert loop (reference)."
        )
        init_from: Path | None = Field(None, description="An HF directory (save_hf output) to start from.")
        lora: LoraOptions | None = Field(
            None, description="[model.lora]: train a LoRA adapter on the frozen base `init_from` (\"all-linear\": the "
                              "attention projections; the router is `router`); versions hold the adapter alone.")

        @field_validator("init_from")
        @classmethod
        def _directory(cls, path: Path | None) -> Path | None:
            return None if path is None else hf_directory(path)

        @model_validator(mode="after")
        def _shapes(self):
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
            if self.experts_per_token > self.num_experts:
                raise ValueError(
                    f"experts_per_token ({self.experts_per_token}) must not exceed num_experts ({self.num_experts})"
                )
            if self.head_dim % 2:
                raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
            if self.lora is not None and self.init_from is None:
                raise ValueError("[model.lora] trains an adapter on a base every server loads: set init_from (the "
                                 "base's HF directory)")
            return self

    def __init__(self, config: Config):
        self.config = config

    def build(self, seed: int = 0) -> TinyMoEModel:
        """A new model: from ``init_from`` when set, else initialised from ``seed``; with ``lora``, a new adapter
        (from ``seed``) on the frozen ``init_from``."""
        if self.config.lora is not None:
            return self._with_adapter(self.load_hf(self.config.init_from), self._peft_config(), seed)
        if self.config.init_from is not None:
            return self.load_hf(self.config.init_from)
        model = TinyMoEModel(self.config, VOCAB_SIZE)
        model.reset_parameters(seed)
        return model

    @staticmethod
    def parallelize(model: TinyMoEModel, *, world: int, checkpoint: bool, seq_len: int) -> None:
        """Activation checkpointing per block when ``checkpoint``; FSDP2 on every block and the root when
        ``world > 1`` (``seq_len`` does not matter here)."""
        model.activation_checkpointing = checkpoint
        if world > 1:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)

    def tokenizer(self):
        return build_tokenizer()

    @staticmethod
    def render_chat(messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template the saved tokenizer carries (``tokenizer.CHAT_TEMPLATE``), in Python: ChatML (``<|im_start|>role\ncontent<|im_end|>\n`` per message, then the assistant's turn opened), with
        Qwen's tool format: ``tools`` as JSON lines in a ``<tools>`` block of the system message, an assistant's
        ``tool_calls`` as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after its content, and
        each tool result as a turn of role ``tool``."""
        if tools:
            offer = "# Tools\n<tools>\n" + "\n".join(json.dumps(t, sort_keys=True) for t in tools) + "\n</tools>\n" \
                'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
            if messages and messages[0]["role"] == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{offer}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": offer}, *messages]
        turns = []
        for m in messages:
            content = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                arguments = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                content += (f'{chr(10) if content else ""}<tool_call>{{"name": {json.dumps(fn["name"])}, '
                            f'"arguments": {arguments or "{}"}}}</tool_call>')
            turns.append(f"{IM_START}{m['role']}\n{content}{IM_END}\n")
        return "".join(turns) + f"{IM_START}assistant\n"

    @property
    def eos_token_id(self) -> int:
        """``<|endoftext|>``: where a plain (non-chat) completion stops, the quickstart's included. The saved HF
        files name ``<|im_end|>`` as the tokenizer's eos and both in ``generation_config.json``
        (:func:`hf.generation_config`): a chat completion stops at either, as :attr:`end_of_turn_ids` plus this."""
        return token_id(EOS)

    @property
    def eos_token_ids(self) -> list[int]:
        """Where every completion stops by default: ``generation_config.json``'s eos tokens, ``<|im_end|>`` and
        ``<|endoftext|>`` (vLLM, serving the saved directory, stops at both)."""
        return list(hf.generation_config()["eos_token_id"])

    @property
    def end_of_turn_ids(self) -> list[int]:
        return [token_id(IM_END)]

    def save_hf(self, model: TinyMoEModel, path: str | Path) -> Path:
        """Write ``model`` as an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads; with an adapter,
        the adapter directory alone (PEFT's files, names of the HF Qwen3-MoE)."""
        if model.adapter is not None:
            return lora.save_adapter(dict(self.hf_tensors(model)), model.adapter, self.config.init_from, Path(path))
        return hf.save_hf(model, path)

    @staticmethod
    def hf_tensors(model: TinyMoEModel):
        """``(hf_name, tensor)`` layer by layer in the HF layout (experts unstacked); collective when sharded. With an
        adapter, its tensors alone, named as in PEFT's files."""
        if model.adapter is not None:
            return lora.named_file_tensors(model, hf._full, hf.ADAPTER_NAMES)
        return hf.iter_hf_tensors(model)

    def base_identity(self) -> dict | None:
        """With ``lora``: the base ``init_from`` every checkpoint of the adapter belongs to (path and hash)."""
        return lora.base_identity(self.config.init_from) if self.config.lora is not None else None

    def _peft_config(self):
        options = self.config.lora
        if options.target_modules == "all-linear":  # PEFT's rule needs a transformers model: the same, by name
            options = options.model_copy(update={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
        return options.peft_config()

    @staticmethod
    def _with_adapter(model: TinyMoEModel, config, seed: int) -> TinyMoEModel:
        try:
            lora.inject(model, config, seed)
        except (ValueError, TypeError) as exc:
            raise I3Error(f"model tiny-moe: [model.lora]: {str(exc).strip().splitlines()[0]}") from None
        model.adapter = config
        return model

    @staticmethod
    def train_flops(model: TinyMoEModel, position_ids: torch.Tensor, real: torch.Tensor) -> float:
        """Model FLOPs of one training step (forward + backward = 3 x forward) over the ``real`` tokens.

        Forward per token: 2 x the active matrix parameters (attention projections,
        router, the top-k experts' SwiGLU, the LM head; the embedding is a lookup)
        plus attention itself, 4 x heads x head_dim x context (QK^T and AV), with a
        token's context its position + 1 inside its packed sample.
        """
        cfg = model.cfg
        hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = hidden * q + 2 * hidden * kv + q * hidden + hidden * cfg.num_experts
        per_layer += cfg.experts_per_token * 3 * hidden * cfg.moe_intermediate_size
        matrix = cfg.num_layers * per_layer + hidden * model.vocab_size
        tokens = int(real.sum())
        context = float((position_ids[real] + 1).sum())
        forward = 2 * matrix * tokens + 4 * cfg.num_layers * q * context
        return 3 * forward

    def load_hf(self, path: str | Path) -> TinyMoEModel:
        """Read an HF directory back into the stacked layout (this component's backend kept); an adapter directory
        goes on the base ``init_from``."""
        if lora.is_adapter_dir(Path(path)):
            if self.config.init_from is None:
                raise I3Error(f"model tiny-moe: {path} is an adapter: set init_from (its base's HF directory)")
            try:
                model = self._with_adapter(self.load_hf(self.config.init_from), lora.read_config(Path(path)), 0)
                model.load_state_dict(model.state_dict_from_hf(read_hf_tensors(Path(path))), strict=False)
            except ValueError as exc:
                raise I3Error(f"model tiny-moe: adapter {path}: {exc}") from None
            return model
        hf_cfg, tensors = hf.read_hf(path)
        fields = {**hf.config_fields_from_hf(hf_cfg), "expert_backend": self.config.expert_backend}
        model = TinyMoEModel(self.Config(**fields), hf_cfg["vocab_size"])
        hf.load_hf_tensors(model, tensors)
        return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
