"""examples/mem0_agent.py runs offline (fake chat model, real Mem0 and MiniLM) with and without
the one line, and the line makes consecutive prompts share more of their memory context."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mem0_agent.py"


def _run(*args: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_LLM_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MEM0_TELEMETRY="False")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"shared with the previous call: (\d+) of (\d+) memory-context", done.stdout)
    assert match, done.stdout[-3000:]
    return done.stdout, int(match[1]) / int(match[2])


@pytest.mark.slow
def test_example_runs_and_the_one_line_helps() -> None:
    source = EXAMPLE.read_text()
    assert source.count("memory = ContextPilotMemory(memory)  # the one line") == 1
    wrapped, wrapped_shared = _run()
    plain, plain_shared = _run("--plain")
    assert "memory: ContextPilotMemory(Mem0)" in wrapped and "memory: plain Mem0" in plain
    for out in (wrapped, plain):
        assert out.count("\nturn ") == 4 and "(fake model) answer 4" in out
    assert "Most relevant memories first: [Memory" in wrapped
    assert "Most relevant memories first" not in plain
    assert wrapped_shared > plain_shared
