"""``i3core launch``: render the cluster launch files of a run from its plugins.toml, and submit them to Slurm.

The templates ship with the package (``i3core/templates/slurm/*.sbatch.tmpl``,
``i3core/templates/k8s/*.yaml.tmpl``, package data; ``--templates DIR`` reads another
folder of the same layout). ``{{name}}`` placeholders are filled from the config and
the command-line node shapes (:class:`Sizes`), and a placeholder without a value is
an error, never left in the output. Every role runs a command that exists: ``torchrun
-m i3core.loop.trainer``, ``i3core inference``, ``i3core orchestrator``
(:mod:`i3core.loop.roles`), each with ``--resume`` (:mod:`i3core.loop.resume`).
``--dry-run`` prints or writes the files; ``--submit`` (Slurm) writes the job script
into the run directory and hands it to ``sbatch``.
"""

import importlib.resources
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
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
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""A newline in a value would end an ``#SBATCH`` line and run the rest as a command (and break a YAML line)."""
_SLURM_NAME = re.compile(r"[\w.-]+(,[\w.-]+)*")
"""A partition (or a comma-separated list of them) or an account, as Slurm names them."""
_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")
"""sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
days-hours:minutes:seconds."""
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace: a DNS-1123 label."""
_IMAGE = re.compile(r"[\w][\w.:/@+-]*")
"""A container image reference (registry/name:tag@digest)."""
_QUANTITY = re.compile(r"\d+(\.\d+)?([KMGTPE]i?|k)?")
"""A Kubernetes storage quantity (100Gi)."""
_SHELL_UNSAFE = re.compile(r"[\s\"'$`\\#]")
"""What a path cannot hold in the job script: it goes into ``#SBATCH --chdir=`` and ``--output=`` (where
sbatch splits at blanks and quotes, and ``#`` starts a comment) and between the shell's double quotes."""


SUBMIT_TIMEOUT_S = 60.0
"""sbatch answers at once when the controller is up; a controller that does not answer fails the submission."""


