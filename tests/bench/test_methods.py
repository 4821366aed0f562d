"""Methods: the sparse upper bound against brute force, cache sizing, engines, eviction sync
(the engine model's evictions, and a planner that follows an engine through its engine link)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.engine import EmbeddedEngine, Served
from contextpilot_bench.methods import (
    WARM_START,
    PreparedWorkload,
    parse_cache_tokens,
    resolve_cache_tokens,
    run_method,
    run_methods,
    run_warm_started,
    upper_bound_records,
)
from contextpilot_bench.workloads import Document, Request, Workload
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenizerCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest

COUNTER = ApproxTokenCounter()
LAYOUT = PromptLayout()


def _prepared(lists: list[list[int]], doc_len: int = 40) -> PreparedWorkload:
    """Requests retrieving the given document numbers (texts of different lengths)."""
    n_docs = max([d for docs in lists for d in docs], default=0) + 1
    corpus = tuple(
        Document(f"d{i}", f"document {i} " + "x" * (doc_len + 7 * i)) for i in range(n_docs)
    )
    requests = tuple(Request(f"r{i}", f"question {i}?") for i in range(len(lists)))
    workload = Workload("synthetic", corpus, requests)
    retrieved = [[corpus[d] for d in docs] for docs in lists]
    return PreparedWorkload(workload, 10, retrieved, LAYOUT, COUNTER)


def _brute_force_upper_bound(prepared: PreparedWorkload) -> list[int]:
    out = []
    for i, request in enumerate(prepared.workload.requests):
        texts = prepared.block_texts(i)
        segments = LAYOUT.render_segments(texts, request.query)
        weight = {}
        for text, segment in zip(texts, segments[1:-1], strict=True):
            weight.setdefault(text, COUNTER.count(segment))
        best = 0
        for j in range(len(prepared.retrieved)):
            if j != i:
                shared = set(texts) & set(prepared.block_texts(j))
                best = max(best, sum(weight[t] for t in shared))
        prompt = sum(COUNTER.count(s) for s in segments)
        out.append(min(best + COUNTER.count(segments[0]), prompt - 1))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 8), min_size=1, max_size=5, unique=True), min_size=1, max_size=12
    )
)
def test_upper_bound_matches_brute_force(lists: list[list[int]]) -> None:
    prepared = _prepared(lists)
    got = [r.cached_tokens for r in upper_bound_records(prepared)]
    assert got == _brute_force_upper_bound(prepared)


def test_upper_bound_block_size_and_duplicates() -> None:
    prepared = _prepared([[0, 1, 2], [2, 1, 5], [7]])
    plain = upper_bound_records(prepared)
    blocked = upper_bound_records(prepared, block_size=16)
    for a, b in zip(plain, blocked, strict=True):
        assert b.cached_tokens == a.cached_tokens - a.cached_tokens % 16
    # Request 2 shares nothing: only its system prompt counts.
    assert plain[2].cached_tokens == COUNTER.count(LAYOUT.system_segment())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0.05", 0.05),
        ("5e-2", 0.05),
        ("1.0", 1.0),
        ("20000", 20000),
        ("unlimited", None),
        ("None", None),
    ],
)
def test_parse_cache_tokens(text: str, value: object) -> None:
    assert parse_cache_tokens(text) == value
    assert type(parse_cache_tokens(text)) is type(value)


@pytest.mark.parametrize("text", ["0", "-0.5", "lots", "nan", "", "inf", "-inf", "1e999"])
def test_parse_cache_tokens_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--cache-tokens"):
        parse_cache_tokens(text)


def test_resolve_cache_tokens() -> None:
    assert resolve_cache_tokens(0.05, 23_996) == 1200
    assert resolve_cache_tokens(1.0, 10) == 10
    assert resolve_cache_tokens(500, 10) == 500
    assert resolve_cache_tokens(None, 10) is None
    assert resolve_cache_tokens(1e-9, 10) == 1
    with pytest.raises(ValueError):
        resolve_cache_tokens(0, 10)


def test_embedded_engine_segments_are_units_weighted_by_tokens() -> None:
    engine = EmbeddedEngine(None, counter=COUNTER)
    a = LAYOUT.render_segments(["alpha " * 20, "beta " * 30], "q1")
    b = LAYOUT.render_segments(["alpha " * 20, "gamma " * 10], "q2")
    first = engine.serve("a", a)
    assert first.cached_tokens == 0
    assert first.prompt_tokens == sum(COUNTER.count(s) for s in a)
    second = engine.serve("b", b)
    assert second.cached_tokens == COUNTER.count(a[0]) + COUNTER.count(a[1])


def test_online_eviction_feedback_reaches_the_index() -> None:
    lists = [[i % 5, (i + 1) % 5, 5 + i % 3] for i in range(30)]
    prepared = _prepared(lists, doc_len=200)
    pilots: list[ContextPilot] = []

    def pilot_factory() -> ContextPilot:
        pilots.append(ContextPilot(layout=LAYOUT, token_counter=COUNTER))
        return pilots[-1]

    result = run_method(
        "contextpilot",
        prepared,
        mode="online",
        engine_factory=lambda: EmbeddedEngine(300, counter=COUNTER),
        pilot_factory=pilot_factory,
    )
    assert result.cache is not None and result.cache.evicted_rids > 0
    # Every request the cache model evicted is gone from the index.
    assert len(pilots[0].index) == 30 - result.cache.evicted_rids
    unlimited = run_method(
        "contextpilot",
        prepared,
        mode="online",
        engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER),
        pilot_factory=pilot_factory,
    )
    assert len(pilots[1].index) == 30 and unlimited.cache.evicted_rids == 0


def test_offline_sends_in_schedule_order_and_every_request_once() -> None:
    lists = [[0, 1, 2], [3, 4], [2, 1, 0], [4, 3, 6], [0, 2, 1]]
    prepared = _prepared(lists)
    result = run_method(
        "contextpilot",
        prepared,
        mode="offline",
        engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER),
    )
    assert sorted(r.request_index for r in result.records) == list(range(5))
    assert all(r.rid == f"contextpilot-r{r.request_index}" for r in result.records)
    baseline = run_method(
        "baseline",
        prepared,
        mode="offline",
        engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER),
    )
    assert [r.request_index for r in baseline.records] == list(range(5))
    assert result.cached_tokens > baseline.cached_tokens


class _RecordingEngine(EmbeddedEngine):
    """The embedded model that keeps every prompt it served, in send order."""

    def __init__(self, capacity_tokens: int | None) -> None:
        super().__init__(capacity_tokens, counter=COUNTER)
        self.sent: list[tuple[str, tuple[str, ...]]] = []

    def serve(self, rid: str, segments) -> Served:  # type: ignore[no-untyped-def]
        self.sent.append((rid, tuple(segments)))
        return super().serve(rid, segments)


@pytest.mark.parametrize("capacity", [None, 300])
def test_clairvoyant_arrival_sends_the_offline_plans_in_arrival_order(
    capacity: int | None,
) -> None:
    lists = [[0, 1, 2], [3, 4], [2, 1, 0], [4, 3, 6], [0, 2, 1], [6, 5], [1, 2, 7]]
    prepared = _prepared(lists)
    engines: list[_RecordingEngine] = []

    def factory() -> _RecordingEngine:
        engines.append(_RecordingEngine(capacity))
        return engines[-1]

    baseline, clairvoyant, offline = (
        run_method(method, prepared, mode=mode, engine_factory=factory)
        for method, mode in (
            ("baseline", "online"),
            ("clairvoyant-arrival", "online"),
            ("contextpilot", "offline"),
        )
    )
    # the baseline's request order ...
    order = [r.request_index for r in clairvoyant.records]
    assert order == [r.request_index for r in baseline.records] == list(range(len(lists)))
    assert [rid for rid, _ in engines[1].sent] == [f"clairvoyant-arrival-r{i}" for i in order]
    # ... each request with the offline plan's block order (the offline mode's own prompt)
    offline_prompt = {
        r.request_index: sent for r, (_, sent) in zip(offline.records, engines[2].sent)
    }
    assert [sent for _, sent in engines[1].sent] == [offline_prompt[i] for i in order]
    with ContextPilot(layout=LAYOUT, token_counter=COUNTER) as pilot:
        batch = pilot.plan_batch(
            [
                PlanRequest(r.query, prepared.block_texts(i), f"x{i}")
                for i, r in enumerate(prepared.workload.requests)
            ]
        )
    assert [sent for _, sent in engines[1].sent] == [plan.segments for plan in batch.plans]
    assert [r.request_index for r in offline.records] != order  # the offline run reschedules
    assert clairvoyant.method == "clairvoyant-arrival" and clairvoyant.cache is not None
    assert clairvoyant.cached_tokens == clairvoyant.cache.cached_tokens
    # the mode does not change it: it is the offline plan in either
    again = run_method("clairvoyant-arrival", prepared, mode="offline", engine_factory=factory)
    assert engines[3].sent == engines[1].sent and again.records == clairvoyant.records


def test_warm_start_learns_the_first_half_and_serves_only_the_second() -> None:
    lists = [[0, 1, 2], [3, 4], [0, 1, 5], [3, 4, 6], [0, 1, 7], [3, 4, 8], [0, 1, 9]]
    prepared = _prepared(lists)
    sample, served = prepared.halves()
    assert [r.id for r in sample.workload.requests] == ["r0", "r1", "r2"]
    assert [r.id for r in served.workload.requests] == ["r3", "r4", "r5", "r6"]
    assert served.retrieved == prepared.retrieved[3:] and served.layout is prepared.layout
    engines: list[_RecordingEngine] = []

    def factory() -> _RecordingEngine:
        engines.append(_RecordingEngine(None))
        return engines[-1]

    warm = run_warm_started(served, sample, mode="online", engine_factory=factory)
    cold = run_method("contextpilot", served, mode="online", engine_factory=factory)
    assert warm.method == WARM_START and warm.cache is not None
    # only the second half is sent, and nothing learned counts as indexed
    assert [rid for rid, _ in engines[0].sent] == [f"contextpilot-r{i}" for i in range(3, 7)]
    assert warm.index["requests"] == cold.index["requests"] == 4
    with pytest.raises(ValueError, match="mode must be one of"):
        run_warm_started(served, sample, mode="sideways", engine_factory=factory)


def test_run_methods_validation() -> None:
    prepared = _prepared([[0]])
    factory = lambda: EmbeddedEngine(None, counter=COUNTER)  # noqa: E731
    with pytest.raises(ValueError, match="unknown method"):
        run_methods(["fastest"], prepared, mode="offline", engine_factory=factory)
    with pytest.raises(ValueError, match="must not repeat"):
        run_methods(["baseline", "baseline"], prepared, mode="offline", engine_factory=factory)
    with pytest.raises(ValueError, match="mode must be one of"):
        run_method("baseline", prepared, mode="batch", engine_factory=factory)


def test_token_level_engine_with_a_real_tokenizer_interface() -> None:
    """With a tokenizer every token id is a unit: partial-segment overlap counts too."""
    chars = TokenizerCounter(lambda text: [ord(c) for c in text])
    engine = EmbeddedEngine(None, counter=chars, tokenizer=chars)
    a = LAYOUT.render_segments(["shared block", "alpha"], "q1")
    b = LAYOUT.render_segments(["shared block", "alpine"], "q2")
    assert engine.serve("a", a).prompt_tokens == len("".join(a))
    served = engine.serve("b", b)
    common = len(a[0]) + len(a[1]) + len(LAYOUT.label(1) + "\nalp")
    assert served.cached_tokens == common
    prepared = _prepared([[0, 1, 2], [2, 1, 0], [0, 1, 3]])
    prepared.counter = chars
    results = run_methods(
        ["baseline", "contextpilot", "upper-bound"],
        prepared,
        mode="offline",
        engine_factory=lambda: EmbeddedEngine(None, counter=chars, tokenizer=chars),
    )
    assert results[1].cached_tokens > results[0].cached_tokens


class _LinkedEngine(EmbeddedEngine):
    """The embedded model posing as an engine that publishes KV events: it names a KV-event
    endpoint (nobody publishes there) and reports each prompt's token ids, and records the
    runner's ``sync`` calls."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(None, counter=COUNTER)
        self.cache_sync = {"kind": "kv-events", "endpoint": endpoint}
        self.synced: list[ContextPilot | None] = []

    def serve(self, rid: str, segments) -> Served:  # type: ignore[no-untyped-def]
        served = super().serve(rid, segments)
        ids = tuple(ord(c) for c in "".join(segments))
        return Served(served.prompt_tokens, served.cached_tokens, token_ids=ids)

    def sync(self, pilot: ContextPilot | None) -> None:
        self.synced.append(pilot)


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_contextpilot_follows_an_engine_with_cache_sync_through_its_engine_link(
    mode: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("zmq", reason="the engine link needs the sync extra")
    prepared = _prepared([[0, 1, 2], [2, 1, 0], [3, 4]])
    engines: list[_LinkedEngine] = []

    def factory() -> _LinkedEngine:
        engines.append(_LinkedEngine(f"ipc://{tmp_path}/kv-events.ipc"))
        return engines[-1]

    result = run_method("contextpilot", prepared, mode=mode, engine_factory=factory)
    # The default planner was made with the engine's cache_sync, and every prompt's token ids
    # reached its engine link (token-matching attribution).
    sync = result.index["sync"]
    assert sync["cache_model"] == "kv-events"
    assert sync["source"]["mirror"]["tracked_requests"] == 3
    # The runner let the link catch up before the first request and after the last.
    (engine,) = engines
    assert len(engine.synced) == 2 and engine.synced[0] is engine.synced[1] is not None
    # ... and closed the planner it made (the link's subscriber thread is stopped).
    link = engine.synced[0].engine
    assert link is not None and not link.source.subscriber.running  # type: ignore[attr-defined]
    baseline = run_method("baseline", prepared, mode=mode, engine_factory=factory)
    assert engines[1].synced == [None] and "sync" not in baseline.index


def test_the_warm_start_run_serves_the_second_half_beside_clairvoyant_arrival(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "warm.json"
    args = ["--data-dir", str(data_dir), "--workload", "mtrag", "--limit", "80", "--no-plot"]
    assert main([*args, "--mode", "online", "--warm-start", "half", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["run"]["warm_start_requests"] == 40
    rows = {r["method"]: r for r in document["summary"]}
    assert {r["requests"] for r in rows.values()} == {40}
    warm = rows[WARM_START]
    assert warm["vs_clairvoyant_arrival"] == pytest.approx(
        warm["hit_ratio"] / rows["clairvoyant-arrival"]["hit_ratio"]
    )
    text = capsys.readouterr().out
    assert "served the last 40 (warm start learned the first 40)" in text
    assert f"{WARM_START} " in next(x for x in text.splitlines() if "vs clairvoyant" in x)
    windows = ["--arrival", "poisson", "--rate", "1600"]
    assert main([*args, "--warm-start", "half", "--mode", "online", *windows]) == 2
    assert "drop --arrival" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--workload", "mtrag-conversations"], "--workload mtrag-conversations"),
        (["--workload", "mtrag", "--replicas", "2"], "with --replicas"),
    ],
)
def test_warm_start_is_refused_where_it_is_not_measured(
    data_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    argv = ["--data-dir", str(data_dir), "--limit", "8", "--no-plot", "--warm-start", "half"]
    assert main([*argv, *extra]) == 2
    error = capsys.readouterr().err
    assert "--warm-start half" in error and named in error
