"""``python -m contextpilot_integrations.engines``: see :mod:`.cli`."""

import sys

from contextpilot_integrations.engines.cli import main

sys.exit(main())
