import subprocess
import sys
from pathlib import Path

import pytest

from i3core.testing import plugin_manager

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def builtins():
    """A fresh manager with i3core's built-in plugins only (installed third-party ones left out)."""
    return plugin_manager(installed=False)


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``i3core ARGS`` in a real subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "i3core.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )
