"""plugins.toml validation: every problem at once, with paths and suggestions."""

import json

import jsonschema
import pytest

from i3core.config import apply_overrides, json_schema, load_config, read_toml, validate
from i3core.errors import ConfigError

from .conftest import ROOT, run_cli

THREE_MISTAKES = """
[run]
max_step = 10

[loss]
use = "icepop"
mask_lo = 0.3

[optimizer]
use = "adamx"
"""


def problems(data, plugins):
    with pytest.raises(ConfigError) as excinfo:
        validate(data, plugins)
    return [(p.path, p.message) for p in excinfo.value.problems]


def test_three_mistakes_three_errors_exit_2_no_traceback(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(THREE_MISTAKES)
    result = run_cli("check", str(path))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: run.max_step: unknown key (did you mean 'max_steps'?); valid keys: name, output_dir, max_steps, seed, keep_rollouts, rollouts_max_mb",
        "error: loss.mask_lo: unknown key (did you mean 'mask_low'?); valid keys: mask_low, mask_high, "
        "rollout_min_ratio",
        "error: optimizer.use: unknown optimizer 'adamx' (did you mean 'adamw'?); available: adamw (i3core), "
            "muon (i3core)",
    ]
    assert "Traceback" not in result.stderr + result.stdout


def test_quickstart_is_valid():
    result = run_cli("check", str(ROOT / "examples" / "quickstart.toml"))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_unknown_section_wrong_type_and_missing_use(builtins):
    found = problems({"envv": {}, "loss": {"mask_low": "x"}, "run": {"max_steps": 0}, "env": 3}, builtins)
    assert found[0][0] == "envv" and "did you mean 'env'" in found[0][1]
    assert found[1] == ("loss.use", "missing: pick a loss: cispo (i3core), grpo (i3core), gspo (i3core), icepop (i3core), pg (i3core)")
    assert found[2][0] == "run.max_steps" and "greater than or equal to 1" in found[2][1]
    assert found[3] == ("env", "must be a table ([env]), got int")


def test_component_validators_run(builtins):
    found = problems({"loss": {"use": "icepop", "mask_low": 6.0, "mask_high": 5.0}}, builtins)
    assert found == [("loss", "mask_low (6.0) must not exceed mask_high (5.0)")]


def test_use_must_be_a_string(builtins):
    assert problems({"loss": {"use": 3}}, builtins) == [("loss.use", "must be a string naming a loss, got int")]


def test_valid_config_is_typed_with_defaults(builtins):
    config = validate({"run": {"name": "x"}, "loss": {"use": "icepop", "mask_high": 4}}, builtins)
    assert config.run.out.as_posix() == "runs/x"
    spec = config.get("loss")
    assert (spec.kind, spec.name, spec.config.mask_high, spec.config.mask_low) == ("loss", "icepop", 4.0, 0.5)
    assert config.to_dict()["loss"] == {"use": "icepop", "mask_low": 0.5, "mask_high": 4.0, "rollout_min_ratio": 1e-5}


def test_overrides_parse_toml_values_and_create_sections():
    data = apply_overrides(
        {"loss": {"use": "icepop"}},
        ["loss.mask_high=4.5", "run.name=abc", "optimizer.betas=[0.9, 0.99]", "run.seed=3"],
    )
    assert data == {
        "loss": {"use": "icepop", "mask_high": 4.5},
        "run": {"name": "abc", "seed": 3},
        "optimizer": {"betas": [0.9, 0.99]},
    }


def test_bad_override_is_reported(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["nodot=1"])


def test_override_reaches_validation_through_the_cli(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[loss]\nuse = "icepop"\n')
    result = run_cli("check", str(path), "--set", "loss.mask_low=-1")
    assert result.returncode == 2
    assert "loss.mask_low: Input should be greater than 0, got -1" in result.stderr


@pytest.mark.parametrize(("sets", "message"), [
    ({"trainer": {"colocate": True, "nproc": 2}}, "runs one trainer rank in the run's process; nproc is 2"),
    ({"trainer": {"colocate": True}, "inference": {"use": "builtin"}},
     'shares the run\'s process with the engine of inference "local"; this run\'s is "builtin" (its servers are '
     'processes of their own)'),
    ({"trainer": {"colocate": True, "threads": 2}},
     "torch's thread count is the process's: trainer.threads (2) and inference.threads (1) must be equal"),
])
def test_a_colocated_trainer_needs_one_rank_beside_the_local_engine(builtins, sets, message):
    data = {"model": {"use": "tiny-moe"}, "inference": {"use": "local"}, "env": {"use": "reverse-text"}}
    for section, values in sets.items():
        data[section] = {**data.get(section, {}), **values}
    assert problems(data, builtins) == [("trainer.colocate", message)]


@pytest.mark.parametrize(("sets", "expected"), [
    ({}, [("weight_sync.use", "memory needs the trainer in the run's process: [trainer] colocate = true")]),
    ({"inference": {"use": "builtin"}, "trainer": {"colocate": True}},
     [("trainer.colocate", 'shares the run\'s process with the engine of inference "local"; this run\'s is "builtin" '
                           "(its servers are processes of their own)"),
      ("weight_sync.use", 'memory needs the engine in the run\'s process: inference "local", not \'builtin\'')]),
    ({"trainer": {"colocate": True}, "scheduler": {"use": "async", "weight_update_lag": 1}},
     [("scheduler.weight_update_lag", "1 needs weights the orchestrator hands out (weight_sync filesystem): memory "
                                      "delivers each version at once")]),
])
def test_weights_in_memory_need_the_trainer_beside_the_local_engine(builtins, sets, expected):
    data = {"model": {"use": "tiny-moe"}, "inference": {"use": "local"}, "env": {"use": "reverse-text"},
            "weight_sync": {"use": "memory"}}
    validate({**data, "trainer": {"colocate": True}}, builtins)  # the setting it is for
    for section, values in sets.items():
        data[section] = {**data.get(section, {}), **values}
    assert problems(data, builtins) == expected


def test_default_output_folder_that_is_a_file_is_one_line(tmp_path):
    """No output_dir: the run goes to runs/<name> under the working directory, which is refused at check time
    when a file stands in its way (the explicit output_dir is checked the same way: tests/bad_configs)."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine").write_text("a file")
    (tmp_path / "p.toml").write_text('[run]\nname = "mine"\n')
    for command in ("check", "run"):
        result = run_cli(command, "p.toml", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert ("error: run: the default output folder runs/mine (runs/<name>) cannot be made: runs/mine is a file, "
                "not a directory; set output_dir or another name") in result.stderr
        assert "Traceback" not in result.stderr + result.stdout
    assert (tmp_path / "runs" / "mine").read_text() == "a file"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("[run\nx = 1\n", "TOML syntax error"), ("a = = 1", "TOML syntax error")],
)
def test_toml_syntax_error_is_one_line(tmp_path, text, expected):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        read_toml(path)
    (problem,) = excinfo.value.problems
    assert expected in str(problem) and "\n" not in str(problem)


def test_missing_file(tmp_path):
    result = run_cli("check", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and "cannot read" in result.stderr and "Traceback" not in result.stderr


def test_schema_validates_the_quickstart_and_rejects_a_typo(builtins):
    schema = json_schema(builtins)
    jsonschema.Draft202012Validator.check_schema(schema)
    quickstart = read_toml(ROOT / "examples" / "quickstart.toml")
    jsonschema.validate(json.loads(json.dumps(quickstart)), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"loss": {"use": "icepop", "mask_lo": 1.0}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"env": {"use": "reverse-text", "max_operand": 3}}, schema)
    jsonschema.validate({"env": {"use": "arithmetic", "max_operand": 3}}, schema)


def test_a_check_config_that_raises_or_returns_no_problems_list_is_a_problem_naming_its_plugin():
    """A plugin's ``check_config`` bug was an "internal error" (it raised) or ``error: None`` (it returned
    None): one problem at the section's ``use``, naming the component and its plugin."""
    from pydantic import BaseModel, ConfigDict

    from i3core import hookimpl
    from i3core.errors import ConfigError
    from i3core.testing import plugin_manager

    class Raising:
        class Config(BaseModel):
            model_config = ConfigDict(extra="forbid")

        def __init__(self, config):
            self.config = config

        @staticmethod
        def check_config(config, run):
            raise KeyError("check bug")

    class Garbage(Raising):
        @staticmethod
        def check_config(config, run):
            return None

    class Plugin:
        @hookimpl
        def i3_register_losses(self, register):
            register("raising", Raising)
            register("garbage", Garbage)

    plugins = plugin_manager(Plugin(), installed=False)
    for name, words in (("raising", "its check_config raised KeyError: 'check bug'"),
                        ("garbage", "its check_config returned NoneType, not a list of Problem")):
        with pytest.raises(ConfigError) as failed:
            validate({"run": {"output_dir": "x"}, "loss": {"use": name}}, plugins)
        (problem,) = failed.value.problems
        assert problem.path == "loss.use" and problem.message.startswith(f"loss {name!r} (plugin ") and \
            problem.message.endswith(words), problem.message
