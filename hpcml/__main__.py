"""``python -m hpcml``: the ``hpcml`` command, where the console script is not on PATH."""

import sys

from hpcml.cli import main

sys.exit(main())
