"""``python -m i3core.cli``: the ``i3core`` command."""

import sys

from i3core.cli.main import main

sys.exit(main())
