"""`python -m lazoo_cli ...`: the `lazoo` command where the console script is not on the PATH."""

import sys

from . import main

sys.exit(main())
