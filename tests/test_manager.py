"""The plugin manager: entry points, blocking, broken plugins, duplicates, tracing."""

import textwrap

import importlib_metadata
import pytest

from i3core import hookimpl
from i3core.config import validate
from i3core.errors import ConfigError, PluginError
from i3core.manager import load_plugins
from i3core.testing import plugin_manager

LOSS_PLUGIN = """
from pydantic import BaseModel, ConfigDict
from i3core import hookimpl

class {cls}:
    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
    def __init__(self, config):
        self.config = config

@hookimpl
def i3_register_losses(register):
    register("{component}", {cls})
"""


def install_dist(root, dist, module, source, ep_name=None, version="1.0"):
    """Lay out a real installed distribution (dist-info + module) under ``root``.

    The module name gets the folder's name so modules never collide across tests.
    """
    module = f"{module}_{root.name}".replace("-", "_")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[i3core]\n{ep_name or dist} = {module}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def entry_points(site):
    return [ep for dist in importlib_metadata.distributions(path=[str(site)]) for ep in dist.entry_points]


def test_builtins_load_through_entry_points_with_their_distribution(builtins):
    infos = {info.name: info for info in builtins.info()}
    assert {"i3core.losses", "i3core.optimizers", "i3core.envs", "i3core.metric_sinks"} <= set(infos)
    assert all(info.distribution == "i3core" for info in infos.values())
    assert infos["i3core.losses"].components == {"loss": ["cispo", "grpo", "gspo", "icepop", "pg"]}
    assert infos["i3core.losses"].hooks == ["i3_register_losses"]


def test_third_party_plugin_loads_with_distribution_and_version(site):
    install_dist(site, "i3-plugin-a", "plug_a", LOSS_PLUGIN.format(cls="A", component="a-loss"), version="2.3")
    plugins = load_plugins(entry_points=entry_points(site))
    component = plugins.registry.get("loss", "a-loss")
    assert (component.provider.distribution, component.provider.version) == ("i3-plugin-a", "2.3")


def test_duplicate_component_names_both_distributions(site):
    install_dist(site, "i3-plugin-a", "plug_a", LOSS_PLUGIN.format(cls="A", component="same"))
    install_dist(site, "i3-plugin-b", "plug_b", LOSS_PLUGIN.format(cls="B", component="same"))
    with pytest.raises(PluginError) as excinfo:
        load_plugins(entry_points=entry_points(site))
    message = str(excinfo.value)
    assert "loss 'same' is registered twice" in message
    assert "i3-plugin-a" in message and "i3-plugin-b" in message


def test_misspelled_hook_is_an_error_with_suggestion(site):
    install_dist(site, "i3-plugin-typo", "plug_typo", """
        from i3core import hookimpl

        @hookimpl
        def i3_register_loss(register):
            pass
    """)
    with pytest.raises(PluginError, match=r"unknown hook 'i3_register_loss' \(did you mean 'i3_register_losses'\?\)"):
        load_plugins(entry_points=entry_points(site))


def test_hook_with_an_argument_the_spec_lacks_is_an_error(builtins):
    class Bad:
        @hookimpl
        def i3_on_step_end(self, step, metrics, extra):
            pass

    with pytest.raises(PluginError, match="extra"):
        builtins.register(Bad(), name="bad")
    assert not builtins.pm.has_plugin("bad")


def test_broken_unreferenced_plugin_is_a_warning(site, builtins):
    install_dist(site, "i3-plugin-broken", "plug_broken", "import does_not_exist_anywhere\n")
    install_dist(site, "i3-plugin-a", "plug_a", LOSS_PLUGIN.format(cls="A", component="a-loss"))
    plugins = load_plugins(entry_points=entry_points(site))
    assert [f.plugin for f in plugins.failures] == ["i3-plugin-broken"]
    assert "ModuleNotFoundError" in plugins.failures[0].error
    assert plugins.registry.get("loss", "a-loss") is not None


def test_a_plugin_that_exits_or_prints_at_import_is_a_warning_and_keeps_stdout_clean(site, capsys):
    """``sys.exit()`` at import was the whole CLI's exit (0, no line: nothing run); a print at import went to
    stdout, ahead of ``i3core plugins --json``'s JSON. The first is a failed plugin, the second goes to stderr."""
    install_dist(site, "i3-plugin-exits", "plug_exits", "import sys\nsys.exit(0)\n")
    install_dist(site, "i3-plugin-talks", "plug_talks", "print('hello from plugin import')\n"
                 + LOSS_PLUGIN.format(cls="A", component="a-loss"))
    plugins = load_plugins(entry_points=entry_points(site))
    assert [(f.plugin, f.error) for f in plugins.failures] == [("i3-plugin-exits", "SystemExit: 0")]
    assert plugins.registry.get("loss", "a-loss") is not None
    captured = capsys.readouterr()
    assert "hello from plugin import" not in captured.out and "hello from plugin import" in captured.err


