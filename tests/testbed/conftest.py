"""Fixtures of the real-engine test bed's tests: the random-weights model directory.

Module-scoped: each module that uses it gets its own directory (prepared once, about 10 s, by
:func:`~contextpilot_bench.testbed.model_dir.ensure_model_dir`). Modules that need another
model (a seeded copy, SmolLM2) define their own ``model_dir``. The slice and KV-cache sizing of
the vLLM tests are in ``support.vllm_workload``.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default-shape random-weights Llama model directory (needs ``tokenizers``)."""
    pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")
    from contextpilot_bench.testbed.model_dir import ensure_model_dir

    return ensure_model_dir(tmp_path_factory.mktemp("vllm-model"))
