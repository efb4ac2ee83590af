"""``python -m r3data.cli``: the same as the ``r3data`` console script."""

import sys

from r3data.cli import main

sys.exit(main())
