"""Conversion between the trainer's stacked-expert layout and the Hugging Face Qwen3-MoE layout.

HF stores one ``gate_proj``/``up_proj``/``down_proj`` Linear per expert
(weights ``[out, in]``); the trainer stacks them as ``gate_up [E, H, 2I]`` and
``down [E, I, H]`` for grouped GEMMs. :func:`iter_hf_tensors` yields the HF
tensors one layer at a time, so a weight push never holds a second copy of the
whole model.

Reading takes both layouts a Qwen3-MoE directory may hold: per-expert tensors
(what this module and transformers' ``save_pretrained`` write) and transformers
v5's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj
[E, H, I]``; and both config spellings of the expert count (``num_experts``,
v5's ``num_local_experts``).
"""

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from i3core.plugins.models.tiny_moe.modeling import TinyMoEModel
from i3core.plugins.models.tiny_moe.tokenizer import EOS, IM_END, PAD, build_tokenizer, token_id, tokenizer_files
from i3core.weights import read_hf_tensors, write_safetensors

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MODULE_TO_HF = ((re.compile(r"^blocks\.(\d+)\.attn\."), r"model.layers.\1.self_attn."),
                 (re.compile(r"^blocks\.(\d+)\.moe\.router\."), r"model.layers.\1.mlp.gate."))
_HF_TO_MODULE = ((re.compile(r"^model\.layers\.(\d+)\.self_attn\."), r"blocks.\1.attn."),
                 (re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\."), r"blocks.\1.moe.router."))


def _renamer(rules):
    def rename(name: str) -> str:
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        return name

    return rename


ADAPTER_NAMES = (_renamer(_MODULE_TO_HF), _renamer(_HF_TO_MODULE))
"""An adapter's tensor names: this model's modules to the HF Qwen3-MoE's, and back (attention and router)."""


def hf_config(model: TinyMoEModel) -> dict:
    """The ``config.json`` of ``model`` (model_type ``qwen3_moe``)."""
    cfg = model.cfg
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": cfg.init_std,
        "bos_token_id": token_id(EOS),
        "eos_token_id": token_id(IM_END),
        "pad_token_id": token_id(PAD),
        "torch_dtype": "float32",
    }


def generation_config() -> dict:
    """``generation_config.json``: generation ends at the end of a turn or of the text (as Qwen3's chat models
    say it: ``<|im_end|>`` first, then ``<|endoftext|>``)."""
    return {"bos_token_id": token_id(EOS), "eos_token_id": [token_id(IM_END), token_id(EOS)],
            "pad_token_id": token_id(PAD)}


HF_DEFAULTS = {"num_key_value_heads": None, "norm_topk_prob": False, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 32768, "tie_word_embeddings": False, "initializer_range": 0.02,
               "decoder_sparse_step": 1, "mlp_only_layers": []}
"""transformers' ``Qwen3MoeConfig`` defaults for the keys a ``config.json`` may leave out (``num_key_value_heads``:
as many as the query heads)."""


def config_fields_from_hf(hf: dict) -> dict:
    """The tiny-moe Config fields stored in an HF Qwen3-MoE ``config.json`` (this module's or transformers').

    :raises ValueError: not a Qwen3-MoE config, or one with dense (non-MoE) layers, which tiny-moe lacks.
    """
    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"model_type {hf.get('model_type')!r} is not qwen3_moe")
    hf = {**HF_DEFAULTS, **hf}
    if hf["mlp_only_layers"] or hf["decoder_sparse_step"] != 1:
        raise ValueError("tiny-moe has an MoE MLP in every layer: mlp_only_layers must be empty and "
                         "decoder_sparse_step 1")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json has neither num_experts nor num_local_experts")
    rope = hf.get("rope_parameters") or {}
    return {
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"] or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "num_experts": experts,
        "experts_per_token": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": hf["norm_topk_prob"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "max_position_embeddings": hf["max_position_embeddings"],
        "tie_word_embeddings": hf["tie_word_embeddings"],
        "init_std": hf["initializer_range"],
    }


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: an FSDP2 shard (DTensor) is gathered, a plain one is a view."""
    full = getattr(param, "full_tensor", None)
    return (full() if callable(full) else param).detach()


def iter_hf_tensors(model: TinyMoEModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` in HF layout: embeddings, then layer by layer, then norm and head.

    On an FSDP2-sharded model every rank must iterate in step: each parameter is
    gathered when its turn comes, so no rank holds more than one layer unsharded.
    A layer's experts are views of one transposed copy of its stack (contiguous each, sharing that copy's storage).
    """
    yield "model.embed_tokens.weight", _full(model.embed.weight)
    inter = model.cfg.moe_intermediate_size
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", _full(block.input_norm.weight)
        for name in _ATTN:
            yield f"{prefix}.self_attn.{name}.weight", _full(getattr(block.attn, name).weight)
        yield f"{prefix}.post_attention_layernorm.weight", _full(block.post_attn_norm.weight)
        yield f"{prefix}.mlp.gate.weight", _full(block.moe.router.weight)
        # one transposing copy per stack: [E, 2I, H] and [E, H, I], whose per-expert slices are contiguous already
        gate_up = _full(block.moe.gate_up).transpose(1, 2).contiguous()
        down = _full(block.moe.down).transpose(1, 2).contiguous()
        for e in range(gate_up.shape[0]):
            yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate_up[e, :inter]
            yield f"{prefix}.mlp.experts.{e}.up_proj.weight", gate_up[e, inter:]
            yield f"{prefix}.mlp.experts.{e}.down_proj.weight", down[e]
    yield "model.norm.weight", _full(model.norm.weight)
    if not model.cfg.tie_word_embeddings:
        yield "lm_head.weight", _full(model.lm_head.weight)


