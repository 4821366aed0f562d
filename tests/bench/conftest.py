"""Fixtures for the benchmark tests: the real data directory (skip the tests that need it when
it is absent, for example in a clone without ../shared/data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contextpilot_integrations.bench.workloads import resolve_data_dir


@pytest.fixture(scope="session")
def data_dir() -> Path:
    try:
        return resolve_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"real data not available: {exc}")
