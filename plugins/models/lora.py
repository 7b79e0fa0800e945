"""LoRA adapters on a frozen base, built with PEFT: what ``[model.lora]`` trains, checkpoints and publishes.

A model component with ``lora`` set injects PEFT's LoRA layers into its module right after loading the base
(before any FSDP2 wrapping): the base's parameters are frozen, only the adapter's ``lora_A``/``lora_B`` are
trainable, so the optimizer, the checkpoints and every published version hold the adapter alone.

On disk a version is an adapter directory as PEFT's ``save_pretrained`` writes it (``adapter_config.json``,
``adapter_model.safetensors`` with names ``base_model.model.<module>.lora_A.weight``), loadable by
``PeftModel.from_pretrained`` and by vLLM's LoRA loader as it is. In memory PEFT names the adapter
(``<module>.lora_A.default.weight``); :func:`file_name` and :func:`memory_name` convert.

This module may import torch, peft and :mod:`i3core`'s core; the model components of this kind import it.
"""

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from i3core.weights import write_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"
"""PEFT's name of the one adapter a module carries."""
_FILE_PREFIX = "base_model.model."
"""What PEFT's ``save_pretrained`` puts before a module name (the PeftModel's wrapper and its base)."""
_MEMORY = re.compile(rf"\.(lora_[A-Za-z_]+)\.{ADAPTER}(\.|$)")
_FILE = re.compile(r"\.(lora_[A-Za-z_]+)(\.|$)")
_HASH_CHUNK = 1 << 22


class LoraOptions(BaseModel):
    """``[model.lora]``: a low-rank adapter ``W + (alpha / rank) B A`` on the target layers; the base is frozen."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, description="r: the inner width of B A.")
    alpha: float = Field(32.0, gt=0, description="The adapter's output is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description='Module names (suffixes, PEFT\'s rule) that get an adapter, or "all-linear": every '
                                  "linear layer but the LM head (and, on a MoE, PEFT's expert parameters).")
    init: Literal["default", "gaussian"] = Field(
        "default", description="A's initialisation (B starts at 0, so the adapted model starts as the base): "
                               "Kaiming-uniform (default) or gaussian 1/r. Initialisations that rewrite the base "
                               "(PiSSA, OLoRA) are not offered: the base must stay the one every server holds.")

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules,
                          init_lora_weights=True if self.init == "default" else "gaussian")


def inject(module: nn.Module, config, seed: int = 0) -> nn.Module:
    """Put the adapter of PEFT ``config`` (a ``LoraConfig``) into ``module`` in place, initialised from ``seed``
    (every trainer rank builds the same one), and freeze everything else."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, module, adapter_name=ADAPTER)
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name))
    return module


def is_adapter(name: str) -> bool:
    """Whether the in-memory ``name`` is a tensor of the adapter."""
    return _MEMORY.search(name) is not None


Rename = tuple[Callable[[str], str], Callable[[str], str]]
"""A module's tensor names to the HF architecture's and back (a model whose modules are not transformers')."""
SAME: Rename = (str, str)


def file_name(name: str, rename: Rename = SAME) -> str:
    """The in-memory adapter tensor ``name`` as PEFT's files hold it (``rename``: the module's names to HF's)."""
    return _FILE_PREFIX + _MEMORY.sub(r".\1\2", rename[0](name))


def memory_name(name: str, rename: Rename = SAME) -> str:
    """Inverse of :func:`file_name`."""
    return rename[1](_FILE.sub(rf".\1.{ADAPTER}\2", name.removeprefix(_FILE_PREFIX)))


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors of ``module`` by in-memory name (the module's own, possibly DTensors)."""
    return {name: tensor for name, tensor in module.state_dict().items() if is_adapter(name)}


def state_from_files(module: nn.Module, tensors: dict[str, torch.Tensor],
                     rename: Rename = SAME) -> dict[str, torch.Tensor]:
    """The adapter tensors ``tensors`` (named as in PEFT's files) as ``module``'s in-memory state, in its dtype.

    :raises ValueError: a missing, unexpected or wrongly shaped tensor (the first of each kind named).
    """
    own = adapter_state(module)
    given = {memory_name(name, rename): name for name in tensors}
    state = {memory: tensors[name] for memory, name in given.items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(n for n in set(own) & set(state) if own[n].shape != state[n].shape)
    problems = []
    if missing:
        problems.append(f"missing {file_name(missing[0], rename)}" + (f" (+{len(missing) - 1} more)"
                                                                     if len(missing) > 1 else ""))
    if unexpected:
        problems.append(f"unexpected {given[unexpected[0]]}"
                        + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    if wrong:
        problems.append(f"wrong shape {file_name(wrong[0], rename)}: {tuple(state[wrong[0]].shape)} where the "
                        f"adapter has {tuple(own[wrong[0]].shape)}")
    if problems:
        raise ValueError("the adapter does not fit the model: " + "; ".join(problems))
    return {name: state[name].to(own[name].dtype) for name in own}


def save_adapter(tensors: dict[str, torch.Tensor], config, base: Path, path: Path) -> Path:
    """Write an adapter directory PEFT and vLLM load: ``adapter_config.json`` (``config``, a ``LoraConfig``, with
    ``base`` as its base model) and ``adapter_model.safetensors`` (``tensors`` named as in the files)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config.__class__(**{**config.to_dict(), "base_model_name_or_path": str(base)})
    config.save_pretrained(str(path))
    write_safetensors(tensors, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return path


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_config(path: Path):
    """The ``LoraConfig`` of the adapter directory ``path``.

    :raises ValueError: no readable adapter_config.json, or one of another PEFT method than LoRA.
    """
    from peft import LoraConfig

    file = Path(path) / ADAPTER_CONFIG
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: cannot read it ({exc})") from None
    if data.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {data.get('peft_type')!r}, not a LoRA adapter")
    return LoraConfig.from_pretrained(str(path))


def base_identity(path: Path) -> dict:
    """What names a base model: its directory and a SHA-256 over its config and weights (file names and bytes)."""
    path = Path(path).resolve()
    digest = hashlib.sha256()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return {"path": str(path), "sha256": digest.hexdigest()}


def named_file_tensors(module: nn.Module, full, rename: Rename = SAME) -> Iterator[tuple[str, torch.Tensor]]:
    """``(file name, whole tensor)`` of the adapter in module order (``full`` gathers an FSDP2 shard: every rank
    iterates in step)."""
    for name, tensor in adapter_state(module).items():
        yield file_name(name, rename), full(tensor)
