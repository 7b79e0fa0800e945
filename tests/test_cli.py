"""The ``i3core`` command as a user runs it: real subprocesses, exit codes, no tracebacks."""

import json
import socket

from .conftest import ROOT, run_cli, sigint_as_at_a_terminal


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
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for args in ((), ("--json",)):  # was the errors soft-wrapped on stdout, no error line
        down = run_cli("env", "eval", "reverse-text", "--n", "2", "--server", f"http://127.0.0.1:{port}", *args)
        (line,) = down.stderr.strip().splitlines()
        assert down.returncode == 1 and line.startswith(
            f"error: all 2 rollouts of reverse-text failed; the first: ServerError: http://127.0.0.1:{port}/v1/"
            "completions: ClientConnectorError: Cannot connect to host"), down.stderr


def test_new_plugin_env_kind_writes_an_env_package(tmp_path):
    made = run_cli("new-plugin", "word-game", "--kind", "env", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    root = tmp_path / "i3-plugin-word-game"
    source = (root / "i3_plugin_word_game" / "__init__.py").read_text()
    assert "class WordGameEnv(ToolEnv)" in source and 'register("word-game", WordGameEnv)' in source
    assert "i3_register_envs" in source
    assert "ScriptedClient" in (root / "tests" / "test_i3_plugin_word_game.py").read_text()
    assert run_cli("new-plugin", "x", "--kind", "optimizer", "--dir", str(tmp_path)).returncode == 2


def _short_run(tmp_path, *sets: str):
    config = tmp_path / "p.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    sets = ("run.max_steps=4", "sft.steps=2", f"run.output_dir='{tmp_path / 'out'}'", *sets)
    return run_cli("run", str(config), *(arg for s in sets for arg in ("--set", s)))


def test_a_run_whose_rollouts_all_fail_stops_with_the_last_error(tmp_path):
    """Prompts longer than the engine's context: every request is refused (the engine is not marked down for it),
    and the run stops once FAILED_IN_A_ROW rollouts failed one after another, instead of waiting forever."""
    result = _short_run(tmp_path, "inference.max_len=8")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1000 rollouts in a row failed") and "the prompt has" in last, last
    assert "marked down" not in result.stderr


def test_a_learning_rate_that_breaks_the_weights_stops_the_run(tmp_path):
    """An SFT lr so high that step 1's weights overflow: the trainer refuses step 2's non-finite gradient (rather
    than train on, and serve, NaN weights) and the run stops with one line."""
    result = _short_run(tmp_path, "sft.lr=1e30")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    trainer_log = (tmp_path / "out" / "logs" / "trainer.log").read_text()
    assert "error: sft step 2: the gradient is not finite" in trainer_log and "sft.lr = 1e+30" in trainer_log
    assert result.stderr.strip().splitlines()[-1].startswith("error: sft step 2: the gradient is not finite")


def test_a_role_started_without_resume_over_a_run_refuses(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    config = tmp_path / "p.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    where = ("--set", f"run.output_dir='{out}'")
    for role in (("trainer",), ("orchestrator", "--servers", "http://127.0.0.1:9")):
        result = run_cli(role[0], str(config), *where, *role[1:])
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "holds an earlier run (metrics.jsonl): continue it with --resume" in result.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_serve_on_an_unreadable_model_or_address_is_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("garbage")
    result = run_cli("serve", str(model))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "cannot serve" in result.stderr and "JSONDecodeError" in result.stderr


RAISING_PLUGIN = """
import os
from i3core import hookimpl

@hookimpl
def i3_on_step_end(step):
    if os.environ["RAISE_IN"] == "i3_on_step_end" and step == 2:
        raise ValueError("boom")

@hookimpl
def i3_on_run_end(status):
    if os.environ["RAISE_IN"] == "i3_on_run_end":
        raise ValueError("boom")
"""


def test_a_plugin_that_raises_in_an_event_hook_is_one_line_naming_it_and_the_hook(tmp_path):
    """An installed plugin raising in i3_on_step_end stops the run with its name and the hook (no "internal
    error"); raising in i3_on_run_end after the last step, the line says that the run completed."""
    import os

    from .test_manager import install_dist

    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, "i3-plugin-raising", "raising", RAISING_PLUGIN, ep_name="my_plugin")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    config = tmp_path / "p.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    for hook in ("i3_on_step_end", "i3_on_run_end"):
        out = tmp_path / hook
        sets = ("run.max_steps=3", "sft.steps=2", f"run.output_dir='{out}'")
        result = run_cli("run", str(config), *(arg for s in sets for arg in ("--set", s)),
                         env={**env, "RAISE_IN": hook})
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        failed = f"plugin 'my_plugin' from i3-plugin-raising 1.0 failed in {hook}: ValueError: boom"
        if hook == "i3_on_run_end":
            assert last == f"error: the run completed (its checkpoints and metrics are in {out}), then {failed}"
            assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
        else:
            assert last == f"error: {failed}"


def test_a_max_len_beyond_the_model_names_the_config_key_not_the_server_flag(tmp_path):
    """inference.max_len above the model's positions: the run's line names the key the user wrote (the local
    engine, and builtin servers, which once said only "--max-len" in their own log)."""
    for name, source in (("local", ()), ("builtin", ("inference.use='builtin'", "inference.servers=1"))):
        (tmp_path / name).mkdir()
        result = _short_run(tmp_path / name, "inference.max_len=4096", *source)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: inference.max_len = 4096 exceeds the model's max_position_embeddings (2048)")
        assert last.endswith("set inference.max_len = 2048 or less") and "--max-len" not in last


def test_the_trainer_command_reads_its_config_once(tmp_path, monkeypatch):
    """`i3core trainer` checks output_dir with the config it read, then hands that config to the trainer."""
    import torch

    from i3core import config as config_module
    from i3core.cli.main import main
    from i3core.errors import I3Error
    from i3core.loop import trainer

    reads = []
    read_toml = config_module.read_toml
    monkeypatch.setattr(config_module, "read_toml", lambda path: reads.append(path) or read_toml(path))
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # this test process keeps its threads

    class Built(I3Error):
        """The trainer was built: far enough."""

    def built(config, **_):
        raise Built(f"trainer for {config.run.out}")

    monkeypatch.setattr(trainer, "Trainer", built)
    config = tmp_path / "p.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text())
    assert main(["trainer", str(config), "--set", f"run.output_dir='{tmp_path / 'out'}'"]) == 1
    assert reads == [config]


# -- start-up errors found by a review with the real CLI: each one line, no traceback ------------------------------


def one_error_line(result, code: int = 1) -> str:
    """The only line of ``result``'s stderr, an ``error:`` line, after exit ``code``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _saved_tiny_moe(directory):
    from .conftest import SERVED_MODEL, make_component

    model = make_component("model", "tiny-moe", **SERVED_MODEL)
    return model.save_hf(model.build(seed=0), directory)


def test_serve_on_a_model_dir_that_cannot_load_is_one_line_and_announces_nothing(tmp_path):
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[]")
    line = one_error_line(run_cli("serve", str(listed), "--port", "0"))
    assert "config.json is not a model's config: its JSON is not an object" in line
    broken = _saved_tiny_moe(tmp_path / "negative")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": -4}))
    line = one_error_line(run_cli("serve", str(broken), "--port", "0"))
    assert f"cannot serve {broken}: hidden_size: " in line and "greater than" in line
    result = run_cli("serve", str(broken), "--port", "70000")  # argparse's usage, then its error
    assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith("must be at most 65535, got 70000")
    result = run_cli("serve", str(broken), "--shutdown-grace-s", "nan")
    assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith("finite number of seconds >= 0, got nan")


def test_serve_announces_the_port_it_listens_on_once_it_listens(tmp_path):
    import subprocess
    import sys

    directory = _saved_tiny_moe(tmp_path / "model")
    proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "serve", str(directory), "--port", "0",
                             "--model-option", "hidden_size=64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline().strip()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert line.startswith(f"i3core server: {directory} on http://127.0.0.1:"), (line, err)
    assert int(line.rsplit(":", 1)[1]) > 0 and "i3core serve:" not in err


def test_serve_hf_without_tokenizer_files_is_refused_at_start(tmp_path):
    import shutil
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from make_hf_model import make_hf_model

    full = make_hf_model(tmp_path / "full", "qwen3", seed=0)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(full / name, bare / name)
    line = one_error_line(run_cli("serve", str(bare), "--model", "hf", "--model-option", f'path="{bare}"',
                                  "--port", "0"))
    assert "the tokenizer encodes text to no tokens" in line


def test_a_config_path_that_is_not_a_regular_file_or_too_big_is_one_problem(tmp_path):
    import os

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    big = tmp_path / "big.toml"
    big.write_text("#" * (5 << 20))
    for path, expect in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (big, "over 4 MiB")):
        result = run_cli("check", str(path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert expect in result.stderr.splitlines()[0]


def test_a_nul_in_a_config_string_is_a_problem_naming_its_key(tmp_path):
    path = tmp_path / "nul.toml"
    path.write_text('[run]\nname = "a\\u0000b"\n')
    for command in ("check", "run"):
        result = run_cli(command, str(path), cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.splitlines()[0].startswith("error: run.name: holds a NUL")


def test_an_os_error_from_the_users_files_is_an_error_line_not_an_internal_error(tmp_path):
    (tmp_path / "afile").write_text("")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    from .conftest import QUICKSTART_LOCAL

    config = tmp_path / "cluster.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace(
        QUICKSTART_LOCAL, '[inference]\nuse = "builtin"\nservers = 2\n'))
    for args in (("new-plugin", "my-loss", "--dir", str(tmp_path / "afile" / "x")),
                 ("launch", "--dry-run", str(config), "--out", str(tmp_path / "afile" / "y")),
                 ("plot", str(tmp_path), "--out", str(loop / "plots")),
                 ("new-plugin", "my-loss", "--dir", str(tmp_path / ("x" * 300)))):
        line = one_error_line(run_cli(*args, cwd=tmp_path))
        assert any(reason in line for reason in ("Not a directory: ", "File name too long: ",
                                                 "Too many levels of symbolic links: ")), line


def test_ctrl_c_while_the_cli_starts_is_interrupted_not_a_traceback(tmp_path):
    """Ctrl-C while the command loads (here: inside a plugin's import, which says when it is there, so the signal
    lands in start-up on any machine's speed): the line ``interrupted``, exit 130, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from .test_manager import install_dist

    marker = tmp_path / "importing"
    install_dist(tmp_path, "i3-plugin-slow", "plug_slow",
                 f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "i3core.cli", "check", str(ROOT / "examples" / "quickstart.toml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=sigint_as_at_a_terminal)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert marker.exists(), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130 and err.strip() == "interrupted", (proc.returncode, err)


def test_roles_check_their_arguments_before_waiting_for_the_trainer(tmp_path):
    """Each would otherwise print `waiting for version 0` and wait an hour for a trainer."""
    import subprocess
    import sys

    from .conftest import QUICKSTART_LOCAL

    config = tmp_path / "cluster.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace(
        QUICKSTART_LOCAL, '[inference]\nuse = "builtin"\nservers = 2\n').replace(
        'output_dir = "runs/quickstart"', f'output_dir = "{tmp_path / "run"}"'))
    cases = {("inference", "--index", "5"): "error: --index 5 is not a server of this run: [inference] servers = 2",
             ("inference", "--index", "-1"): "argument --index: must be at least 0, got -1",
             ("inference", "--port", "99999"): "argument --port: must be at most 65535, got 99999",
             ("orchestrator", "--servers", "notaurl"): "error: --servers 'notaurl' is not a server URL",
             ("orchestrator", "--servers", "http://h:99999"): "error: --servers 'http://h:99999' is not a server URL"}
    for (role, *args), expect in cases.items():
        result = subprocess.run([sys.executable, "-m", "i3core.cli", role, str(config), *args], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode in (1, 2) and "waiting for version 0" not in result.stdout + result.stderr
        assert expect in result.stderr.splitlines()[-1], result.stderr


BOOM_LOSS = """
from pydantic import BaseModel, ConfigDict
from i3core import hookimpl

class Boom:
    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mask_low: float = 0.0  # the quickstart's [loss] options (icepop's)
        mask_high: float = 0.0
        rollout_min_ratio: float = 0.0

    def __init__(self, config):
        self.config = config

    def __call__(self, inputs):
        raise RuntimeError("loss bug")

@hookimpl
def i3_register_losses(register):
    register("boom-loss", Boom)
"""


def test_a_plugin_that_raises_in_the_trainer_is_named_where_it_raised(tmp_path):
    """A loss plugin's bug in the trainer process: the run's last line says what was raised and where (the
    plugin's file and function), the traceback stays in logs/trainer.log (before: "the trainer exited with 1;
    see ...trainer.log", naming nothing)."""
    import os

    from .test_manager import install_dist

    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, "i3-plugin-boom", "plug_boom", BOOM_LOSS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "run"
    result = run_cli("run", str(ROOT / "examples" / "quickstart.toml"), "--set", f"run.output_dir='{out}'",
                     "--set", "loss.use='boom-loss'", "--set", "sft.steps=0", "--set", "run.max_steps=2", env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    module = next(site.glob("plug_boom*.py"))
    assert last.startswith(f"error: the trainer failed: RuntimeError: loss bug (raised at {module}:"), last
    assert last.endswith(" in __call__)") and "Traceback" not in result.stderr
    assert "Traceback" in (out / "logs" / "trainer.log").read_text()
