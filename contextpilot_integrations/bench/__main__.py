"""``python -m contextpilot_integrations.bench``: same as ``contextpilot-bench``."""

from contextpilot_integrations.bench.cli import main

raise SystemExit(main())
