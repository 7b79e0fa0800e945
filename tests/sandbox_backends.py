"""Which sandbox backends the tests run over here, and how each is built for a test.

``local`` always runs (these machines are root with namespaces). ``docker``
runs where a Docker engine answers; with ``I3CORE_REQUIRE_DOCKER=1`` (set by
.ci/run, which starts dockerd) a missing engine fails instead of skipping.
"""

import os
from pathlib import Path

import pytest

from i3core.testing import make_component

REQUIRE_DOCKER = os.environ.get("I3CORE_REQUIRE_DOCKER", "") not in ("", "0")


def docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:
        return False


SANDBOX_BACKENDS = [
    "local",
    pytest.param("docker", marks=pytest.mark.skipif(not (REQUIRE_DOCKER or docker_available()),
                                                    reason="no Docker engine answers here")),
]  # fmt: skip


def backend_for(name: str, tmp_path: Path, **options):
    """A sandbox backend component for one test, with ``options`` on top of its defaults."""
    if name == "local":
        return make_component("sandbox", "local", root_dir=str(tmp_path / "sandboxes"), **options)
    if name == "docker":
        from tests.docker_image import test_image

        return make_component("sandbox", "docker", image=test_image(), **options)
    raise ValueError(name)
