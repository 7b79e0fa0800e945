"""One ``test_hook_<name>`` per hook spec (a meta-test in test_docs.py holds us to it)."""

from pathlib import Path

import pluggy
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from i3core import hookimpl
from i3core.config import validate
from i3core.loop.events import end_step, group_kept
from i3core.registry import KINDS
from i3core.loop.run import execute
from i3core.testing import HookRecorder, make_component, plugin_manager
from i3core.types import Example, Group, Rollout, TrainBatch


class Thing:
    """A component usable under any kind for registration tests."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 1

    def __init__(self, config):
        self.config = config


def _registration_test(kind_name: str):
    hook_name = KINDS[kind_name].hook

    def test(builtins):
        plugin = type("P", (), {hook_name: staticmethod(hookimpl(lambda register: register("thing", Thing)))})
        recorder = HookRecorder(builtins)
        builtins.register(plugin, name="thing-plugin")
        recorder.assert_called(hook_name, times=1)
        component = builtins.registry.get(kind_name, "thing")
        assert component.cls is Thing and component.provider.plugin == "thing-plugin"
        built = make_component(kind_name, "thing", plugins=builtins, size=3)
        assert isinstance(built, Thing) and built.config.size == 3

    test.__name__ = f"test_hook_{hook_name}"
    return test


for _kind in KINDS:
    _test = _registration_test(_kind)
    globals()[_test.__name__] = _test


def _rollout(reward: float) -> Rollout:
    return Rollout(Example("e", "p"), [1], [2, 3], [-0.1, -0.2], [0, 1], [True, True], reward=reward)


def test_hook_i3_on_run_start(builtins, tmp_path):
    seen = []

    class Plugin:
        @hookimpl
        def i3_on_run_start(self, config, output_dir):
            seen.append((config.run.name, output_dir))

    builtins.register(Plugin(), name="p")
    config = validate({"run": {"name": "t", "output_dir": str(tmp_path)}, "loss": {"use": "icepop"}}, builtins)
    assert execute(config, builtins) == 0
    assert seen == [("t", Path(tmp_path))]


def test_hook_i3_on_run_end(builtins, tmp_path):
    statuses = []

    class Plugin:
        @hookimpl
        def i3_on_run_end(self, config, status):
            statuses.append(status)

        @hookimpl
        def i3_on_run_start(self):
            raise KeyboardInterrupt

    builtins.register(Plugin(), name="p")
    config = validate({"run": {"output_dir": str(tmp_path)}}, builtins)
    with pytest.raises(KeyboardInterrupt):
        execute(config, builtins)
    assert statuses == ["interrupted"]


def test_a_plugin_that_raises_in_an_event_hook_is_named_with_the_hook(builtins):
    """The core calls event hooks through Plugins.call: the error names the plugin that raised and the hook, the
    plugin's exception is its cause; ``plugins.hook`` (a plugin's own tests) still raises it unchanged."""
    from i3core.errors import HookFailed

    class Fine:
        @hookimpl
        def i3_on_step_end(self, step, metrics):
            metrics["fine"] = 1.0

    class Broken:
        @hookimpl
        def i3_on_step_end(self, step):
            raise ValueError("boom")

    builtins.register(Fine(), name="fine")
    builtins.register(Broken(), name="my_plugin")
    with pytest.raises(HookFailed) as failed:
        end_step(builtins, [], 2, {})
    assert str(failed.value) == "plugin 'my_plugin' from (registered directly) - failed in i3_on_step_end: " \
                                "ValueError: boom"
    assert isinstance(failed.value.__cause__, ValueError) and failed.value.hook == "i3_on_step_end"
    with pytest.raises(ValueError, match="boom"):
        builtins.hook.i3_on_step_end(step=2, metrics={})
    builtins.unregister("my_plugin")
    with pytest.raises(pluggy.HookCallError), pytest.warns(UserWarning):  # a wrong call: the core's bug, no plugin's
        builtins.call("i3_on_step_end", step=2)


def test_a_plugin_that_calls_sys_exit_in_an_event_hook_is_named_as_one_that_raised(builtins):
    """``sys.exit(0)`` in a hook ended a run at once, exit 0 and no line, its steps unfinished: it is a failure
    of that plugin, named with the hook, as any exception is."""
    from i3core.errors import HookFailed

    class Quits:
        @hookimpl
        def i3_on_step_end(self, step):
            raise SystemExit(0)

    builtins.register(Quits(), name="quitter")
    with pytest.raises(HookFailed, match=r"plugin 'quitter' .* failed in i3_on_step_end: SystemExit: 0"):
        end_step(builtins, [], 2, {})


@pytest.mark.parametrize("fails_in", ["i3_on_run_start", None])
def test_a_plugin_that_raises_in_i3_on_run_end_after_a_completed_run_says_the_run_completed(builtins, tmp_path,
                                                                                            fails_in):
    """After a completed run: the error says so and names the plugin. After a failed one: the run's own error is
    raised and the end hook's is a warning. The components are closed either way."""
    from i3core.errors import HookFailed
    from i3core.loop.run import RunEndFailed

    class Plugin:
        @hookimpl
        def i3_on_run_start(self):
            if fails_in == "i3_on_run_start":
                raise RuntimeError("no start")

        @hookimpl
        def i3_on_run_end(self, status):
            raise ValueError(f"no end after {status}")

    builtins.register(Plugin(), name="ender")
    config = validate({"run": {"output_dir": str(tmp_path)}, "metrics": {"use": "jsonl"}}, builtins)
    with pytest.raises(HookFailed) as failed:
        execute(config, builtins)
    if fails_in:
        assert not isinstance(failed.value, RunEndFailed) and failed.value.hook == "i3_on_run_start"
        assert "failed in i3_on_run_start: RuntimeError: no start" in str(failed.value)
    else:
        assert isinstance(failed.value, RunEndFailed) and str(failed.value) == (
            f"the run completed (its checkpoints and metrics are in {tmp_path}), then plugin 'ender' from "
            "(registered directly) - failed in i3_on_run_end: ValueError: no end after completed")


