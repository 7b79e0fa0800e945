"""Built-in sandbox backends: where model-written code runs (the ``[sandbox]`` section)."""

from i3core import hookimpl


@hookimpl
def i3_register_sandboxes(register):
    pass
