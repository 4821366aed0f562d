"""Skip marks for tests that need the real engines' environments: each names the script that
makes the environment and the variable that points at one elsewhere."""

from __future__ import annotations

import pytest
from contextpilot_bench.testbed.locations import find_smg, find_vllm_python

NEEDS_VLLM = pytest.mark.skipif(
    find_vllm_python() is None,
    reason="no vLLM environment: run scripts/setup-vllm-env.sh (makes .venv-vllm) or set "
    "CONTEXTPILOT_VLLM_PYTHON",
)
NEEDS_SMG = pytest.mark.skipif(
    find_smg() is None,
    reason="no smg gateway: run scripts/setup-smg-env.sh (makes .venv-smg) or set CONTEXTPILOT_SMG",
)