def test_hook_i3_on_group_scored(builtins):
    class Shape:
        @hookimpl
        def i3_on_group_scored(self, group):
            for rollout in group.rollouts:
                rollout.reward *= 2

    class DropFlat:
        @hookimpl
        def i3_on_group_scored(self, group):
            return len(set(group.rewards())) > 1

    builtins.register(Shape(), name="shape")
    builtins.register(DropFlat(), name="drop-flat")
    varied = Group(Example("a", "p"), [_rollout(0.0), _rollout(1.0)])
    flat = Group(Example("b", "p"), [_rollout(1.0), _rollout(1.0)])
    assert group_kept(builtins, varied) and varied.rewards() == [0.0, 2.0]
    assert not group_kept(builtins, flat)


def test_hook_i3_on_step_end(builtins, tmp_path):
    class AddMetric:
        @hookimpl
        def i3_on_step_end(self, step, metrics):
            metrics["custom/double_step"] = 2.0 * step

    builtins.register(AddMetric(), name="add")
    sink = make_component("metric_sink", "jsonl", plugins=builtins)
    sink.open(tmp_path)
    end_step(builtins, [sink], 3, {"loss": 0.5})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3, "loss": 0.5, "custom/double_step": 6.0}\n'


def test_hook_i3_on_rollout_finished(builtins):
    received = []

    class Plugin:
        @hookimpl
        def i3_on_rollout_finished(self, rollout):
            received.append(rollout.reward)

    builtins.register(Plugin(), name="p")
    builtins.hook.i3_on_rollout_finished(rollout=_rollout(0.25))
    assert received == [0.25]


def test_hook_i3_on_weights_updated(builtins):
    received = []

    class Plugin:
        @hookimpl
        def i3_on_weights_updated(self, version):
            received.append(version)

    builtins.register(Plugin(), name="p")
    builtins.hook.i3_on_weights_updated(version=4)
    assert received == [4]


def test_hook_i3_on_batch(builtins):
    received = []

    class Plugin:
        @hookimpl
        def i3_on_batch(self, batch, step):
            received.append((batch.num_samples, step))

    builtins.register(Plugin(), name="p")
    zeros = torch.zeros(1, 4)
    batch = TrainBatch(zeros.long(), zeros.long(), zeros.bool(), zeros, zeros, zeros.long(), zeros.long(), 1)
    builtins.hook.i3_on_batch(batch=batch, step=1)
    assert received == [(1, 1)]


def test_an_implementation_may_take_a_subset_of_the_arguments(builtins):
    class Plugin:
        @hookimpl
        def i3_on_batch(self, step):
            self.step = step

    plugin = Plugin()
    builtins.register(plugin, name="p")
    builtins.hook.i3_on_batch(batch=None, step=7)
    assert plugin.step == 7


def test_plugin_manager_is_fresh_per_call():
    first, second = plugin_manager(installed=False), plugin_manager(installed=False)
    first.register(type("P", (), {"i3_register_losses": staticmethod(hookimpl(lambda register: register("x", Thing)))}),
                   name="p")
    assert first.registry.get("loss", "x") is not None
    assert second.registry.get("loss", "x") is None
