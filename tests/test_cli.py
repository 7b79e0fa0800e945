"""The ``i3core`` command as a user runs it: real subprocesses, exit codes, no tracebacks."""

import json

from .conftest import ROOT, run_cli


def test_help_on_every_command():
    for command in [["run"], ["check"], ["plugins"], ["schema"], ["new-plugin"], ["env"], ["env", "eval"],
                    ["sandbox-agent"], ["sandbox"], ["sandbox", "manifests"], ["plot"], ["inference"],
                    ["orchestrator"], ["launch"], ["trainer"]]:
        result = run_cli(*command, "--help")
        assert result.returncode == 0 and "usage: i3core" in result.stdout


def test_every_flag_has_help_text():
    import argparse

    from i3core.cli.main import build_parser

    def parsers(name, parser):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from parsers(f"{name} {sub_name}", sub)

    seen = []
    for name, parser in parsers("i3core", build_parser()):
        seen.append(name)
        for action in parser._actions:
            if action.dest not in ("help", "command"):
                assert action.help, f"{name}: {action.dest} has no help text"
    assert "i3core env eval" in seen


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


def test_env_eval_runs_rollouts_against_a_server_and_reports_rewards():
    result = run_cli("env", "eval", "reverse-text", "--n", "4", "--rollouts-per-example", "2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["env"] == "reverse-text" and summary["rollouts"] == 8 and summary["failed"] == 0
    assert 0.0 <= summary["reward/min"] <= summary["reward/mean"] <= summary["reward/max"] <= 1.0
    table = run_cli("env", "eval", str(ROOT / "examples" / "env_group.toml"), "--n", "8", "--max-len", "320")
    assert table.returncode == 0, table.stderr
    assert "reward/mean" in table.stdout
    assert "env/reverse-text/reward" in table.stdout and "env/calc/reward" in table.stdout  # both members drawn


def test_env_eval_bad_input_is_one_line_errors():
    unknown = run_cli("env", "eval", "revers-text", "--n", "2")
    assert unknown.returncode == 2 and "did you mean 'reverse-text'" in unknown.stderr
    bad_option = run_cli("env", "eval", "tool-calc", "--set", "max_turn=3")
    assert bad_option.returncode == 2 and "env.max_turn: unknown key (did you mean 'max_turns'?)" in bad_option.stderr
    no_sandbox = run_cli("env", "eval", "code")
    assert no_sandbox.returncode == 1 and "pass --sandbox" in no_sandbox.stderr
    for result in (unknown, bad_option, no_sandbox):
        assert "Traceback" not in result.stderr


def test_new_plugin_env_kind_writes_an_env_package(tmp_path):
    made = run_cli("new-plugin", "word-game", "--kind", "env", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    root = tmp_path / "i3-plugin-word-game"
    source = (root / "i3_plugin_word_game" / "__init__.py").read_text()
    assert "class WordGameEnv(ToolEnv)" in source and 'register("word-game", WordGameEnv)' in source
    assert "i3_register_envs" in source
    assert "ScriptedClient" in (root / "tests" / "test_i3_plugin_word_game.py").read_text()
    assert run_cli("new-plugin", "x", "--kind", "optimizer", "--dir", str(tmp_path)).returncode == 2
