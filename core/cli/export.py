"""``i3core export RUN_DIR --step N [--merge] OUT``: a run's checkpoint as a model directory others load.

A run that trains a LoRA adapter (``[model.lora]``) exports the adapter as PEFT writes it (``adapter_config.json``,
``adapter_model.safetensors``: PEFT and vLLM load it on the base), or with ``--merge`` the base with the adapter
merged into its weights (a plain transformers directory with the tokenizer). A run that trains every weight
exports them as its versions are published (``save_hf``). The checkpoint's base is checked as ``--resume``
checks it.
"""

import tempfile
from pathlib import Path

from i3core.config import load_config, with_defaults
from i3core.errors import I3Error
from i3core.loop import checkpoint
from i3core.loop.paths import RunPaths


def export(run_dir: Path, step: int, out: Path, merge: bool = False) -> Path:
    """Write checkpoint ``step`` of the run in ``run_dir`` as a model directory ``out``; its path.

    :raises I3Error: no resolved config or complete checkpoint there, another base, ``out`` not empty.
    """
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise I3Error(f"{run_dir} is not a run directory (no config.resolved.json)")
    if out.exists() and any(out.iterdir()):
        raise I3Error(f"{out} exists and is not empty: export into a new directory")
    config = with_defaults(*load_config(resolved, []))
    if config.get("model") is None:
        raise I3Error(f"the run in {run_dir} has no [model]")
    component = config.get("model").build()
    model = component.build(seed=config.run.seed)
    checkpoint.load_model(RunPaths(run_dir).checkpoints, step, model, checkpoint.base_identity(component))
    trains_adapter = checkpoint.trained_names(model) is not None
    if merge and trains_adapter:
        if not callable(getattr(component, "save_merged", None)):
            raise I3Error(f"model {config.get('model').name!r} cannot merge its adapter (no save_merged): export "
                          "the adapter without --merge")
        with tempfile.TemporaryDirectory(prefix="i3core-export-") as adapter:
            component.save_hf(model, Path(adapter))
            return component.save_merged(Path(adapter), out)
    return component.save_hf(model, out)