def test_broken_plugin_is_named_when_the_config_needs_it(site):
    install_dist(site, "i3-plugin-broken", "plug_broken", "raise RuntimeError('boom at import')\n")
    plugins = load_plugins(entry_points=entry_points(site))
    with pytest.raises(ConfigError) as excinfo:
        validate({"loss": {"use": "broken-loss"}}, plugins)
    (problem,) = excinfo.value.problems
    assert problem.path == "loss.use"
    assert "i3-plugin-broken" in problem.message and "boom at import" in problem.message


def test_a_component_whose_constructor_raises_is_named_with_its_plugin(site):
    """A plugin's bug in ``__init__`` was an i3core "internal error" naming nothing; it is one line naming the
    component, its plugin and distribution (the plugin's exception is its cause); an I3Error goes as it is."""
    from i3core.errors import I3Error

    install_dist(site, "i3-plugin-ctor", "plug_ctor", LOSS_PLUGIN.format(cls="A", component="ctor-loss").replace(
        "self.config = config", "raise KeyError('ctor bug')"))
    plugins = load_plugins(entry_points=entry_points(site))
    config = validate({"loss": {"use": "ctor-loss"}}, plugins)
    with pytest.raises(I3Error) as failed:
        config.get("loss").build()
    assert str(failed.value) == ("loss 'ctor-loss' (plugin 'i3-plugin-ctor' from i3-plugin-ctor 1.0) could not be "
                                 "built: KeyError: 'ctor bug'")
    assert isinstance(failed.value.__cause__, KeyError)


def test_register_hook_that_raises_is_a_clear_error(builtins):
    class Raises:
        @hookimpl
        def i3_register_envs(self, register):
            raise ValueError("no dataset")

    with pytest.raises(PluginError, match="failed in i3_register_envs: no dataset"):
        builtins.register(Raises(), name="raises")


def test_component_without_forbidding_extra_keys_is_refused(builtins):
    from pydantic import BaseModel

    class Lax:
        class Config(BaseModel):
            pass

    class Plugin:
        @hookimpl
        def i3_register_losses(self, register):
            register("lax", Lax)

    with pytest.raises(PluginError, match="extra='forbid'"):
        builtins.register(Plugin(), name="lax")


def test_block_by_name_and_by_distribution(site, monkeypatch):
    install_dist(site, "i3-plugin-a", "plug_a", LOSS_PLUGIN.format(cls="A", component="a-loss"), ep_name="a")
    eps = entry_points(site)
    assert load_plugins(entry_points=eps, disable=["a"]).registry.get("loss", "a-loss") is None
    assert load_plugins(entry_points=eps, disable=["i3-plugin-a"]).registry.get("loss", "a-loss") is None
    monkeypatch.setenv("I3CORE_DISABLE_PLUGINS", "other, a")
    plugins = load_plugins(entry_points=eps)
    assert plugins.blocked == ["a"] and plugins.registry.get("loss", "a-loss") is None


def test_block_builtins_from_config(tmp_path):
    from i3core.config import load_config

    path = tmp_path / "p.toml"
    path.write_text('[plugins]\ndisable = ["i3core.losses"]\n[loss]\nuse = "icepop"\n')
    with pytest.raises(ConfigError, match="unknown loss 'icepop'"):
        load_config(path)


def test_trace_logs_every_hook_call(capsys):
    from i3core.cli import log

    log.configure(level="info")
    plugins = plugin_manager(installed=False)
    traced = load_plugins(entry_points=[], trace=True)
    traced.register(type("P", (), {"i3_on_weights_updated": staticmethod(hookimpl(lambda version: None))}),
                    name="p")
    traced.hook.i3_on_weights_updated(version=9)
    err = capsys.readouterr().err
    assert "hook call" in err and "i3_on_weights_updated" in err and "version" in err and "'9'" in err
    assert "hook result" in err
    assert plugins.registry.get("loss", "icepop") is not None


def test_trace_env_var_switches_tracing_on(monkeypatch, capsys):
    from i3core.cli import log

    log.configure(level="info")
    monkeypatch.setenv("I3CORE_TRACE", "1")
    losses = [ep for ep in importlib_metadata.entry_points(group="i3core") if ep.name == "i3core.losses"]
    load_plugins(entry_points=losses)
    assert "i3_register_losses" in capsys.readouterr().err