@torch.no_grad()
def load_hf_tensors(model: TinyMoEModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-layout ``tensors`` into ``model`` (stacking the experts); every weight must be present.

    :raises ValueError: a missing, unexpected or wrongly shaped tensor, before anything is copied.
    """
    model.load_state_dict(hf_state_dict(model, tensors))


def hf_shapes(model: TinyMoEModel) -> dict[str, tuple[int, ...]]:
    """The HF-layout name and shape of every weight of ``model`` (read from its parameters: nothing is gathered)."""
    inter, hidden = model.cfg.moe_intermediate_size, model.cfg.hidden_size
    shapes = {"model.embed_tokens.weight": tuple(model.embed.weight.shape)}
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = tuple(block.input_norm.weight.shape)
        for name in _ATTN:
            shapes[f"{prefix}.self_attn.{name}.weight"] = tuple(getattr(block.attn, name).weight.shape)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = tuple(block.post_attn_norm.weight.shape)
        shapes[f"{prefix}.mlp.gate.weight"] = tuple(block.moe.router.weight.shape)
        for e in range(block.moe.experts):
            expert = f"{prefix}.mlp.experts.{e}"
            shapes[f"{expert}.gate_proj.weight"] = shapes[f"{expert}.up_proj.weight"] = (inter, hidden)
            shapes[f"{expert}.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = tuple(model.norm.weight.shape)
    if not model.cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = tuple(model.lm_head.weight.shape)
    return shapes


def _check(model: TinyMoEModel, tensors: dict[str, torch.Tensor]) -> None:
    """:raises ValueError: a missing, unexpected or wrongly shaped tensor."""
    expected = hf_shapes(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
    if missing or unexpected or wrong:
        raise ValueError(
            f"HF weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {wrong[:3]}"
        )


def hf_state_dict(model: TinyMoEModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-layout ``tensors`` as a state dict of ``model``'s shape (experts stacked), built without a model: what
    the builtin engine swaps in for each version. Checked as :func:`load_hf_tensors` checks.

    :raises ValueError: a missing, unexpected or wrongly shaped tensor.
    """
    tensors = per_expert(tensors)
    _check(model, tensors)
    dtype = model.embed.weight.dtype
    state = {"embed.weight": tensors["model.embed_tokens.weight"]}
    for i, block in enumerate(model.blocks):
        prefix, name = f"model.layers.{i}", f"blocks.{i}"
        state[f"{name}.input_norm.weight"] = tensors[f"{prefix}.input_layernorm.weight"]
        for proj in _ATTN:
            state[f"{name}.attn.{proj}.weight"] = tensors[f"{prefix}.self_attn.{proj}.weight"]
        state[f"{name}.post_attn_norm.weight"] = tensors[f"{prefix}.post_attention_layernorm.weight"]
        state[f"{name}.moe.router.weight"] = tensors[f"{prefix}.mlp.gate.weight"]
        experts = [f"{prefix}.mlp.experts.{e}" for e in range(block.moe.experts)]
        state[f"{name}.moe.gate_up"] = torch.stack([
            torch.cat([tensors[f"{x}.gate_proj.weight"].T, tensors[f"{x}.up_proj.weight"].T], dim=1) for x in experts])
        state[f"{name}.moe.down"] = torch.stack([tensors[f"{x}.down_proj.weight"].T for x in experts])
    state["norm.weight"] = tensors["model.norm.weight"]
    state["lm_head.weight"] = state["embed.weight"] if model.cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return {key: value.to(dtype).contiguous() for key, value in state.items()}


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with transformers v5's fused experts (``{layer}.mlp.experts.gate_up_proj [E, 2I, H]``, gate
    rows first, and ``{layer}.mlp.experts.down_proj [E, H, I]``) split into per-expert tensors (views); other
    tensors as they are."""
    out = {}
    for name, tensor in tensors.items():
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and last in ("gate_up_proj", "down_proj") and tensor.dim() == 3:
            if last == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
            else:
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def save_hf(model: TinyMoEModel, path: str | Path) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (HF per-expert layout) and the
    tokenizer to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
    for name, text in _fixed_files().items():
        (path / name).write_text(text)
    tensors = {name: t.to(torch.float32) for name, t in iter_hf_tensors(model)}
    write_safetensors(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@functools.cache
def _fixed_files() -> dict[str, str]:
    """The files every version holds the same: generation_config.json and the tokenizer's (built once, as every
    step's publish writes them)."""
    return {"generation_config.json": json.dumps(generation_config(), indent=2) + "\n",
            **tokenizer_files(build_tokenizer())}


def read_hf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json as a dict, HF tensors)`` of a saved directory (one safetensors file or shards)."""
    path = Path(path)
    return json.loads((path / "config.json").read_text()), read_hf_tensors(path)
