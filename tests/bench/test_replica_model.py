"""The embedded multi-replica benchmark: the gateway models, the fleet, the figures, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.gateway_policies import (
    CacheAware,
    GatewayRequest,
    InFlight,
    PrefixHash,
    RoundRobin,
)
from contextpilot_bench.methods import (
    PreparedWorkload,
    prepare_workload,
    resolve_cache_tokens,
    run_method,
)
from contextpilot_bench.replica_model import (
    ONE_REPLICA,
    REPLICA_METHODS,
    Fleet,
    gateway_request,
    parse_replica_counts,
    run_embedded_replica_method,
)
from contextpilot_bench.workloads import load_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter

COUNTER = ApproxTokenCounter()


def _request(text: str, head: str | None = None) -> GatewayRequest:
    return GatewayRequest(text, head if head is not None else text[:64])


@pytest.fixture(scope="module")
def prepared(data_dir: Path) -> PreparedWorkload:
    workload = load_workload("multihop-rag", data_dir).head(60)
    return prepare_workload(workload, 10, counter=COUNTER)


# --- the gateway models --------------------------------------------------------------------------


def test_round_robin_alternates() -> None:
    policy = RoundRobin(3)
    assert [policy.route(_request(f"q{i}"), [0, 0, 0]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_cache_aware_pins_a_matching_prompt_above_the_threshold() -> None:
    policy = CacheAware(2)
    shared = "system prompt. " + "a long retrieved document. " * 20
    first = policy.route(_request(shared + "question one?"), [0, 0])
    assert first == 0  # an empty tree: the least loaded, then the least processed, then the first
    # Replica 1 was sent fewer requests, but the prompt shares far more than 30% with replica
    # 0's: it goes there.
    assert policy.route(_request(shared + "question two?"), [0, 0]) == first
    assert policy.pinned == 1
    # Under the threshold (a shared head of a few characters): the least processed replica.
    assert policy.route(_request("system prompt. something else entirely" * 5), [0, 0]) == 1
    matched, owner = policy.match(shared + "question three?")
    assert owner == first and matched == len(shared + "question t")  # "two?"


def test_cache_aware_matches_characters_and_splits_nodes() -> None:
    policy = CacheAware(3)
    policy.route(_request("abcdef"), [0, 0, 0])  # replica 0
    policy.route(_request("xyz"), [0, 0, 0])  # replica 1 (least processed)
    assert policy.match("abcxyz") == (3, 0)  # ends inside "abcdef": split, owner kept
    assert policy.route(_request("abcdeg"), [0, 0, 0]) == 0  # 5/6 matched
    assert policy.match("abcdeg") == (6, 0)
    assert policy.match("nothing") == (0, None)


def test_cache_aware_balances_under_imbalance() -> None:
    policy = CacheAware(2)
    text = "a shared prompt " * 30
    assert policy.route(_request(text), [0, 0]) == 0
    # 100 - 0 > 64 and 100 > 1.5 * 0: imbalanced, the least loaded replica whatever the match.
    assert policy.route(_request(text), [100, 0]) == 1
    assert policy.balanced == 1
    # 100 - 40 = 60 <= 64: balanced, the prefix wins.
    assert policy.route(_request(text), [100, 40]) == 0
    # 200 - 140 > 64 but 200 <= 1.5 * 140: balanced too (both conditions are needed).
    assert policy.route(_request(text), [200, 140]) == 0


def test_prefix_hash_is_stable_for_the_same_head_and_bounded_by_load() -> None:
    policy = PrefixHash(8)
    head = "the same head of 256 tokens"
    replicas = {policy.route(_request(f"{head} tail {i}", head), [0] * 8) for i in range(20)}
    assert len(replicas) == 1
    spread = {policy.ring_replica(f"head {i}") for i in range(200)}
    assert len(spread) == 8  # different heads spread over the ring
    (home,) = replicas
    loads = [1] * 8
    loads[home] = 10  # above 1.25 * (17 + 1) / 8 = 2.8: the least loaded under the bound
    other = policy.route(_request(head, head), loads)
    assert other != home and loads[other] == 1
    assert policy.route(_request(head, head), [2] * 8) == home  # 2 <= 1.25 * 17 / 8


def test_in_flight_keeps_the_last_requests() -> None:
    loads = InFlight(2, concurrency=3)
    for replica in (0, 0, 1, 1):
        loads.routed(replica)
    assert loads.loads == [1, 2]  # the first request completed


def test_gateway_request_head_covers_the_prefix_tokens() -> None:
    segments = ["s" * 40, "b" * 800, "c" * 4000, "tail"]
    request = gateway_request(segments, COUNTER)
    assert request.text == "".join(segments)
    assert COUNTER.count(request.head) == 256  # 10 + 200 tokens, then 46 of the third
    assert request.text.startswith(request.head)


# --- the fleet and the figures -------------------------------------------------------------------


def test_capacity_is_split_evenly() -> None:
    fleet = Fleet(4, 1_003, counter=COUNTER)
    assert [e.model.capacity_tokens for e in fleet.engines] == [250] * 4
    assert Fleet(3, None, counter=COUNTER).capacity_per_replica is None


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_every_method_sends_each_request_once_and_its_figures_add_up(
    prepared: PreparedWorkload, mode: str
) -> None:
    capacity = resolve_cache_tokens(0.5, prepared.unique_block_tokens)
    n = len(prepared.retrieved)
    for method in REPLICA_METHODS:
        run = run_embedded_replica_method(method, prepared, 3, capacity, counter=COUNTER, mode=mode)
        assert sorted(r.request_index for r in run.result.records) == list(range(n))
        assert sum(run.requests_per_replica) == n
        assert sum(run.prompt_tokens_per_replica) == run.result.prompt_tokens
        assert sum(run.cached_tokens_per_replica) == run.result.cached_tokens
        assert run.capacity_per_replica == capacity // 3
        if method == "baseline round_robin":
            assert run.placed == [i % 3 for i in range(n)]
        for hit, cached, prompt in zip(
            run.hit_ratio_per_replica,
            run.cached_tokens_per_replica,
            run.prompt_tokens_per_replica,
            strict=True,
        ):
            assert hit == (cached / prompt if prompt else None)


def test_one_replica_equals_the_single_engine_benchmark(prepared: PreparedWorkload) -> None:
    capacity = resolve_cache_tokens(0.3, prepared.unique_block_tokens)

    def engine() -> EmbeddedEngine:
        return EmbeddedEngine(capacity, counter=COUNTER)

    baseline = run_method("baseline", prepared, mode="online", engine_factory=engine)
    pilot = run_method("contextpilot", prepared, mode="online", engine_factory=engine)
    for method in REPLICA_METHODS[:3]:
        run = run_embedded_replica_method(method, prepared, 1, capacity, counter=COUNTER)
        assert run.result.cached_tokens == baseline.cached_tokens
    reference = run_embedded_replica_method(ONE_REPLICA, prepared, 1, capacity, counter=COUNTER)
    routing = run_embedded_replica_method(
        "contextpilot routing", prepared, 1, capacity, counter=COUNTER
    )
    assert reference.result.cached_tokens == pilot.cached_tokens == routing.result.cached_tokens


def test_routing_beats_the_baseline_on_many_replicas(prepared: PreparedWorkload) -> None:
    capacity = resolve_cache_tokens(1.0, prepared.unique_block_tokens)
    runs = {
        m: run_embedded_replica_method(m, prepared, 4, capacity, counter=COUNTER)
        for m in ("baseline cache_aware", "contextpilot routing")
    }
    assert runs["contextpilot routing"].hit_ratio > 2 * runs["baseline cache_aware"].hit_ratio


def test_parse_replica_counts() -> None:
    assert parse_replica_counts("1, 2,8,32") == [1, 2, 8, 32]
    for bad in ("", "0", "2,x", "2,2"):
        with pytest.raises(ValueError):
            parse_replica_counts(bad)


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_replicas_prints_tables_targets_json_and_plot(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, plot = tmp_path / "replicas.json", tmp_path / "replicas.png"
    args = ["--data-dir", str(data_dir), "--limit", "40", "--replicas", "1,2"]
    assert main([*args, "--cache-tokens", "0.5", "--out", str(out), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "mode online; replicas 1,2" in text
    assert "targets at 2 replica(s):" in text and "CP routing / CP via cache_aware" in text
    document = json.loads(out.read_text())
    rows = [r for r in document["summary"] if r["replicas"] == 2]
    assert [r["method"] for r in rows] == list(REPLICA_METHODS)
    assert all(r["requests"] == 40 for r in document["summary"])
    detail = [r for r in document["runs"] if r["replicas"] == 2]
    assert all(sum(r["requests_per_replica"]) == 40 for r in detail)
    target = document["targets"]["2"]
    routing = next(r for r in rows if r["method"] == "contextpilot routing")
    reference = document["summary"][0]
    assert reference["method"] == ONE_REPLICA
    assert target["routing_vs_one_replica"] == pytest.approx(
        routing["hit_ratio"] / reference["hit_ratio"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_replicas_rejects_bad_input(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-dir", str(data_dir), "--replicas", "2,0"])
    assert exit_info.value.code == 2
    code = main(
        ["--data-dir", str(data_dir), "--workload", "mtrag-conversations", "--replicas", "2"]
    )
    assert code == 2
    assert "single-turn workload" in capsys.readouterr().err
