"""``python -m contextpilot_bench``: same as ``contextpilot-bench``."""

from contextpilot_bench.cli import main

raise SystemExit(main())
