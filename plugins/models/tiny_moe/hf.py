"""Conversion between the trainer's stacked-expert layout and the Hugging Face Qwen3-MoE layout.

HF stores one ``gate_proj``/``up_proj``/``down_proj`` Linear per expert
(weights ``[out, in]``); the trainer stacks them as ``gate_up [E, H, 2I]`` and
``down [E, I, H]`` for grouped GEMMs. :func:`iter_hf_tensors` yields the HF
tensors one layer at a time, so a weight push never holds a second copy of the
whole model.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from i3core.plugins.models.tiny_moe.modeling import TinyMoEModel
from i3core.plugins.models.tiny_moe.tokenizer import EOS, PAD, build_tokenizer, save_tokenizer, token_id

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


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
        "eos_token_id": token_id(EOS),
        "pad_token_id": token_id(PAD),
        "torch_dtype": "float32",
    }


def config_fields_from_hf(hf: dict) -> dict:
    """The tiny-moe Config fields stored in an HF ``config.json``."""
    return {
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        "num_experts": hf["num_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": hf["norm_topk_prob"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "rope_theta": hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0)),
        "max_position_embeddings": hf["max_position_embeddings"],
        "tie_word_embeddings": hf["tie_word_embeddings"],
        "init_std": hf.get("initializer_range", 0.02),
    }


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: an FSDP2 shard (DTensor) is gathered, a plain one is a view."""
    full = getattr(param, "full_tensor", None)
    return (full() if callable(full) else param).detach()


def iter_hf_tensors(model: TinyMoEModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` in HF layout: embeddings, then layer by layer, then norm and head.

    On an FSDP2-sharded model every rank must iterate in step: each parameter is
    gathered when its turn comes, so no rank holds more than one layer unsharded.
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
        gate_up, down = _full(block.moe.gate_up), _full(block.moe.down)
        for e in range(gate_up.shape[0]):
            yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate_up[e, :, :inter].T.contiguous()
            yield f"{prefix}.mlp.experts.{e}.up_proj.weight", gate_up[e, :, inter:].T.contiguous()
            yield f"{prefix}.mlp.experts.{e}.down_proj.weight", down[e].T.contiguous()
    yield "model.norm.weight", _full(model.norm.weight)
    if not model.cfg.tie_word_embeddings:
        yield "lm_head.weight", _full(model.lm_head.weight)


@torch.no_grad()
def load_hf_tensors(model: TinyMoEModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-layout ``tensors`` into ``model`` (stacking the experts); every weight must be present.

    :raises ValueError: a missing, unexpected or wrongly shaped tensor, before anything is copied.
    """
    expected = {name: t.shape for name, t in iter_hf_tensors(model)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != tuple(expected[n]))
    if missing or unexpected or wrong:
        raise ValueError(
            f"HF weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {wrong[:3]}"
        )
    model.embed.weight.copy_(tensors["model.embed_tokens.weight"])
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}"
        block.input_norm.weight.copy_(tensors[f"{prefix}.input_layernorm.weight"])
        for name in _ATTN:
            getattr(block.attn, name).weight.copy_(tensors[f"{prefix}.self_attn.{name}.weight"])
        block.post_attn_norm.weight.copy_(tensors[f"{prefix}.post_attention_layernorm.weight"])
        block.moe.router.weight.copy_(tensors[f"{prefix}.mlp.gate.weight"])
        for e in range(block.moe.experts):
            expert = f"{prefix}.mlp.experts.{e}"
            gate, up = tensors[f"{expert}.gate_proj.weight"], tensors[f"{expert}.up_proj.weight"]
            block.moe.gate_up[e].copy_(torch.cat([gate.T, up.T], dim=1))
            block.moe.down[e].copy_(tensors[f"{expert}.down_proj.weight"].T)
    model.norm.weight.copy_(tensors["model.norm.weight"])
    if not model.cfg.tie_word_embeddings:
        model.lm_head.weight.copy_(tensors["lm_head.weight"])


def save_hf(model: TinyMoEModel, path: str | Path) -> Path:
    """Write ``config.json``, ``model.safetensors`` (HF per-expert layout) and the tokenizer to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
    tensors = {name: t.to(torch.float32).contiguous() for name, t in iter_hf_tensors(model)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(build_tokenizer(), path)
    return path


def read_hf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json as a dict, HF tensors)`` of a saved directory."""
    path = Path(path)
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
