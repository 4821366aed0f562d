"""The online bounds: ContextPilot warm-started on the requests it serves (oracle history), and
an aligner that knows the next K requests (lookahead), beside clairvoyant-arrival."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.engine import EmbeddedEngine, Served
from contextpilot_bench.methods import PreparedWorkload, run_method
from contextpilot_bench.online_bounds import (
    ORACLE_HISTORY,
    lookahead_name,
    parse_lookaheads,
    run_lookahead,
    run_online_bounds,
)
from contextpilot_bench.workloads import Document, Request, Workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.rendering import PromptLayout

COUNTER = ApproxTokenCounter()
LAYOUT = PromptLayout()


def _prepared(lists: list[list[int]]) -> PreparedWorkload:
    """Requests retrieving the given document numbers."""
    n_docs = max(d for docs in lists for d in docs) + 1
    corpus = tuple(Document(f"d{i}", f"document {i} " + "x" * (60 + 7 * i)) for i in range(n_docs))
    requests = tuple(Request(f"r{i}", f"question {i}?") for i in range(len(lists)))
    retrieved = [[corpus[d] for d in docs] for docs in lists]
    return PreparedWorkload(Workload("synthetic", corpus, requests), 10, retrieved, LAYOUT, COUNTER)


class _RecordingEngine(EmbeddedEngine):
    """The embedded model that keeps every prompt it served, in send order."""

    def __init__(self) -> None:
        super().__init__(None, counter=COUNTER)
        self.sent: list[tuple[str, tuple[str, ...]]] = []

    def serve(self, rid: str, segments) -> Served:  # type: ignore[no-untyped-def]
        self.sent.append((rid, tuple(segments)))
        return super().serve(rid, segments)


def test_lookahead_sends_each_request_once_and_reads_only_the_next_k() -> None:
    # Request 1 shares {2, 3} with request 0, which the retriever puts last: only an aligner
    # that knows request 1 when it sends request 0 puts them first.
    lists = [[0, 1, 2, 3], [3, 2, 9], [5, 6, 7], [7, 6, 8], [0, 1, 4]]
    prepared = _prepared(lists)
    engines: list[_RecordingEngine] = []

    def factory() -> _RecordingEngine:
        engines.append(_RecordingEngine())
        return engines[-1]

    blind, one, whole = (run_lookahead(prepared, k, engine_factory=factory) for k in (0, 1, 4))
    for result, engine in zip((blind, one, whole), engines, strict=True):
        assert [r.request_index for r in result.records] == list(range(len(lists)))
        assert [rid for rid, _ in engine.sent] == [f"{result.method}-r{i}" for i in range(5)]
    assert (blind.method, one.method) == (lookahead_name(0), "lookahead-1")
    assert one.cached_tokens > blind.cached_tokens  # knowing one request ahead pays here
    # Knowing the whole workload, the first request is planned as clairvoyant-arrival plans it.
    clairvoyant = run_method("clairvoyant-arrival", prepared, mode="online", engine_factory=factory)
    assert clairvoyant.records[0].rid == "clairvoyant-arrival-r0"
    assert engines[2].sent[0][1] == engines[3].sent[0][1]
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        run_lookahead(prepared, -1, engine_factory=factory)


def test_oracle_history_learns_what_it_serves_and_indexes_only_what_it_sent() -> None:
    lists = [[0, 1, 2], [3, 4], [2, 1, 0], [4, 3, 6], [0, 2, 1], [6, 5]]
    prepared = _prepared(lists)
    oracle, *lookaheads = run_online_bounds(
        prepared, [0, 2], engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER)
    )
    assert oracle.method == ORACLE_HISTORY and oracle.cache is not None
    assert [r.request_index for r in oracle.records] == list(range(len(lists)))
    assert oracle.index["requests"] == len(lists)  # the learned copies were never indexed
    assert [r.method for r in lookaheads] == ["lookahead-0", "lookahead-2"]


def test_parse_lookaheads_names_the_option() -> None:
    assert parse_lookaheads("0, 4,16") == [0, 4, 16]
    for bad in ("", "1,x", "-1", "4,4"):
        with pytest.raises(ValueError, match="--online-bounds"):
            parse_lookaheads(bad)


def test_the_bounds_print_beside_clairvoyant_arrival(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--data-dir", str(data_dir), "--workload", "mtrag", "--limit", "24", "--no-plot"]
    bounds = ["--online-bounds", "0,2"]
    assert main([*args, *bounds, "--mode", "online", "--out", str(tmp_path / "b.json")]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "b.json").read_text())["summary"]}
    assert {ORACLE_HISTORY, "lookahead-0", "lookahead-2", "clairvoyant-arrival"} <= set(rows)
    assert {r["requests"] for r in rows.values()} == {24}
    text = capsys.readouterr().out
    shares = next(x for x in text.splitlines() if "vs clairvoyant" in x)
    assert f"{ORACLE_HISTORY} " in shares and "lookahead-2 " in shares
    prefill = next(x for x in text.splitlines() if x.startswith("prefill tokens vs baseline"))
    assert "lookahead" not in prefill and "oracle" not in prefill  # references, not planners
    assert main([*args, "--online-bounds"]) == 2  # the offline mode has no online bounds
    assert "--mode online" in capsys.readouterr().err
