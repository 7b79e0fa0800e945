"""``torchtitan``: torchtitan 0.3.0's Qwen3-MoE and DeepSeek-V3 models, parallelized by torchtitan, for GPU training.

What comes from torchtitan (extra ``titan``; imported only when this component is used):

- the model spec: ``torchtitan.models.qwen3.model_registry`` / ``torchtitan.models.deepseek_v3.model_registry``
  return a ``ModelSpec`` whose ``model`` is the flavor's ``Decoder.Config`` tree, built with ``config.build()``;
- ``ModelSpec.parallelize_fn`` (``parallelize_qwen3`` / ``parallelize_deepseekv3``): activation checkpointing
  (``FullAC`` / ``SelectiveAC`` from ``torchtitan.distributed.activation_checkpoint``) and FSDP2 over a
  ``ParallelDims`` mesh of every rank (data-parallel sharding only: no TP, PP, CP or EP here);
- ``ModelSpec.state_dict_adapter`` (``Qwen3StateDictAdapter`` / ``DeepSeekV3StateDictAdapter``): ``to_hf`` for
  weight pushes (grouped experts split per expert) and ``from_hf`` for ``init_from``.

How it differs from torchtitan's own trainer: i3core's trainer drives the step (its loss plugin, its chunked
log-softmax over ``logits``), so the decoder runs with ``_skip_lm_head`` and returns hidden states; packed rows
get torchtitan's per-document block-causal mask from ``position_ids`` (they restart at 0 per sample, as
torchtitan's dataloaders emit them). The model is materialised on the GPU before it is sharded.

torchtitan's models do not train on CPU (flex attention has no CPU backward), so on a machine without CUDA the
component refuses with one line naming ``tiny-moe``. Everything else (the spec, a model on any device, the
state-dict adapter, ``save_hf``) is plain functions here and runs on CPU.
"""

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from i3core.errors import I3Error, did_you_mean
from i3core.plugins.models.hf import hf_directory
from i3core.weights import write_safetensors

FAMILIES = {"qwen3": "torchtitan.models.qwen3", "deepseek_v3": "torchtitan.models.deepseek_v3"}
"""Model family -> the torchtitan package whose ``model_registry(flavor, ...)`` gives its ``ModelSpec``."""
FLAVOR_TABLES = {"qwen3": "qwen3_configs", "deepseek_v3": "deepseekv3_configs"}
INSTALL_HINT = "pip install 'i3core[titan]'"
CPU_REFUSAL = ("model torchtitan needs a CUDA GPU (torchtitan's flex attention has no CPU backward); "
               "on CPU use [model] use = \"tiny-moe\"")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def torchtitan_module(name: str):
    """Import ``name`` from the ``titan`` extra, or a one-line :class:`I3Error` saying how to install it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in ("torchtitan", "triton", "tyro", "spmd_types"):
            raise I3Error(f"model torchtitan needs torchtitan 0.3.0 ({missing} is missing): {INSTALL_HINT}") from None
        raise


def flavors(family: str) -> list[str]:
    """torchtitan's named flavors of ``family`` that are mixture-of-experts models."""
    table = getattr(torchtitan_module(FAMILIES[family]), FLAVOR_TABLES[family])
    return [name for name in table if any(layer.moe is not None for layer in _flavor_config(family, name).layers)]


class TitanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: Literal["qwen3", "deepseek_v3"] = Field("qwen3", description="torchtitan model family.")
    flavor: str = Field("debugmodel_moe", description="torchtitan's named flavor of the family (an MoE one).")
    n_layers: int | None = Field(None, ge=1, description="Keep only the flavor's first N transformer blocks.")
    vocab_size: int | None = Field(
        None, ge=1, description="Vocabulary rows of the embedding and LM head (default: the tokenizer's).")
    attn_backend: Literal["flex", "varlen"] = Field("flex", description="torchtitan attention backend.")
    activation_checkpointing: Literal["selective", "full"] = Field(
        "selective", description="torchtitan's AC policy, applied when trainer.activation_memory = \"checkpoint\".")
    param_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="FSDP2 mixed precision: the dtype parameters are gathered and computed in.")
    tokenizer: Path | None = Field(
        None, description="An HF tokenizer directory (tokenizer.json); default: i3core's byte-level tokenizer.")
    init_from: Path | None = Field(None, description="An HF checkpoint directory to start from (via from_hf).")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_directory(cls, path: Path | None) -> Path | None:
        if path is not None and not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json (not a Hugging Face tokenizer directory)")
        return None if path is None else path.resolve()

    @field_validator("init_from")
    @classmethod
    def _checkpoint_directory(cls, path: Path | None) -> Path | None:
        """An HF directory with its weights, checked when the config is (the GPU that loads it may be far off)."""
        if path is None:
            return None
        path = hf_directory(path)
        if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
            raise ValueError(f"{path} has no model.safetensors (nor its index): no weights to start from")
        return path

    @model_validator(mode="after")
    def _flavor(self):
        known = flavors(self.family)
        if self.flavor not in known:
            raise ValueError(f"unknown {self.family} flavor {self.flavor!r}{did_you_mean(self.flavor, known)}; "
                             f"MoE flavors: {', '.join(known)}")
        layers = _flavor_config(self.family, self.flavor, self.attn_backend).layers
        if self.n_layers is not None and self.n_layers > len(layers):
            raise ValueError(f"n_layers ({self.n_layers}) exceeds the {len(layers)} layers of {self.flavor}")
        if all(layer.moe is None for layer in layers[: self.n_layers]):
            raise ValueError(f"n_layers ({self.n_layers}) keeps only dense layers of {self.flavor}: "
                             "keep at least one MoE layer")
        return self


