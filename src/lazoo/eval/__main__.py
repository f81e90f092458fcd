"""``python -m lazoo.eval MODEL [MODEL ...] [options]``: the same as ``lazoo eval``."""

import sys

from .harness import main

sys.exit(main())
