"""``i3core.testing`` and its pytest fixtures, as a plugin author uses them."""

import pytest

from i3core import hookimpl
from i3core.errors import ConfigError, I3Error
from i3core.testing import HookRecorder, make_component, plugin_manager


def test_make_component_validates_options(builtins):
    loss = make_component("loss", "icepop", plugins=builtins, mask_high=3.0)
    assert loss.config.mask_high == 3.0
    with pytest.raises(ConfigError) as excinfo:
        make_component("loss", "icepop", plugins=builtins, mask_hi=3.0)
    assert excinfo.value.problems[0].path == "loss.mask_hi"
    with pytest.raises(ConfigError, match="unknown loss 'icepopp' \\(did you mean 'icepop'\\?\\)"):
        make_component("loss", "icepopp", plugins=builtins)
    with pytest.raises(I3Error, match="unknown component kind 'losss'"):
        make_component("losss", "icepop", plugins=builtins)


def test_make_component_without_plugins_loads_installed_ones():
    assert make_component("env", "arithmetic", num_examples=3).examples()[0].id == "arithmetic-0"


def test_register_a_plugin_for_one_manager_only():
    class Plugin:
        @hookimpl
        def i3_on_weights_updated(self, version):
            self.version = version

    plugin = Plugin()
    manager = plugin_manager(plugin, installed=False)
    manager.hook.i3_on_weights_updated(version=3)
    assert plugin.version == 3
    assert not plugin_manager(installed=False).pm.is_registered(plugin)


def test_hook_recorder_records_results_and_stops_on_close(builtins):
    class Plugin:
        @hookimpl
        def i3_on_group_scored(self, group):
            return False

    builtins.register(Plugin(), name="p")
    recorder = HookRecorder(builtins)
    builtins.hook.i3_on_group_scored(group="g")
    (call,) = recorder.assert_called("i3_on_group_scored", times=1)
    assert call.kwargs == {"group": "g"} and call.result == [False]
    with pytest.raises(AssertionError, match="never called"):
        recorder.assert_called("i3_on_batch")
    recorder.close()
    builtins.hook.i3_on_group_scored(group="h")
    assert len(recorder.calls) == 1


def test_pytest_fixtures_come_through_the_pytest11_entry_point(pytester):
    pytester.makepyfile(
        """
        from i3core import hookimpl

        def test_fixtures(i3_plugins, i3_make_component, i3_hook_recorder):
            class P:
                @hookimpl
                def i3_on_step_end(self, step, metrics):
                    metrics["seen"] = step

            i3_plugins.register(P(), name="p")
            metrics = {}
            i3_plugins.hook.i3_on_step_end(step=2, metrics=metrics)
            assert metrics == {"seen": 2}
            i3_hook_recorder.assert_called("i3_on_step_end", times=1)
            assert i3_make_component("loss", "icepop").config.mask_low == 0.5

        def test_isolated(i3_plugins):
            assert not i3_plugins.pm.has_plugin("p")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
