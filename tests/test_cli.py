"""The ``i3core`` command as a user runs it: real subprocesses, exit codes, no tracebacks."""

import json

from .conftest import ROOT, run_cli


def test_help_on_every_command():
    for command in ["run", "check", "plugins", "schema", "new-plugin", "sandbox-agent"]:
        result = run_cli(command, "--help")
        assert result.returncode == 0 and "usage: i3core" in result.stdout


def test_every_flag_has_help_text():
    from i3core.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in [("i3core", parser), *subparsers.items()]:
        for action in sub._actions:
            if action.dest not in ("help", "command"):
                assert action.help, f"{name}: {action.dest} has no help text"


def test_plugins_json_lists_builtins_with_distribution():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {p["name"]: p for p in report["plugins"]}
    losses = by_name["i3core.losses"]
    assert losses["distribution"] == "i3core" and losses["version"]
    assert losses["components"] == {"loss": ["cispo", "grpo", "gspo", "icepop", "pg"]} and losses["hooks"] == ["i3_register_losses"]
    assert report["failed"] == [] and report["blocked"] == []


def test_plugins_table():
    result = run_cli("plugins")
    assert result.returncode == 0 and "i3core.envs" in result.stdout and "reverse-text" in result.stdout


def test_disable_env_var_blocks_a_plugin():
    import os

    result = run_cli("plugins", "--json", env={**os.environ, "I3CORE_DISABLE_PLUGINS": "i3core.envs"})
    report = json.loads(result.stdout)
    assert "i3core.envs" not in {p["name"] for p in report["plugins"]} and report["blocked"] == ["i3core.envs"]


def test_schema_is_json_with_every_section():
    result = run_cli("schema")
    schema = json.loads(result.stdout)
    assert {"run", "plugins", "env", "loss", "optimizer", "metrics"} <= set(schema["properties"])


def test_run_builds_components_writes_logs_and_resolved_config(tmp_path):
    config = tmp_path / "p.toml"
    out = tmp_path / "out"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    result = run_cli("run", str(config), "--set", f"run.output_dir='{out}'")
    assert result.returncode == 0, result.stderr
    resolved = json.loads((out / "config.resolved.json").read_text())
    assert resolved["loss"]["use"] == "icepop" and resolved["env"]["use"] == "reverse-text"
    events = [json.loads(line) for line in (out / "logs" / "run.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "run ended" and events[-1]["status"] == "completed"
    assert (out / "metrics.jsonl").exists()


def test_run_with_bad_config_is_exit_2_and_writes_nothing(tmp_path):
    config = tmp_path / "p.toml"
    config.write_text(f'[run]\noutput_dir = "{tmp_path / "out"}"\n[loss]\nuse = "nope"\n')
    result = run_cli("run", str(config))
    assert result.returncode == 2 and "unknown loss 'nope'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_new_plugin_refuses_bad_names_and_existing_folders(tmp_path):
    bad = run_cli("new-plugin", "Bad_Name", "--dir", str(tmp_path))
    assert bad.returncode == 1 and "must be lowercase" in bad.stderr
    assert run_cli("new-plugin", "ok", "--dir", str(tmp_path)).returncode == 0
    again = run_cli("new-plugin", "ok", "--dir", str(tmp_path))
    assert again.returncode == 1 and "already exists" in again.stderr
