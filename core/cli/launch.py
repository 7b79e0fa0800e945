"""``i3core launch --dry-run``: render the cluster launch files of a run from its plugins.toml.

The templates live in the source tree's ``deploy/`` (``deploy/slurm/*.sbatch.tmpl``,
``deploy/k8s/*.yaml.tmpl``); ``{{name}}`` placeholders are filled from the config
and the command-line sizes, and a placeholder without a value is an error, never
left in the output. Every role runs a command that exists: ``torchrun -m
i3core.loop.trainer``, ``i3core inference``, ``i3core orchestrator``
(:mod:`i3core.loop.roles`). Nothing is submitted: the output goes to stdout or a folder
for ``sbatch`` / ``kubectl apply -f``.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from i3core.config import RunConfig
from i3core.errors import I3Error
from i3core.loop.roles import starts_servers

TARGETS = {"slurm": ("slurm", ".sbatch.tmpl"), "k8s": ("k8s", ".yaml.tmpl")}
"""Target -> (folder under deploy/, template suffix)."""
K8S_ORDER = ("config", "trainer", "inference", "orchestrator")
"""The shared ConfigMap and volume first, then the roles."""
K8S_RUNS = "/runs"
"""Where every pod mounts the shared volume; the run's output_dir goes under it."""
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class Sizes:
    """What the config does not say: how many machines of which kind."""

    trainer_nodes: int = 1
    inference_nodes: int | None = None
    """Default: ``[inference] servers``."""
    gpus_per_node: int = 8
    gpu_partition: str = "gpu"
    cpu_partition: str = "cpu"
    orchestrator_cpus: int = 16
    image: str = "i3core:latest"
    namespace: str = "default"
    storage: str = "100Gi"
    inference_port: int = 8000
    rdzv_port: int = 29500


def default_templates() -> Path:
    """``deploy/`` of the source tree this package runs from (an editable install or a checkout)."""
    return Path(__file__).resolve().parents[2] / "deploy"  # core/cli/launch.py -> the source tree


def render(template: str, values: dict[str, object], where: str = "template") -> str:
    """Fill every ``{{name}}``; :raises I3Error: a placeholder without a value."""
    missing = sorted({m for m in _PLACEHOLDER.findall(template) if m not in values})
    if missing:
        raise I3Error(f"{where}: no value for {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def launch_files(config: RunConfig, config_path: Path, target: str, sizes: Sizes,
                 templates: Path | None = None) -> dict[str, str]:
    """The rendered files of ``target``, by file name, in the order to apply them.

    :raises I3Error: a config the roles cannot run apart, or templates that are not there.
    """
    problems = _unlaunchable(config)
    if problems:
        raise I3Error("cannot launch the roles separately: " + "; ".join(problems))
    folder, suffix = TARGETS[target]
    root = (templates or default_templates()) / folder
    paths = sorted(root.glob(f"*{suffix}"))
    if not paths:
        raise I3Error(f"no {target} templates (*{suffix}) in {root}: pass --templates DEPLOY_DIR")
    if target == "k8s":
        rank = {name: i for i, name in enumerate(K8S_ORDER)}
        paths.sort(key=lambda p: rank.get(p.name.removesuffix(suffix), len(rank)))
    values = _values(config, config_path, target, sizes)
    return {p.name.removesuffix(".tmpl"): render(p.read_text(), values, str(p)) for p in paths}


def _unlaunchable(config: RunConfig) -> list[str]:
    problems = [f"no [{s}] section" for s in ("model", "inference", "env") if config.get(s) is None]
    inference = config.get("inference")
    if inference is not None and not starts_servers(inference):
        problems.append(f'inference {inference.name!r} starts no servers to put on nodes (it runs inside the '
                        'orchestrator): set [inference] use = "builtin" or "vllm", with servers = N')
    sync = config.get("weight_sync")
    if sync is not None and sync.name != "filesystem":
        problems.append(f'weight_sync {sync.name!r} works only under `i3core run` (use "filesystem")')
    return problems


def _values(config: RunConfig, config_path: Path, target: str, sizes: Sizes) -> dict[str, object]:
    name = re.sub(r"[^a-z0-9-]+", "-", config.run.name.lower()).strip("-") or "run"
    inference_nodes = sizes.inference_nodes or config.option("inference", "servers", 1)
    values: dict[str, object] = {
        **{k: getattr(sizes, k) for k in Sizes.__dataclass_fields__},
        "name": name,
        "inference_nodes": inference_nodes,
        "inference": config.get("inference").name,
        "config": config_path.resolve(),
        "output_dir": config.run.out.resolve(),
        "workdir": Path.cwd(),
    }
    if target == "k8s":
        data = config.to_dict()
        data["run"]["output_dir"] = f"{K8S_RUNS}/{name}"
        text = json.dumps(data, indent=2)
        values["config_text"] = "\n".join("    " + line for line in text.splitlines())
        urls = [f"http://{name}-inference-{i}.{name}-inference:{sizes.inference_port}" for i in range(inference_nodes)]
        values["server_urls"] = json.dumps(urls)
    return values


def write(files: dict[str, str], out: Path | None) -> list[Path]:
    """Print the files (YAML documents joined by ``---``) or write them under ``out``; the sbatch is executable."""
    if out is None:
        print("---\n".join(text if text.endswith("\n") else text + "\n" for text in files.values()), end="")
        return []
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name.endswith(".sbatch"):
            path.chmod(0o755)
        written.append(path)
    return written