@dataclass
class Sizes:
    """What the config does not say: the node shapes and the scheduler's options (every one a flag of
    ``i3core launch``)."""

    trainer_nodes: int = 1
    inference_nodes: int | None = None
    """Default: ``[inference] servers``."""
    gpus_per_node: int = 8
    """0: CPU nodes (no GPU asked for; the trainer runs ``procs_per_node`` gloo ranks a node)."""
    procs_per_node: int | None = None
    """Trainer ranks a node (torchrun ``--nproc-per-node``); default: ``gpus_per_node``, or 1 on CPU nodes."""
    partition: str = "gpu"
    cpu_partition: str = "cpu"
    orchestrator_cpus: int = 16
    time: str | None = None
    account: str | None = None
    sbatch: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options of the whole job (``--qos=high``), in order."""
    signal_grace_s: int = 120
    """SIGTERM goes to the job this long before its time limit (and on preemption): the trainer checkpoints."""
    image: str = "i3core:latest"
    namespace: str = "default"
    storage: str = "100Gi"
    inference_port: int = 8000
    rdzv_port: int = 29500
    restarts: int = 10
    """Kubernetes: how often a role's pod is restarted (the Jobs' backoffLimit) before the run fails."""


def default_templates() -> Path:
    """The templates shipped in the package (``i3core/templates``), wherever i3core is installed."""
    return Path(str(importlib.resources.files("i3core") / "templates"))


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
    problems = _bad_options(sizes, target)
    if problems:
        raise BadOption("; ".join(problems))
    folder, suffix = TARGETS[target]
    root = (templates or default_templates()) / folder
    paths = sorted(root.glob(f"*{suffix}"))
    if not paths:
        raise I3Error(f"no {target} templates (*{suffix}) in {root}: pass --templates DIR (holding {folder}/)")
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


def _bad_options(sizes: Sizes, target: str) -> list[str]:
    """What is wrong with the options the files are rendered with, each as the flag and the reason."""
    problems = [f"--{name.replace('_', '-')} {value!r} holds a control character (a newline would end its line)"
                for name, value in vars(sizes).items() if isinstance(value, str) and _CONTROL.search(value)]
    problems += [f"--sbatch {value!r} holds a control character" for value in sizes.sbatch if _CONTROL.search(value)]
    if problems:
        return problems
    formats = {"partition": (_SLURM_NAME, "a Slurm partition name (letters, digits, _ . -; several joined by ,)"),
               "cpu_partition": (_SLURM_NAME, "a Slurm partition name (letters, digits, _ . -; several joined by ,)"),
               "account": (_SLURM_NAME, "a Slurm account name (letters, digits, _ . -)"),
               "time": (_SLURM_TIME, "a Slurm time limit: minutes, minutes:seconds, hours:minutes:seconds, "
                                     "days-hours, days-hours:minutes or days-hours:minutes:seconds"),
               "image": (_IMAGE, "a container image (registry/name:tag)"),
               "namespace": (_DNS_LABEL, "a Kubernetes namespace: a DNS-1123 label (lowercase letters, digits "
                                         "and -, at most 63, starting and ending with a letter or digit)"),
               "storage": (_QUANTITY, "a Kubernetes quantity (e.g. 100Gi)")}
    for name, (pattern, what) in formats.items():
        value = getattr(sizes, name)
        if value is not None and not pattern.fullmatch(value):
            problems.append(f"--{name.replace('_', '-')} {value!r} is not {what}")
    return problems


def _slurm_path(what: str, path: Path) -> Path:
    """``path``, which the job script holds in ``#SBATCH`` lines and between double quotes.

    :raises BadOption: a character it cannot hold there (a blank, a quote, ``$``, a backslash, ``#``)."""
    if (bad := _SHELL_UNSAFE.search(str(path))) or _CONTROL.search(str(path)):
        char = bad.group() if bad else "a control character"
        raise BadOption(f"the job script cannot hold the {what} {str(path)!r} (it has {char!r}): use a path "
                        "of letters, digits and / . _ - only")
    return path


def _values(config: RunConfig, config_path: Path, target: str, sizes: Sizes) -> dict[str, object]:
    name = re.sub(r"[^a-z0-9-]+", "-", config.run.name.lower()).strip("-") or "run"
    inference_nodes = sizes.inference_nodes or config.option("inference", "servers", 1)
    gpus = sizes.gpus_per_node
    values: dict[str, object] = {
        **{k: getattr(sizes, k) for k in Sizes.__dataclass_fields__},
        "procs_per_node": sizes.procs_per_node or gpus or 1,
        "node_resources": f"#SBATCH --gpus-per-node={gpus}" if gpus else "# CPU nodes (--gpus-per-node 0): no GPUs",
        "job_options": "\n".join(_job_options(sizes)) or "# no --time, --account or --sbatch options",
        "k8s_resources": f"limits: {{nvidia.com/gpu: {gpus}}}" if gpus else
                         f'requests: {{cpu: "{sizes.procs_per_node or 1}"}}',
        "name": name,
        "inference_nodes": inference_nodes,
        "inference": config.get("inference").name,
        "config": config_path.resolve(),
        "output_dir": config.run.out.resolve(),
        "workdir": Path.cwd(),
    }
    if target == "slurm":
        for what, key in (("config path", "config"), ("output_dir", "output_dir"), ("working directory", "workdir")):
            _slurm_path(what, values[key])
    if target == "k8s":
        data = config.to_dict()
        data["run"]["output_dir"] = f"{K8S_RUNS}/{name}"
        text = json.dumps(data, indent=2)
        values["config_text"] = "\n".join("    " + line for line in text.splitlines())
        urls = [f"http://{name}-inference-{i}.{name}-inference:{sizes.inference_port}" for i in range(inference_nodes)]
        values["server_urls"] = json.dumps(urls)
    return values


def _job_options(sizes: Sizes) -> list[str]:
    options = [f"--time={sizes.time}"] * bool(sizes.time) + [f"--account={sizes.account}"] * bool(sizes.account)
    for extra in sizes.sbatch:
        if "\n" in extra or not extra.startswith("-"):
            raise I3Error(f"--sbatch takes one sbatch option (e.g. --sbatch=--qos=high), got {extra!r}")
        options.append(extra)
    return [f"#SBATCH {option}" for option in options]


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


def submit(files: dict[str, str], out: Path) -> tuple[str, Path]:
    """Write the Slurm job script into the run directory ``out`` and submit it with ``sbatch``.

    :return: the job id and the job's output file (``out/logs/slurm-JOBID.out``; the roles' logs beside it).
    :raises I3Error: no ``sbatch`` on PATH (``exit_code`` 2), or sbatch refused the job (its own message).
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise NoScheduler("sbatch is not on PATH: submit from a Slurm login node, or render the job script "
                          "with --dry-run")
    (out / "logs").mkdir(parents=True, exist_ok=True)  # the job's output goes there before the script runs
    (script,) = write(files, out)
    try:
        result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True,
                                timeout=SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise I3Error(f"sbatch did not answer in {SUBMIT_TIMEOUT_S:.0f}s (is slurmctld up?)") from None
    if result.returncode != 0:
        message = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
        raise I3Error(f"sbatch refused {script}: {message}")
    job = result.stdout.strip().split(";")[0]  # --parsable: JOBID[;CLUSTER]
    return job, out / "logs" / f"slurm-{job}.out"


class BadOption(I3Error):
    """An option of ``i3core launch`` the job files cannot carry (a usage error: exit 2)."""

    exit_code = 2


class NoScheduler(I3Error):
    """The scheduler's commands are not on this machine (a usage error: exit 2)."""

    exit_code = 2
