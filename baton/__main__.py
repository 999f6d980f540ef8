"""`python -m baton ...`: the same as the `baton` console script."""

import sys

from baton.cli import main

sys.exit(main())
