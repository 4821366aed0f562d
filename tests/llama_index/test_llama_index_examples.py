"""The LlamaIndex examples run end to end on the real data and print a reuse gain."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_LLM_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=EXAMPLES,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _ratios(out: str) -> tuple[float, float]:
    baseline = float(re.search(r"hit ratio, baseline:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    ours = float(re.search(r"hit ratio, ContextPilot:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return baseline, ours


@pytest.mark.slow
def test_rag_example_prints_the_gain_and_the_chat_dedup(documents) -> None:  # type: ignore[no-untyped-def]
    out = _run("llamaindex_rag.py", "--documents", "120", "--questions", "40", "--top-k", "4")
    baseline, ours = _ratios(out)
    assert ours > baseline + 0.05, out
    assert "turn 2 prompt starts with turn 1's documents: True" in out, out
    replaced = int(re.search(r"replaced by hints: (\d+)", out).group(1))  # type: ignore[union-attr]
    assert replaced >= 1, out


@pytest.mark.slow
def test_workflow_example_prints_the_gain(documents) -> None:  # type: ignore[no-untyped-def]
    out = _run("llamaindex_workflow.py", "--questions", "60", "--cache-tokens", "20000")
    baseline, ours = _ratios(out)
    assert ours > baseline + 0.05, out
