"""The real data directory of the tests: ``$CONTEXTPILOT_DATA_DIR`` and nothing else.

``scripts/test.sh`` sets the variable. Tests that need the data skip without it, with a message
naming the variable, so a clone without the datasets still runs every other test; what each
dataset directory holds and where it comes from is listed in
``benchmarks/contextpilot_bench/workloads.py``. Standard library and pytest only (see the
package's docstring).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA_DIR_ENV = "CONTEXTPILOT_DATA_DIR"
MULTIHOP_RAG = "multihop_rag_sample500"  # the MultiHop-RAG sample's directory in the data dir


def find_data_dir() -> Path | None:
    """``$CONTEXTPILOT_DATA_DIR`` when it names a directory, else None."""
    value = os.environ.get(DATA_DIR_ENV)
    if not value or not Path(value).is_dir():
        return None
    return Path(value)


def data_dir_or_skip() -> Path:
    """``$CONTEXTPILOT_DATA_DIR``; skips the calling test when it is unset or not a directory."""
    value = os.environ.get(DATA_DIR_ENV)
    if not value:
        pytest.skip(f"real data not available: set {DATA_DIR_ENV} to the data directory")
    if not Path(value).is_dir():
        pytest.skip(f"real data not available: {DATA_DIR_ENV}={value} is not a directory")
    return Path(value)


def dataset_dir_or_skip(name: str) -> Path:
    """The data directory when it holds the dataset directory ``name``; skips otherwise."""
    data_dir = data_dir_or_skip()
    if not (data_dir / name).is_dir():
        pytest.skip(f"{name} not in {data_dir} (from {DATA_DIR_ENV})")
    return data_dir
