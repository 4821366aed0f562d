"""examples/langchain_rag.py on the real MultiHop-RAG sample: the printed figures show the reuse
gain, with the embedded cache model and with an OpenAI-compatible HTTP endpoint."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langchain_rag.py"
ROW = re.compile(r"^(baseline \(retriever order\)|ContextPilot \((?:invoke|batch)\))\s+(.*)$")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("langchain_rag_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def figures(output: str) -> dict[str, dict[str, float]]:
    """Rows of the printed table: method -> requests, prompt, cached, hit ratio, prefill."""
    rows = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match:
            cells = match.group(2).split()
            numbers = [float(c.replace(",", "")) for c in cells[:5]]
            rows[match.group(1)] = dict(
                zip(("requests", "prompt", "cached", "hit_ratio", "prefill"), numbers)
            )
    return rows


def test_example_prints_the_reuse_gain(example, data_dir, capsys, monkeypatch):
    monkeypatch.delenv("CONTEXTPILOT_LLM_BASE_URL", raising=False)
    assert example.main(["--data-dir", str(data_dir), "--limit", "120"]) == 0
    output = capsys.readouterr().out
    rows = figures(output)
    base, online, batch = (
        rows["baseline (retriever order)"],
        rows["ContextPilot (invoke)"],
        rows["ContextPilot (batch)"],
    )
    assert base["requests"] == online["requests"] == batch["requests"] == 120
    assert online["hit_ratio"] > base["hit_ratio"] and batch["hit_ratio"] > online["hit_ratio"]
    assert batch["prefill"] < base["prefill"]
    assert "ContextPilot (batch): hit ratio" in output and "x), prefill tokens -" in output


def test_example_with_a_small_cache_feeds_evictions_back(example, data_dir):
    workload = example.load_workload("multihop-rag", data_dir)
    results = example.run_all(workload, limit=80, cache_tokens=0.05, modes=("invoke",))
    base, online = results
    assert online.extra["index"]["evictions"] > 0  # the cache model's evictions reached evict()
    assert online.requests == base.requests == 80


def test_example_against_an_openai_compatible_endpoint(
    example, data_dir, chat_server, capsys, monkeypatch
):
    url, server = chat_server
    monkeypatch.setenv("CONTEXTPILOT_LLM_BASE_URL", url.removesuffix("/v1"))
    monkeypatch.delenv("CONTEXTPILOT_LLM_MODEL", raising=False)
    monkeypatch.setenv("CONTEXTPILOT_LLM_API_KEY", "test-key")
    assert example.main(["--data-dir", str(data_dir), "--limit", "40", "--modes", "batch"]) == 0
    rows = figures(capsys.readouterr().out)
    assert (
        rows["ContextPilot (batch)"]["hit_ratio"] > rows["baseline (retriever order)"]["hit_ratio"]
    )
    assert server.flushes == 2  # the engine's cache was emptied before each run
    planned = [b for b in server.bodies if "rid" in b]
    assert len(planned) == 40 and len(server.bodies) == 80
    assert all(b["rid"] == b["request_id"] == b["session_id"] for b in planned)
    assert all(b["model"] == "test-model" for b in server.bodies)
