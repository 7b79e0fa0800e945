"""``i3core launch``: the packaged Slurm and Kubernetes templates rendered from a real plugins.toml, their node
shapes and options, and ``--submit`` where there is no Slurm. The job submitted to a real Slurm: test_slurm.py."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import i3core
from i3core.cli.main import build_parser

from .conftest import QUICKSTART_LOCAL, ROOT, run_cli

QUICKSTART = str(ROOT / "examples" / "quickstart.toml")


@pytest.fixture
def cluster(tmp_path) -> str:
    """The quickstart as a cluster runs it: the same file with its ``[inference]`` as two builtin servers."""
    text = (ROOT / "examples" / "quickstart.toml").read_text()
    assert QUICKSTART_LOCAL in text
    path = tmp_path / "cluster.toml"
    path.write_text(text.replace(QUICKSTART_LOCAL, '[inference]\nuse = "builtin"\nservers = 2\n'))
    return str(path)


def commands() -> set[str]:
    parser = build_parser()
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def assert_only_existing_commands(text: str) -> set[str]:
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    called = set(re.findall(r"\bi3core,? ([a-z][\w-]*)(?![\w/])", code))  # `i3core X` and YAML's `[i3core, X`
    assert called <= commands(), called - commands()
    assert "{{" not in text and "}}" not in text
    return called


def test_slurm_sbatch_renders_and_passes_bash_n(tmp_path, cluster):
    result = run_cli("launch", "--dry-run", cluster, "--trainer-nodes", "2", "--inference-nodes", "3",
                     "--gpus-per-node", "4", "--partition", "h200", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(result.stdout)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = result.stdout
    assert assert_only_existing_commands(text) == {"inference", "orchestrator"}
    headers = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert headers.count("hetjob") == 2 and headers.count("--partition=h200") == 2
    assert "--nodes=2" in headers and "--nodes=3" in headers and "--gpus-per-node=4" in headers
    assert "torch.distributed.run --nnodes=2 --nproc-per-node=4" in text and "-m i3core.loop.trainer" in text
    assert f'CONFIG="{cluster}"' in text and f"#SBATCH --chdir={tmp_path}" in text
    assert 'i3core inference "$CONFIG" --index "$i" --port 8000 --host 0.0.0.0 --resume' in text
    assert 'i3core orchestrator "$CONFIG" --servers "${SERVERS[@]}" --resume' in text
    assert '-m i3core.loop.trainer "$CONFIG" --resume' in text  # every attempt continues the run
    # requeue-safe: requeueable, appended logs, SIGTERM ahead of the time limit, an id per attempt
    for header in ("--requeue", "--open-mode=append", "--signal=B:TERM@120", "--exclusive"):
        assert header in headers
    assert 'ATTEMPT="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"' in text and "scontrol requeue" in text
    assert not [h for h in headers if h.startswith(("--time", "--account"))]


def test_slurm_cpu_nodes_and_every_option(tmp_path, cluster):
    """``--gpus-per-node 0``: no GPU asked for anywhere, torchrun's ranks from --procs-per-node; the scheduler's
    options land in the header."""
    result = run_cli("launch", "--dry-run", cluster, "--gpus-per-node", "0", "--procs-per-node", "3",
                     "--orchestrator-cpus", "2", "--partition", "cpu-big", "--cpu-partition", "cpu-small",
                     "--time", "1-00:00:00", "--account", "rl", "--sbatch=--qos=high", "--sbatch=--mail-type=END",
                     "--signal-grace", "300", "--inference-port", "8123", "--rdzv-port", "29600", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    headers = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert not [h for h in headers if "gpu" in h or "gres" in h]
    assert headers.count("--partition=cpu-big") == 2 and "--partition=cpu-small" in headers
    assert {"--time=1-00:00:00", "--account=rl", "--qos=high", "--mail-type=END", "--signal=B:TERM@300",
            "--cpus-per-task=2"} <= set(headers)
    assert headers.index("--qos=high") < headers.index("hetjob")  # job-wide options in the first component
    assert "torch.distributed.run --nnodes=1 --nproc-per-node=3" in text and ':29600" --rdzv-id' in text
    assert "http://$node:8123" in text and "--port 8123" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    one = run_cli("launch", "--dry-run", cluster, "--gpus-per-node", "0", cwd=tmp_path)
    assert "--nproc-per-node=1 " in one.stdout
    bad = run_cli("launch", "--dry-run", cluster, "--sbatch", "qos=high")
    assert bad.returncode == 1 and bad.stderr.splitlines() == [
        "error: --sbatch takes one sbatch option (e.g. --sbatch=--qos=high), got 'qos=high'"]


def test_submit_without_sbatch_is_one_line_and_exit_2(tmp_path, cluster):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python and i3core, no Slurm
    result = run_cli("launch", "--submit", cluster, "--gpus-per-node", "0", cwd=tmp_path, env=env)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: sbatch is not on PATH: submit from a Slurm login node, or render the job script with --dry-run"]
    k8s = run_cli("launch", "--submit", cluster, "--target", "k8s", cwd=tmp_path)
    assert k8s.returncode == 2 and k8s.stderr.splitlines() == [
        "error: --submit submits to Slurm; for --target k8s render with --dry-run --out DIR, then kubectl apply -f DIR"]


def test_k8s_manifests_render_parse_and_deserialise(tmp_path, cluster):
    result = run_cli("launch", "--dry-run", cluster, "--target", "k8s", "--out", str(tmp_path / "k8s"),
                     "--trainer-nodes", "2", "--gpus-per-node", "8", "--image", "reg/i3core:1")
    assert result.returncode == 0, result.stderr
    files = [tmp_path / "k8s" / f"{n}.yaml" for n in ("config", "trainer", "inference", "orchestrator")]
    assert result.stdout.split() == [str(f) for f in files]
    docs, called = [], set()
    for path in files:
        called |= assert_only_existing_commands(path.read_text())
        docs += list(yaml.safe_load_all(path.read_text()))
    assert called == {"inference", "orchestrator"}
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert kinds == {("ConfigMap", "quickstart-config"), ("PersistentVolumeClaim", "quickstart-runs"),
                     ("Service", "quickstart-trainer"), ("Job", "quickstart-trainer"),
                     ("Service", "quickstart-inference"), ("StatefulSet", "quickstart-inference"),
                     ("Job", "quickstart-orchestrator")}
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    trainer = by_name[("Job", "quickstart-trainer")]["spec"]
    assert trainer["completions"] == 2 and trainer["completionMode"] == "Indexed"
    container = trainer["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/i3core:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["command"] == ["torchrun"] and container["args"][-4:] == ["-m", "i3core.loop.trainer",
                                                                               "/config/plugins.json", "--resume"]
    # the same resume semantics as on Slurm: failed pods restart, and every role starts with --resume
    assert trainer["backoffLimit"] == 10 and trainer["template"]["spec"]["restartPolicy"] == "OnFailure"
    inference = by_name[("StatefulSet", "quickstart-inference")]["spec"]
    assert inference["replicas"] == 2  # [inference] servers
    assert inference["template"]["spec"]["containers"][0]["args"][0].endswith("--host 0.0.0.0 --resume")
    job = by_name[("Job", "quickstart-orchestrator")]["spec"]
    assert job["backoffLimit"] == 10 and job["template"]["spec"]["restartPolicy"] == "OnFailure"
    orchestrator = job["template"]["spec"]["containers"][0]
    assert orchestrator["command"][-2:] == ["--resume", "--servers"]
    assert orchestrator["args"] == [f"http://quickstart-inference-{i}.quickstart-inference:8000" for i in range(2)]
    assert "nvidia.com/gpu" not in json.dumps(orchestrator)

    kubernetes = pytest.importorskip("kubernetes_asyncio.client")

    class Response:  # what ApiClient.deserialize reads: the JSON body of an API answer
        def __init__(self, doc):
            self.data = json.dumps(doc)

    async def deserialise():
        async with kubernetes.ApiClient() as api:
            return [api.deserialize(Response(d), f"V1{d['kind']}") for d in docs]

    objects = asyncio.run(deserialise())
    assert {type(o).__name__ for o in objects} == {"V1ConfigMap", "V1PersistentVolumeClaim", "V1Service", "V1Job",
                                                   "V1StatefulSet"}
    job = next(o for o in objects if type(o).__name__ == "V1Job" and o.metadata.name == "quickstart-trainer")
    assert job.spec.template.spec.containers[0].volume_mounts[1].mount_path == "/runs"


def test_the_k8s_config_map_holds_a_config_the_roles_accept(tmp_path, cluster):
    result = run_cli("launch", "--dry-run", cluster, "--target", "k8s")
    assert result.returncode == 0, result.stderr
    config_map = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "ConfigMap")
    resolved = json.loads(config_map["data"]["plugins.json"])
    assert resolved["run"]["output_dir"] == "/runs/quickstart" and resolved["weight_sync"]["use"] == "filesystem"
    path = tmp_path / "plugins.json"
    path.write_text(config_map["data"]["plugins.json"])
    check = run_cli("check", str(path))
    assert check.returncode == 0, check.stderr


def test_k8s_cpu_nodes_ask_for_cpus_not_gpus(tmp_path, cluster):
    result = run_cli("launch", "--dry-run", cluster, "--target", "k8s", "--gpus-per-node", "0", "--procs-per-node",
                     "4", "--restarts", "3")
    assert result.returncode == 0, result.stderr
    assert "nvidia.com/gpu" not in result.stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
    trainer = docs[("Job", "quickstart-trainer")]["spec"]
    assert trainer["backoffLimit"] == 3
    container = trainer["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4"}} and "--nproc-per-node=4" in container["args"]


def test_the_templates_are_package_data_and_templates_overrides(tmp_path, cluster):
    from i3core.cli.launch import default_templates

    shipped = default_templates()
    assert shipped == Path(i3core.__file__).parent / "templates"
    assert {p.name for p in (shipped / "slurm").iterdir()} == {"i3core.sbatch.tmpl"}
    own = tmp_path / "mine" / "slurm"
    own.mkdir(parents=True)
    (own / "tiny.sbatch.tmpl").write_text("#!/bin/bash\n#SBATCH --job-name={{name}}\necho {{trainer_nodes}}\n")
    result = run_cli("launch", "--dry-run", cluster, "--templates", str(tmp_path / "mine"))
    assert result.returncode == 0 and result.stdout == "#!/bin/bash\n#SBATCH --job-name=quickstart\necho 1\n"
    empty = run_cli("launch", "--dry-run", cluster, "--templates", str(tmp_path / "none"))
    assert empty.returncode == 1 and empty.stderr.splitlines() == [
        f"error: no slurm templates (*.sbatch.tmpl) in {tmp_path / 'none' / 'slurm'}: pass --templates DIR "
        "(holding slurm/)"]


def test_launch_refuses_what_it_cannot_do_in_one_line(tmp_path, cluster):
    plain = run_cli("launch", QUICKSTART)
    assert plain.returncode == 2 and "one of the arguments --dry-run --submit is required" in plain.stderr
    resume = run_cli("launch", "--dry-run", "--resume", cluster)
    assert resume.returncode == 2 and resume.stderr.splitlines() == [
        "error: --resume goes with --submit (the rendered job always starts its roles with --resume)"]
    local = run_cli("launch", "--dry-run", QUICKSTART)
    assert local.returncode == 1 and local.stderr.splitlines() == [
        "error: cannot launch the roles separately: inference 'local' starts no servers to put on nodes (it runs "
        'inside the orchestrator): set [inference] use = "builtin" or "vllm", with servers = N']
    config = tmp_path / "p.toml"
    config.write_text(Path(cluster).read_text().replace(
        'use = "filesystem"', 'use = "broadcast"').replace("keep = 3", ""))
    broadcast = run_cli("launch", "--dry-run", str(config))
    assert broadcast.returncode == 1 and broadcast.stderr.splitlines() == [
        "error: cannot launch the roles separately: weight_sync 'broadcast' works only under `i3core run` "
        '(use "filesystem")']
    bad = run_cli("launch", "--dry-run", str(ROOT / "tests" / "bad_configs" / "unknown_keys.toml"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_launch_refuses_options_the_job_files_cannot_carry_in_one_line(tmp_path, cluster):
    """A newline would end sbatch's header and run the rest as a command; a partition with a `;`, a --time in
    no Slurm format, a namespace that is no DNS label: each refused (exit 2) before anything is written."""
    out = tmp_path / "out"
    result = run_cli("launch", "--dry-run", cluster, "--out", str(out), "--account", "a\nb",
                     "--partition", "a b;touch /tmp/pwned")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: --account 'a\\nb' holds a control character (a newline would end its line)"]
    result = run_cli("launch", "--dry-run", cluster, "--out", str(out), "--partition", "a b;touch /tmp/pwned",
                     "--time", "abc", "--namespace", "Foo", "--image", "")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    for flag in ("--partition 'a b;touch /tmp/pwned'", "--time 'abc'", "--namespace 'Foo'", "--image ''"):
        assert flag in result.stderr
    assert not out.exists()
    for flag, value in (("--inference-port", "70000"), ("--rdzv-port", "0"), ("--trainer-nodes", "9" * 20)):
        result = run_cli("launch", "--dry-run", cluster, flag, value)
        assert result.returncode == 2 and f"argument {flag}: must be at" in result.stderr.splitlines()[-1]
    for time in ("90", "90:30", "2:00:00", "2-0", "2-00:00", "2-00:00:00"):
        result = run_cli("launch", "--dry-run", cluster, "--time", time, "--partition", "gpu,gpu-big")
        assert result.returncode == 0 and f"#SBATCH --time={time}\n" in result.stdout, result.stderr
