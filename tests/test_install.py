"""Real pip installs into temporary virtual environments: i3core itself, the example plugin, a scaffold.

The venvs see this interpreter's site-packages (torch and friends are not
reinstalled), but what is installed into them is built and installed by pip.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.install, pytest.mark.slow]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
    # The venv's bundled setuptools predates built-in bdist_wheel; use the outer one (the test extra pins it).
    subprocess.run([python(path), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True)
    return path


def python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def pip_install(venv: Path, *args: str) -> None:
    result = subprocess.run(
        [python(venv), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def copy_source_tree(to: Path) -> None:
    """The checkout as a user's clone has it: the files git does not ignore (tracked or new). Not CI's
    environments under .ci (vLLM's alone is 3.5 GB), runs, builds or caches; without git, all but those."""
    git = shutil.which("git")
    listed = git and subprocess.run([git, "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                                     "--exclude-standard"], capture_output=True, text=True)  # fmt: skip
    if not listed or listed.returncode != 0:
        shutil.copytree(ROOT, to, ignore=shutil.ignore_patterns(".git", ".ci", "runs", "build", "*.egg-info", ".venv",
                                                                ".hypothesis", ".pytest_cache"))
        return
    for name in filter(None, listed.stdout.split("\0")):
        path = ROOT / name
        if path.is_file():  # a tracked file deleted in the work tree is listed too
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to / name)


def cli(venv: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(venv), "-m", "i3core.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_regular_install_of_i3core(venv, tmp_path):
    source = tmp_path / "src"
    copy_source_tree(source)
    pip_install(venv, str(source))
    where = subprocess.run(
        [python(venv), "-c", "import i3core, i3core.plugins.losses as l; print(i3core.__file__); print(l.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(venv) in path for path in where), where
    shutil.rmtree(source)  # the installed copy must not need the source tree
    report = json.loads(cli(venv, "plugins", "--json").stdout)
    assert "i3core.losses" in {p["name"] for p in report["plugins"]}
    # the launch templates are package data: rendered from the installed copy, not from a checkout's deploy/
    config = tmp_path / "cluster.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace(
        '[inference]\nuse = "local"', '[inference]\nuse = "builtin"\nservers = 2\n#'))
    slurm = cli(venv, "launch", "--dry-run", str(config), "--gpus-per-node", "0", cwd=tmp_path)
    assert slurm.returncode == 0, slurm.stderr
    assert "#SBATCH hetjob" in slurm.stdout and "#SBATCH --nodes=2" in slurm.stdout and "{{" not in slurm.stdout
    k8s = cli(venv, "launch", "--dry-run", str(config), "--target", "k8s", "--out", str(tmp_path / "k8s"))
    assert k8s.returncode == 0 and len(k8s.stdout.split()) == 4, k8s.stderr


def test_example_plugin_installs_and_is_listed_and_accepted(venv):
    pip_install(venv, str(ROOT / "examples" / "i3-plugin-example"))
    result = cli(venv, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    example = next(p for p in json.loads(result.stdout)["plugins"] if p["name"] == "example")
    assert (example["distribution"], example["version"]) == ("i3-plugin-example", "0.2.0")
    assert example["components"] == {"env": ["count-letters"], "loss": ["reinforce"]}
    check = cli(venv, "check", str(ROOT / "examples" / "i3-plugin-example" / "example.toml"))
    assert check.returncode == 0, check.stderr
    assert "env=count-letters, loss=reinforce" in check.stdout
    tests = subprocess.run(
        [python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "examples" / "i3-plugin-example")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


def scaffold_and_test(venv, tmp_path, name: str, kind: str, *new_args: str) -> str:
    """``i3core new-plugin NAME`` installed editable into ``venv``: it registers its one ``kind`` component and
    its own tests pass. :return: the tests' output."""
    made = cli(venv, "new-plugin", name, *new_args, "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    root = tmp_path / f"i3-plugin-{name}"
    pip_install(venv, "-e", str(root))
    report = json.loads(cli(venv, "plugins", "--json").stdout)
    plugin = next(p for p in report["plugins"] if p["name"] == name)
    assert plugin["distribution"] == f"i3-plugin-{name}" and plugin["components"] == {kind: [name]}
    tests = subprocess.run(
        [python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=root, capture_output=True, text=True,
        timeout=300,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    return tests.stdout


def test_scaffolded_plugin_installs_editable_and_its_test_passes(venv, tmp_path):
    assert "2 passed" in scaffold_and_test(venv, tmp_path, "tiny-loss", "loss")


def test_scaffolded_env_plugin_installs_evaluates_and_its_tests_pass(venv, tmp_path):
    assert "4 passed" in scaffold_and_test(venv, tmp_path, "letter-count", "env", "--kind", "env")
    # the smoke test of an env: rollouts against a builtin server on fresh weights, rewards printed
    evaluated = cli(venv, "env", "eval", "letter-count", "--n", "3", "--set", "max_tokens=24", "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    summary = json.loads(evaluated.stdout)
    assert summary["env"] == "letter-count" and summary["rollouts"] == 3 and summary["failed"] == 0
    assert 0.0 <= summary["reward/mean"] <= 1.0 and "used_tool" in summary


def test_example_env_package_trains_for_two_steps(venv, tmp_path):
    pip_install(venv, str(ROOT / "examples" / "i3-plugin-example"))
    config = (ROOT / "examples" / "quickstart.toml").read_text()
    config = config.replace('use = "reverse-text"\nnum_examples = 2000\nmin_len = 3\nmax_len = 5\nalphabet = "abcdef"\n',
                            'use = "count-letters"\nnum_examples = 500\n')
    assert 'use = "count-letters"' in config
    path = tmp_path / "count-letters.toml"
    path.write_text(config)
    out = tmp_path / "run"
    result = subprocess.run(
        [python(venv), "-m", "i3core.cli", "run", str(path), "--set", f"run.output_dir='{out}'",
         "--set", "run.max_steps=2", "--set", "sft.steps=2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollouts/trained"] >= 64 for r in rows)
    assert json.loads((out / "config.resolved.json").read_text())["env"]["use"] == "count-letters"
