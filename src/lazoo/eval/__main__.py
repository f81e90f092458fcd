"""``python -m lazoo.eval MODEL [MODEL ...] [options]``: the same as ``lazoo eval``."""

import sys

from lazoo_cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
