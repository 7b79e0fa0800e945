"""pytest fixtures for i3core plugin authors, registered through the ``pytest11`` entry point.

- ``i3_plugins``: a fresh plugin manager with every installed plugin, per test.
- ``i3_make_component``: ``make_component`` bound to ``i3_plugins``.
- ``i3_hook_recorder``: a :class:`~i3core.testing.HookRecorder` on ``i3_plugins``.
"""

import functools

import pytest

from i3core import testing


@pytest.fixture
def i3_plugins():
    return testing.plugin_manager()


@pytest.fixture
def i3_make_component(i3_plugins):
    return functools.partial(testing.make_component, plugins=i3_plugins)


@pytest.fixture
def i3_hook_recorder(i3_plugins):
    recorder = testing.HookRecorder(i3_plugins)
    yield recorder
    recorder.close()
