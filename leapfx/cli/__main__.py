"""``python -m leapfx.cli ...``: the ``leapfx`` command."""

import sys

from . import main

sys.exit(main())