# -- spec and model (any device) ---------------------------------------------


def _flavor_config(family: str, flavor: str, attn_backend: str = "flex"):
    """The flavor's ``Decoder.Config`` tree, as its torchtitan config function builds it."""
    kwargs = {"attn_backend": attn_backend}
    if family == "deepseek_v3":
        kwargs["moe_comm_backend"] = "standard"
    return getattr(torchtitan_module(FAMILIES[family]), FLAVOR_TABLES[family])[flavor](**kwargs)


def model_spec(cfg: TitanConfig, vocab_size: int):
    """torchtitan's ``ModelSpec`` for ``cfg`` with its model config resized (layers kept, ``vocab_size``)."""
    spec = torchtitan_module(FAMILIES[cfg.family]).model_registry(cfg.flavor, attn_backend=cfg.attn_backend)
    model = spec.model
    if cfg.n_layers is not None:
        model.layers = model.layers[: cfg.n_layers]
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise I3Error(f"model.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's {vocab_size} tokens")
    vocab = cfg.vocab_size or vocab_size
    model.vocab_size = vocab
    model.tok_embeddings.num_embeddings = vocab
    model.lm_head.out_features = vocab
    return spec


class TitanPolicy(nn.Module):
    """A torchtitan ``Decoder`` behind the trainer's model interface.

    ``forward(input_ids [B, S], position_ids [B, S]) -> hidden [B, S, H]`` on the model's device (inputs are
    moved there); ``logits(hidden) -> [.., V]``. ``position_ids`` restart at 0 at each packed sample, which
    is what torchtitan's block-causal document mask is built from.
    """

    def __init__(self, decoder: nn.Module, spec):
        super().__init__()
        self.decoder = decoder
        self.spec = spec
        decoder._skip_lm_head = True

    @property
    def cfg(self):
        return self.decoder.config

    @property
    def vocab_size(self) -> int:
        return self.decoder.config.vocab_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        device = self.decoder.norm.weight.device
        input_ids = input_ids.to(device)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=device).expand_as(input_ids)
        position_ids = position_ids.to(device)
        masks = self.decoder.get_attention_masks(position_ids)
        return self.decoder(input_ids, position_ids, masks)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(hidden)


def build_model(cfg: TitanConfig, vocab_size: int, device: torch.device | str, seed: int = 0) -> TitanPolicy:
    """The model on ``device``: built on meta, materialised there, then ``init_from`` loaded or seeded init."""
    spec = model_spec(cfg, vocab_size)
    with torch.device("meta"):
        decoder = spec.model.build()
    decoder.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        decoder.init_states(buffer_device=torch.device(device))
    policy = TitanPolicy(decoder, spec)
    if cfg.init_from is not None:
        load_hf_dir(policy, cfg.init_from)
    return policy


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


# -- HF layout (torchtitan's state-dict adapter) -------------------------------


def _adapter(model: TitanPolicy):
    return model.spec.state_dict_adapter(model.cfg, None)


def _full(value: torch.Tensor) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)
    return (full() if callable(full) else value).detach()


def _groups(state: dict[str, torch.Tensor]) -> Iterator[list[str]]:
    """State-dict keys in order, one group per transformer block (``layers.N.``) and one per other key."""
    group, layer = [], None
    for key in state:
        this = key.split(".")[1] if key.startswith("layers.") else None
        if group and (this is None or this != layer):
            yield group
            group = []
        group.append(key)
        layer = this
    if group:
        yield group


def hf_model_type(model: TitanPolicy) -> str:
    """The transformers architecture that computes what ``model`` computes.

    DeepSeek flavors whose router scores with a softmax (``debugmodel``, ``16B``, ``236B``: the DeepSeek-V2
    design) are ``deepseek_v2``; transformers' ``deepseek_v3`` always scores with a sigmoid (``671B``).
    """
    if model.spec.name == "qwen3":
        return "qwen3_moe"
    router = next(layer.moe.router for layer in model.cfg.layers if layer.moe is not None)
    return "deepseek_v3" if router.score_func == "sigmoid" else "deepseek_v2"


