"""The real model's scored methods on the embedded engine (what each method sends), the
annotation variants' wording and place, and the report's answer columns, lines and plot."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pytest
from contextpilot_bench.engine import EmbeddedEngine, Served
from contextpilot_bench.engine_report import EngineRequest
from contextpilot_bench.methods import METHODS, PreparedWorkload
from contextpilot_bench.real_model import (
    ALL_SCORED_METHODS,
    SCORED_METHODS,
    SCORED_SYSTEM_PROMPT,
    _variant,
    add_answer_columns,
    answer_lines,
    methods_for,
    plot_answers,
    run_scored_methods,
    scored_layout,
    scores_answers,
    shuffled_workload,
)
from contextpilot_bench.report import format_table, summarize
from contextpilot_bench.workloads import Document, Request, Workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter

COUNTER = ApproxTokenCounter()


def _prepared(lists: list[list[int]]) -> PreparedWorkload:
    n_docs = max(d for docs in lists for d in docs) + 1
    corpus = tuple(Document(f"d{i}", f"document {i} " + "x" * (60 + 9 * i)) for i in range(n_docs))
    requests = tuple(Request(f"multihop-{i}", f"question {i}?") for i in range(len(lists)))
    workload = Workload("multihop-rag", corpus, requests)
    retrieved = [[corpus[d] for d in docs] for docs in lists]
    return PreparedWorkload(workload, 4, retrieved, scored_layout(), COUNTER)


class RecordingEngine(EmbeddedEngine):
    """The embedded model, keeping every prompt it served."""

    sent: list[tuple[str, str]]

    def __init__(self) -> None:
        super().__init__(None, counter=COUNTER)
        self.sent = []

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        self.sent.append((rid, "".join(segments)))
        return super().serve(rid, segments)


def _run(methods: Sequence[str], prepared: PreparedWorkload) -> dict[str, RecordingEngine]:
    engines: list[RecordingEngine] = []

    def factory() -> RecordingEngine:
        engines.append(RecordingEngine())
        return engines[-1]

    results = run_scored_methods(methods, prepared, mode="offline", engine_factory=factory)
    assert [r.method for r in results] == list(methods)
    return dict(zip(methods, engines, strict=True))


LISTS = [[0, 1, 2, 3], [3, 2, 1, 4], [4, 3, 2, 5], [1, 0, 3, 2], [5, 4, 3, 1], [2, 3, 0, 1]]


def test_scored_methods_send_what_they_say() -> None:
    prepared = _prepared(LISTS)
    sent = _run(SCORED_METHODS, prepared)
    order_line = "Read the documents in this priority order:"
    assert not any(order_line in p for _, p in sent["baseline"].sent)
    assert any(order_line in p for _, p in sent["contextpilot"].sent)
    assert not any(order_line in p for _, p in sent["contextpilot-no-annotation"].sent)
    assert not any(order_line in p for _, p in sent["shuffled"].sent)
    # without the annotation, the same order and schedule as ContextPilot's
    with_line = [p.split(order_line)[0] for _, p in sent["contextpilot"].sent]
    without = [p.split("Question:")[0] for _, p in sent["contextpilot-no-annotation"].sent]
    assert [p.split("Question:")[0] for p in with_line] == without
    # each method sends rids of its own (an engine link never sees another method's)
    rids = [{rid for rid, _ in engine.sent} for engine in sent.values()]
    assert sum(len(r) for r in rids) == len(set().union(*rids)) == 4 * len(LISTS)
    # every prompt starts with the scored system prompt
    assert all(p.startswith(SCORED_SYSTEM_PROMPT) for e in sent.values() for _, p in e.sent)


def test_shuffled_control_is_seeded_and_keeps_each_requests_blocks() -> None:
    prepared = _prepared(LISTS)
    shuffled = shuffled_workload(prepared, seed=0)
    assert shuffled_workload(prepared, seed=0).retrieved == shuffled.retrieved
    assert shuffled_workload(prepared, seed=1).retrieved != shuffled.retrieved
    for before, after in zip(prepared.retrieved, shuffled.retrieved, strict=True):
        assert sorted(d.id for d in before) == sorted(d.id for d in after)
    assert shuffled.retrieved != prepared.retrieved


def test_annotation_variants_wording_and_place() -> None:
    base = scored_layout()
    labels = ["[Doc 2]", "[Doc 1]"]
    compact = _variant(base, "compact")
    assert compact.tail("q?", annotation_labels=labels).startswith("Priority: [Doc 2] > [Doc 1]\n")
    words = _variant(base, "words").tail("q?", annotation_labels=labels)
    assert "priority order: [Doc 2] > [Doc 1]. Answer in words, not with labels.\n" in words
    after = _variant(base, "after-question").tail("q?", annotation_labels=labels, hints=["h"])
    assert after == (
        "h\nQuestion: q?\nRead the documents in this priority order: [Doc 2] > [Doc 1].\n"
        "Answer in a few words, or with yes or no:"
    )
    default = base.tail("q?", annotation_labels=labels)
    assert default.index("priority order") < default.index("Question:")
    with pytest.raises(ValueError, match="unknown annotation variant"):
        _variant(base, "loud")


def test_variant_methods_run_through_contextpilot() -> None:
    prepared = _prepared(LISTS)
    methods = ("contextpilot-annotation-compact", "contextpilot-annotation-after-question")
    sent = _run(methods, prepared)
    assert any("Priority: [Doc" in p for _, p in sent[methods[0]].sent)
    after = [p for _, p in sent[methods[1]].sent if "priority order" in p]
    assert after and all(p.index("Question:") < p.index("priority order") for p in after)
    with pytest.raises(ValueError, match="unknown method"):
        run_scored_methods(["nope"], prepared, mode="offline", engine_factory=RecordingEngine)
    with pytest.raises(ValueError, match="repeat"):
        run_scored_methods(
            ["baseline", "baseline"], prepared, mode="offline", engine_factory=RecordingEngine
        )


def test_methods_for_a_real_model() -> None:
    real = argparse.Namespace(engine_model="smollm2", methods=None)
    assert scores_answers(real) and methods_for(real, METHODS) == SCORED_METHODS
    real.methods = "baseline,shuffled"
    assert methods_for(real, METHODS) == ALL_SCORED_METHODS
    random = argparse.Namespace(engine_model="random", methods=None)
    assert not scores_answers(random) and methods_for(random, METHODS) == METHODS


def test_answer_report_columns_and_plot(tmp_path: Path, data_dir: Path) -> None:
    lists = [[0, 1, 2, 3]] * 4
    prepared = _prepared(lists)
    results = run_scored_methods(
        ["baseline", "contextpilot"],
        prepared,
        mode="offline",
        engine_factory=RecordingEngine,
    )
    answers = {"baseline": ["no", "Yes", "x", "[Doc 1]"], "contextpilot": ["no", "yes", "x", "y"]}
    run: dict = {
        "engine_requests": {
            r.method: [
                asdict(EngineRequest(x.rid, 1, 1, 0, 0, 0, 0.1, answers[r.method][x.request_index]))
                for x in r.records
            ]
            for r in results
        }
    }
    lines = answer_lines(results, prepared, run, data_dir)
    assert lines[0].startswith("answers scored on 4 questions")
    assert any(line.startswith("target: contextpilot gold contained") for line in lines)
    scores = run["answer_scores"]["methods"]
    assert scores["baseline"]["metrics"]["label_only"]["mean"] == pytest.approx(0.25)
    assert run["answer_scores"]["answers"]["baseline"]["multihop-0"] == "no"
    rows = summarize(results)
    add_answer_columns(rows, run)
    table = format_table(rows)
    assert "gold contained" in table.splitlines()[0] and "EM" in table
    assert rows[1]["gold_contained_vs_baseline"].startswith(("+", "-"))
    png = plot_answers(tmp_path / "answers.png", results, run, "test")
    assert png.stat().st_size > 10_000
    assert answer_lines(results, prepared, {}, data_dir) == []
