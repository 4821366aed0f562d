"""``python -m contextpilot_bench.testbed``: see :mod:`.cli`."""

import sys

from contextpilot_bench.testbed.cli import main

sys.exit(main())
