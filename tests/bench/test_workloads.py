"""Workload loaders on the real data files (the counts are the files' own)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from contextpilot_bench.workloads import (
    Document,
    Request,
    Workload,
    WorkloadSpec,
    load_workload,
    register_workload,
    resolve_data_dir,
    workload_names,
)


def test_multihop_rag(data_dir: Path) -> None:
    w = load_workload("multihop-rag", data_dir)
    assert len(w.requests) == 500
    assert len(w.corpus) == 326  # distinct evidence articles
    assert w.scopes == [""]
    queries = json.loads((data_dir / "multihop_rag_sample500/queries.json").read_text())
    assert [r.query for r in w.requests] == [q["question"] for q in queries["queries"]]
    truth = json.loads((data_dir / "multihop_rag_sample500/ground_truth.json").read_text())
    first = truth["0"]["evidence_list"][0]
    doc = next(d for d in w.corpus if d.id == first["title"])
    lines = doc.text.split("\n")
    assert lines[0] == first["title"] and lines[1] == first["fact"]
    assert len(lines) == len(set(lines))  # facts de-duplicated
    # Every fact of every article is in its document.
    for entry in truth.values():
        for ev in entry["evidence_list"]:
            assert (
                ev["fact"].strip() in next(d for d in w.corpus if d.id == ev["title"].strip()).text
            )


def test_locomo(data_dir: Path) -> None:
    w = load_workload("locomo", data_dir)
    assert len(w.requests) == 1986
    assert len(w.corpus) == 5882
    assert len(w.scopes) == 10
    assert all(r.scope == r.conversation_id for r in w.requests)
    first = w.scope_corpus("conv-26")[0]
    assert first.id == "D1:1"
    assert first.text == (
        "Caroline (1:56 pm on 8 May, 2023): Hey Mel! Good to see you! How have you been?"
    )
    assert sum("[shares an image: " in d.text for d in w.corpus) == 1226
    assert Counter(r.scope for r in w.requests)["conv-26"] == 199


def test_mtrag(data_dir: Path) -> None:
    w = load_workload("mtrag", data_dir)
    assert len({r.conversation_id for r in w.requests}) == 507
    assert len(w.requests) == 2191  # user turns
    assert len(w.corpus) == 1152  # unique reference passages
    sizes = {s: len(w.scope_corpus(s)) for s in w.scopes}
    assert sizes == {"fiqa": 157, "govt": 435, "clapnq": 312, "ibmcloud": 248}
    conversations = Counter(r.conversation_id for r in w.requests)
    assert max(conversations.values()) <= 11
    assert w.requests[0].query == "How to pay with cash when car shopping?"
    assert w.requests[0].scope == "fiqa"


def test_head_keeps_corpus() -> None:
    w = Workload("t", (Document("d", "text"),), (Request("a", "q"), Request("b", "q2")))
    assert [r.id for r in w.head(1).requests] == ["a"]
    assert w.head(1).corpus == w.corpus
    assert w.head(None) is w
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        w.head(0)


@pytest.mark.parametrize(
    ("corpus", "requests", "message"),
    [
        ((), (Request("a", "q"),), "corpus is empty"),
        ((Document("d", "x"),), (), "requests is empty"),
        ((Document("d", " "),), (Request("a", "q"),), "document 'd' has empty text"),
        ((Document("d", "x"), Document("d", "y")), (Request("a", "q"),), "'d' repeated"),
        ((Document("d", "x"),), (Request("a", "q"), Request("a", "r")), "'a' repeated"),
        ((Document("d", "x"),), (Request("a", ""),), "empty query"),
        ((Document("d", "x"),), (Request("a", "q", scope="s"),), "scope 's' with no document"),
    ],
)
def test_workload_validation(corpus: tuple, requests: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload("t", corpus, requests)


def test_missing_file_names_it_and_its_source(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_workload("mtrag", tmp_path)
    text = str(info.value)
    assert "mtragun-human/generation_tasks/reference.jsonl" in text
    assert "IBM/mt-rag-benchmark" in text
    # With the first multihop file present, the message names the second one.
    (tmp_path / "multihop_rag_sample500").mkdir()
    shutil.copy(
        data_dir / "multihop_rag_sample500/queries.json", tmp_path / "multihop_rag_sample500"
    )
    with pytest.raises(FileNotFoundError, match="ground_truth.json"):
        load_workload("multihop-rag", tmp_path)


def test_data_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTPILOT_DATA_DIR", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir(tmp_path / ".") == tmp_path / "."
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_data_dir(tmp_path / "nope")
    monkeypatch.setenv("CONTEXTPILOT_DATA_DIR", str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="CONTEXTPILOT_DATA_DIR"):
        resolve_data_dir()


def test_unknown_and_registered_workloads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        load_workload("nope", tmp_path)
    assert workload_names()[:3] == ["multihop-rag", "locomo", "mtrag"]
    (tmp_path / "tiny.txt").write_text("one\ntwo\n")

    def tiny(root: Path) -> Workload:
        lines = (root / "tiny.txt").read_text().split()
        return Workload("tiny-test", tuple(Document(x, x) for x in lines), (Request("r", "one"),))

    register_workload(WorkloadSpec("tiny-test", tiny, ("tiny.txt",), "a test"))
    assert load_workload("tiny-test", tmp_path).corpus[1].text == "two"
    with pytest.raises(ValueError, match="already registered"):
        register_workload(WorkloadSpec("tiny-test", tiny, (), "again"))