def iter_hf_tensors(model: TitanPolicy) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` through torchtitan's ``to_hf``, one block at a time (experts split per expert).

    On an FSDP2-sharded model each block's parameters are gathered when its turn comes, so every rank must
    iterate in step and no rank holds more than one block unsharded. ``deepseek_v2`` has no router bias
    (``e_score_correction_bias``): it is left out there (i3core never updates it; it stays 0).
    """
    adapter = _adapter(model)
    drop_bias = hf_model_type(model) == "deepseek_v2"
    state = model.decoder.state_dict()
    for keys in _groups(state):
        part = {key: _full(state[key]) for key in keys}
        for name, tensor in adapter.to_hf(part).items():
            if not (drop_bias and name.endswith("e_score_correction_bias")):
                yield name, tensor


def hf_config(model: TitanPolicy, eos_token_id: int | None) -> dict:
    """``config.json`` of ``model`` for transformers (:func:`hf_model_type`)."""
    cfg = model.cfg
    layers = cfg.layers
    moe_layer = next(layer for layer in layers if layer.moe is not None)
    moe, attn = moe_layer.moe, moe_layer.attention
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(layers),
        "num_attention_heads": attn.n_heads,
        "rms_norm_eps": cfg.norm.eps,
        "max_position_embeddings": attn.rope.max_seq_len,
        "tie_word_embeddings": cfg.enable_weight_tying,
        "hidden_act": "silu",
        "attention_bias": False,
        "num_experts_per_tok": moe.router.top_k,
        "norm_topk_prob": moe.router.route_norm,
        "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    if model.spec.name == "qwen3":
        return {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_key_value_heads": attn.n_kv_heads,
            "head_dim": attn.head_dim,
            "intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
            "num_experts": moe.num_experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": attn.rope.theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": attn.rope.theta},
            "use_sliding_window": False,
            "sliding_window": None,
        }
    dense = [layer for layer in layers if layer.moe is None]
    rope = attn.rope
    scaling = None
    if rope.scaling == "yarn":
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": rope.rope_factor, "beta_fast": rope.beta_fast,
                   "beta_slow": rope.beta_slow, "original_max_position_embeddings": rope.original_seq_len,
                   "mscale": attn.mscale, "mscale_all_dim": attn.mscale}
    shared = moe.shared_experts
    model_type = hf_model_type(model)
    groups = moe.router.num_expert_groups
    return {
        **common,
        "architectures": ["DeepseekV3ForCausalLM" if model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": model_type,
        "num_key_value_heads": attn.n_heads,
        "intermediate_size": dense[0].feed_forward.w1.out_features if dense else common["moe_intermediate_size"],
        "first_k_dense_replace": len(dense),
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": shared.w1.out_features // common["moe_intermediate_size"] if shared else 0,
        "routed_scaling_factor": moe.router.route_scale,
        "scoring_func": moe.router.score_func,
        "topk_method": "noaux_tc" if model_type == "deepseek_v3" else "group_limited_greedy" if groups else "greedy",
        "n_group": groups or 1,
        "topk_group": moe.router.num_limited_groups or 1,
        "q_lora_rank": attn.q_lora_rank or None,
        "kv_lora_rank": attn.kv_lora_rank,
        "qk_nope_head_dim": attn.qk_nope_head_dim,
        "qk_rope_head_dim": attn.qk_rope_head_dim,
        "v_head_dim": attn.v_head_dim,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
    }


def save_hf_dir(model: TitanPolicy, path: str | Path, tokenizer_dir: Path | None) -> Path:
    """Write ``config.json``, ``model.safetensors`` (HF layout) and the tokenizer to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(torch.float32) for name, t in iter_hf_tensors(model)}
    write_safetensors(tensors, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer, eos = load_tokenizer(tokenizer_dir)
    (path / "config.json").write_text(json.dumps(hf_config(model, eos), indent=2) + "\n")
    if tokenizer_dir is None:
        from i3core.plugins.models.tiny_moe.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, path)
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copyfile(tokenizer_dir / name, path / name)
    return path


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (``model.safetensors`` or the shards its index names)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors = {}
    for shard in shards:
        if not (path / shard).exists():
            raise I3Error(f"model.init_from: {path / shard} does not exist")
        tensors.update(load_file(str(path / shard)))
    return tensors


@torch.no_grad()
def load_hf_dir(model: TitanPolicy, path: str | Path) -> None:
    """Copy an HF directory's weights into ``model`` through torchtitan's ``from_hf``; every weight must fit."""
    state = _adapter(model).from_hf(read_hf_tensors(path))
    own = model.decoder.state_dict()
    params = {name for name, _ in model.decoder.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in own if k in params and k not in state)
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(state) & set(own) if tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or wrong:
        raise I3Error(f"model.init_from {path} does not fit {model.spec.name} {model.spec.flavor}: "
                      f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")
    model.decoder.load_state_dict(state, strict=False)


def load_tokenizer(directory: Path | None):
    """``(tokenizers.Tokenizer, eos_token_id)``: from an HF tokenizer directory, or i3core's byte-level one."""
    if directory is None:
        from i3core.plugins.models.tiny_moe.tokenizer import EOS, build_tokenizer, token_id

        return build_tokenizer(), token_id(EOS)
    from tokenizers import Tokenizer

    if not (directory / "tokenizer.json").exists():
        raise I3Error(f"model.tokenizer: {directory} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    settings = directory / "tokenizer_config.json"
    eos = json.loads(settings.read_text()).get("eos_token") if settings.exists() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None or tokenizer.token_to_id(eos) is None:
        raise I3Error(f"model.tokenizer: {directory} names no eos_token that tokenizer.json knows")
    return tokenizer, tokenizer.token_to_id(eos)


# -- parallelism (torchtitan's parallelize function) ---------------------------


def parallelize_model(model: TitanPolicy, cfg: TitanConfig, world: int, checkpoint: bool, seq_len: int) -> None:
    """Apply ``ModelSpec.parallelize_fn`` to ``model.decoder`` in place: AC when ``checkpoint``, FSDP2 over
    ``world`` ranks (the default process group) with ``param_dtype`` mixed precision and float32 reductions."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if seq_len > model.cfg.max_seq_len:
        raise I3Error(f"trainer.seq_len ({seq_len}) exceeds the {model.cfg.max_seq_len} positions of "
                      f"{model.spec.name} {model.spec.flavor}'s rotary embedding")
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    training = TrainingConfig(seq_len=seq_len, mixed_precision_param=cfg.param_dtype)
    ac = None
    if checkpoint:
        ac = (FullAC if cfg.activation_checkpointing == "full" else SelectiveAC).Config()
    decoder = model.spec.parallelize_fn(model.decoder, parallel_dims=dims, training=training,
                                        parallelism=parallelism, compile_config=CompileConfig(), ac_config=ac,
                                        dump_folder="")  # fmt: skip
    model.decoder = decoder


def train_device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``, as torchrun sets it), made current; without CUDA the one-line refusal."""
    if not torch.cuda.is_available():
        raise I3Error(CPU_REFUSAL)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


class TorchTitan:
    """Model component ``torchtitan``: the interface the trainer uses (build, parallelize, HF conversion)."""

    Config = TitanConfig

    def __init__(self, config: TitanConfig):
        self.config = config  # no device here: the orchestrator (a CPU node) builds this component for its tokenizer

    def check_can_train(self) -> None:
        """``i3core run`` trains on this machine: refuse at once, before anything starts, without CUDA."""
        if not torch.cuda.is_available():
            raise I3Error(CPU_REFUSAL)

    def build(self, seed: int = 0) -> TitanPolicy:
        """The model on this rank's GPU, seeded or from ``init_from``; without CUDA, the one-line refusal."""
        return build_model(self.config, self.tokenizer().get_vocab_size(), train_device(), seed)

    def parallelize(self, model: TitanPolicy, world: int, checkpoint: bool, seq_len: int) -> None:
        """torchtitan's AC and FSDP2 on ``model`` (called by the trainer once, before the optimizer is built)."""
        parallelize_model(model, self.config, world, checkpoint, seq_len)

    def tokenizer(self):
        return load_tokenizer(self.config.tokenizer)[0]

    @property
    def eos_token_id(self) -> int:
        return load_tokenizer(self.config.tokenizer)[1]

    def save_hf(self, model: TitanPolicy, path: str | Path) -> Path:
        """Write ``model`` as an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads."""
        return save_hf_dir(model, path, self.config.tokenizer)

    @staticmethod
    def hf_tensors(model: TitanPolicy):
        """``(hf_name, tensor)`` block by block in the HF layout; collective when sharded."""
        return iter_hf_tensors(model)

    @staticmethod
    def train_flops(model: TitanPolicy, position_ids: torch.Tensor, real: torch.Tensor) -> float:
        """torchtitan's model FLOPs per token (6 x active parameters + attention, forward and backward) at
        this batch's row length, times the ``real`` tokens."""
        _, per_token = model.cfg.get_nparams_and_flops(model.decoder, position_ids.shape[-1])
        return float(per_token) * int(real.sum())
