"""Mem0 retrieval for the benchmark: real Mem0 on local Qdrant (fake embeddings in the fast
tests, all-MiniLM-L6-v2 on real LoCoMo in the slow one)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("MEM0_TELEMETRY", "False")
os.environ.setdefault("MEM0_DIR", tempfile.mkdtemp(prefix="contextpilot-mem0-bench-tests-"))

import pytest  # noqa: E402
from contextpilot_bench.cli import main  # noqa: E402
from contextpilot_bench.mem0_workload import (  # noqa: E402
    MANIFEST_NAME,
    mem0_user_ids,
    open_mem0_store,
    prepare_mem0_workload,
)
from contextpilot_bench.workloads import Document, Request, Workload  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402

from contextpilot_integrations.core.blocks import ApproxTokenCounter  # noqa: E402

FAKE = {"embeddings": DeterministicFakeEmbedding(size=32), "embedding_dims": 32}


def _workload(extra: str = "") -> Workload:
    corpus = [
        Document(f"a{i}", f"Ann says thing number {i}{extra}.", scope="conv a") for i in range(6)
    ] + [Document(f"b{i}", f"Ben says other thing {i}.", scope="conv-b") for i in range(5)]
    requests = [
        Request("q0", "What did Ann say?", scope="conv a"),
        Request("q1", "What did Ben say?", scope="conv-b"),
        Request("q2", "Anything else from Ann?", scope="conv a"),
    ]
    return Workload("tiny", tuple(corpus), tuple(requests))


def test_each_request_retrieves_its_scopes_memories_in_mem0_order(tmp_path: Path) -> None:
    workload = _workload()
    prepared = prepare_mem0_workload(
        workload, 4, counter=ApproxTokenCounter(), store_dir=tmp_path, torch_threads=None, **FAKE
    )
    assert prepared.k == 4 and len(prepared.retrieved) == 3
    with open_mem0_store(tmp_path, **FAKE) as (memory, _):
        for request, docs in zip(workload.requests, prepared.retrieved):
            assert docs, "the fake embedding returned nothing: the test would be empty"
            assert len(docs) <= 4 and {d.scope for d in docs} == {request.scope}
            user_id = mem0_user_ids([request.scope])[request.scope]
            raw = memory.search(request.query, top_k=4, filters={"user_id": user_id}, threshold=0)
            assert [d.text for d in docs] == [r["memory"] for r in raw["results"]]
            assert len(memory.get_all(filters={"user_id": user_id}, top_k=100)["results"]) == len(
                workload.scope_corpus(request.scope)
            )


def test_a_kept_store_is_reused_and_a_changed_scope_stored_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    counter = ApproxTokenCounter()
    first = prepare_mem0_workload(_workload(), 3, counter=counter, store_dir=tmp_path, **FAKE)
    caplog.set_level("INFO", logger="contextpilot_bench.mem0_workload")
    again = prepare_mem0_workload(_workload(), 3, counter=counter, store_dir=tmp_path, **FAKE)
    assert again.retrieved == first.retrieved
    assert "stored 0 memories" in caplog.text and "0 searches top-3" in caplog.text
    caplog.clear()
    changed = prepare_mem0_workload(
        _workload(" again"), 3, counter=counter, store_dir=tmp_path, **FAKE
    )
    assert "stored 6 memories" in caplog.text  # only scope "conv a" changed
    assert all(d.text.endswith(" again.") for d in changed.retrieved[0])
    with open_mem0_store(tmp_path, **FAKE) as (memory, _):
        stored = memory.get_all(filters={"user_id": "conv_a"}, top_k=100)["results"]
    assert sorted(m["memory"] for m in stored) == sorted(
        d.text for d in _workload(" again").scope_corpus("conv a")
    )
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert set(manifest["scopes"]) == {"conv_a", "conv-b"}


def test_a_store_of_another_embedder_is_refused(tmp_path: Path) -> None:
    prepare_mem0_workload(_workload(), 3, counter=ApproxTokenCounter(), store_dir=tmp_path, **FAKE)
    with pytest.raises(ValueError, match="another --mem0-store"):
        prepare_mem0_workload(
            _workload(),
            3,
            counter=ApproxTokenCounter(),
            store_dir=tmp_path,
            embeddings=DeterministicFakeEmbedding(size=16),
            embedding_dims=16,
        )


def test_user_ids_and_bad_arguments() -> None:
    assert mem0_user_ids(["conv 1", "", "x"]) == {"conv 1": "conv_1", "": "corpus", "x": "x"}
    with pytest.raises(ValueError, match="same Mem0 user_id"):
        mem0_user_ids(["a b", "a_b"])
    with pytest.raises(ValueError, match="k must be"):
        prepare_mem0_workload(_workload(), 0, counter=ApproxTokenCounter(), **FAKE)


@pytest.mark.slow
def test_cli_on_locomo_with_mem0(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Real LoCoMo, real all-MiniLM-L6-v2: the first conversation's 419 turns stored, the first
    10 questions answered with Mem0's top-20 (about a minute on 2 shared CPU cores)."""
    out = tmp_path / "run.json"
    code = main(
        [
            "--workload", "locomo", "--data-dir", str(data_dir), "--retriever", "mem0",
            "--limit", "10", "-k", "20", "--mode", "online", "--no-plot", "--out", str(out),
            "--mem0-store", str(tmp_path / "store"),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "Mem0 search top-20, mode online" in printed
    run = json.loads(out.read_text())
    assert run["run"]["retriever"] == "mem0"
    methods = [row["method"] for row in run["summary"]]
    assert methods == ["baseline", "contextpilot", "upper-bound", "clairvoyant-arrival"]
    manifest = json.loads((tmp_path / "store" / MANIFEST_NAME).read_text())
    assert manifest["scopes"].keys() == {"conv-26"}
    assert len(manifest["searches"]["conv-26 20"]) == 10
    assert all(len(ids) == 20 for ids in manifest["searches"]["conv-26 20"].values())
