"""The agent replays on the real engine: ``contextpilot-bench --workload agentic-mtrag --engine
vllm-cpu`` sends the plain LangChain agent's and ContextPilotMiddleware's recorded prompts to
vLLM's CPU build (random weights), the plain agent's once more with the ``openai`` SDK through
the proxy mode, and prints the engine's own prefill tokens and prefix breaks
(:mod:`~contextpilot_bench.agent_engine`).

Two short sessions: a data directory of two MTRAG-UN tasks of two user turns each, from
different conversations, copied from the real data (the full sessions' long histories would
spend minutes on the CPU). Tier ``vllm``: needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``)
and the MTRAG-UN data; skipped without either. The engine's start dominates its time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.agent_workload import mtrag_slice, run_bench
from support.engine_marks import NEEDS_VLLM

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]

USER_TURNS = 2
SESSIONS = 2


def test_the_agent_prompts_on_vllm_report_the_engines_prefill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    mtrag_slice(data, SESSIONS, USER_TURNS)
    out = tmp_path / "run.json"
    argv = [
        "--workload", "agentic-mtrag", "--agents", "langchain", "--engine", "vllm-cpu",
        "--agent-sessions", str(SESSIONS), "--data-dir", str(data), "--out", str(out),
    ]  # fmt: skip
    stdout = run_bench(argv)
    assert f"workload agentic-mtrag: {SESSIONS} sessions, {SESSIONS * USER_TURNS} user turns" in (
        stdout
    )
    assert re.search(r"engine prefix breaks .*: 0 \(target 0: ok\)", stdout), stdout
    line = re.search(
        r"contextpilot prefill tokens vs the plain agent's \(vLLM CPU, engine-reported\) = "
        r"(\d\.\d+)",
        stdout,
    )
    assert line is not None, stdout
    proxy_line = re.search(
        r"proxy prefill tokens vs ContextPilotMiddleware's \(vLLM CPU, engine-reported\): "
        r"(\d\.\d+) vs (\d\.\d+), difference [+-]\d\.\d+ \(target within 0\.02: (ok|MISSED)\)",
        stdout,
    )
    assert proxy_line is not None, stdout
    engine = json.loads(out.read_text())["engine"]
    rows = {r["method"]: r for r in engine["totals"]}
    assert set(rows) == {"baseline", "contextpilot", "proxy"}
    calls = SESSIONS * USER_TURNS * 3  # two searches and an answer per turn
    for row in rows.values():
        assert row["calls"] == calls
        assert row["prefix_breaks"] == 0
        assert 0 < row["cached_tokens"] < row["prompt_tokens"]
        assert row["prefill_tokens"] == row["prompt_tokens"] - row["cached_tokens"]
        assert row["ttft_p50_s"] > 0
    assert rows["contextpilot"]["prefill_tokens"] < rows["baseline"]["prefill_tokens"]
    ratio = rows["contextpilot"]["prefill_vs_baseline"]
    assert ratio == pytest.approx(float(line.group(1)), abs=5e-4)
    # The proxy sent the plain agent's messages, planned: a repeated search result went out
    # as a pointer, so the engine prefilled less than for the plain agent.
    assert rows["proxy"]["prefill_tokens"] < rows["baseline"]["prefill_tokens"]
    assert rows["proxy"]["prefill_vs_baseline"] == pytest.approx(
        float(proxy_line.group(1)), abs=5e-4
    )
    assert ratio == pytest.approx(float(proxy_line.group(2)), abs=5e-4)
