"""What the optional metric sinks share: a clear problem when their package is not installed."""

import importlib

from i3core.errors import Problem


def missing_extra(module: str, extra: str) -> list[Problem]:
    """``[Problem]`` naming the extra to install when ``module`` does not import, else ``[]``."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return [Problem("metrics.use", f"the {extra} sink needs the {module} package ({exc}): "
                                       f"pip install 'i3core[{extra}]'")]
    return []
