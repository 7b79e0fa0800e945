"""Built-in sandbox backends: where model-written code runs (the ``[sandbox]`` section)."""

from i3core import hookimpl
from i3core.plugins.sandboxes.docker_sandbox import DockerBackend
from i3core.plugins.sandboxes.k8s import K8sSandboxes
from i3core.plugins.sandboxes.local import LocalBackend


@hookimpl
def i3_register_sandboxes(register):
    register("local", LocalBackend)
    register("docker", DockerBackend)
    register("k8s", K8sSandboxes)
