"""The parts of the two-replica benchmark that need no engine: vLLM's ``/metrics`` counters read
and differenced, each replica's share of the total KV cache, the methods a run chooses, and the
``smg`` binary's lookup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from contextpilot_bench.replicas_vllm import replica_blocks
from contextpilot_bench.testbed.locations import SMG_ENV, find_smg, require_smg
from contextpilot_bench.vllm_metrics import WorkerCounters, parse_worker_counters
from contextpilot_bench.vllm_replica_methods import methods_for

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 4100.0
vllm:generation_tokens_total{engine="0",model_name="m"} 4.0
"""


def test_counters_are_summed_over_labels_and_differenced() -> None:
    counters = parse_worker_counters(METRICS)
    assert counters == WorkerCounters(requests=4, prompt_tokens=4100, queries=4096, hits=1024)
    assert counters.hit_ratio == 0.25
    later = WorkerCounters(requests=10, prompt_tokens=9000, queries=8192, hits=3072)
    assert later.minus(counters) == WorkerCounters(6, 4900, 4096, 2048)
    assert WorkerCounters().hit_ratio is None


def test_a_server_without_the_prefix_cache_counters_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache_hits_total"):
        parse_worker_counters(METRICS.replace("vllm:prefix_cache_hits_total", "other"))


def test_each_replica_gets_its_share_raised_to_one_request() -> None:
    assert replica_blocks(100, 2, 40) == (50, False)
    assert replica_blocks(101, 2, 40) == (51, False)
    assert replica_blocks(60, 2, 40) == (40, True)


def test_the_methods_follow_the_router_unless_named() -> None:
    assert methods_for("smg", None)[-1] == "contextpilot-routed-smg"
    assert methods_for("direct", None) == [
        "baseline-round_robin",
        "baseline-cache_aware",
        "contextpilot-cache_aware",
        "contextpilot-routed-direct",
    ]
    both = "contextpilot-routed-smg,contextpilot-routed-direct"
    assert methods_for("smg", both) == both.split(",")
    with pytest.raises(ValueError, match="--router"):
        methods_for("nginx", None)
    with pytest.raises(ValueError, match="unknown"):
        methods_for("smg", "baseline")
    with pytest.raises(ValueError, match="repeat"):
        methods_for("smg", "baseline-cache_aware,baseline-cache_aware")


def test_the_smg_binary_is_found_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "smg"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_smg(binary) == binary
    monkeypatch.setenv(SMG_ENV, str(binary))
    assert find_smg() == binary
    monkeypatch.setenv(SMG_ENV, str(tmp_path / "missing"))
    assert find_smg() is None  # a configured path is taken as given
    with pytest.raises(FileNotFoundError, match="setup-smg-env.sh"):
        require_smg()
    monkeypatch.delenv(SMG_ENV)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    found = find_smg()
    assert found is not None and found.name == "smg"


def test_the_proxy_method_is_judged_on_hit_ratio_and_median_ttft() -> None:
    from contextpilot_bench.vllm_replica_report import vllm_replica_target_lines

    reference = {"method": "contextpilot-cache_aware", "hit_ratio": 0.30,
                 "one_replica_model_hit": 0.40, "ttft_p50_s": 0.200}  # fmt: skip
    proxy = {"method": "contextpilot-proxy-smg", "hit_ratio": 0.38, "ttft_p50_s": 0.250,
             "prompt_tokens_max_over_min": 1.1}  # fmt: skip
    lines = vllm_replica_target_lines([reference, proxy])
    assert "contextpilot-proxy-smg: median TTFT 0.250 s = 1.25x" in lines[0]
    assert lines[0].endswith("(<= 1: MISSED)")
    assert "= 0.95 of one-replica ContextPilot 0.4000" in lines[1] and lines[1].endswith("ok)")
    assert not any("same arrivals" in line for line in lines)
    fair = vllm_replica_target_lines([reference, proxy], same_arrival_one_replica=0.50)
    assert fair[:2] == lines[:2]  # the line against the offline reference stays
    assert "= 0.76 of one-replica ContextPilot at the same arrivals and window 0.5000" in fair[2]
    assert fair[2].endswith("(>= 0.9: MISSED)")
    assert "contextpilot-proxy-smg" in methods_for("smg", "contextpilot-proxy-smg")


def test_requests_go_at_their_arrival_times_with_a_bounded_number_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import time

    from contextpilot_bench import vllm_replica_methods
    from contextpilot_bench.arrivals import poisson_arrivals
    from contextpilot_bench.vllm_replica_methods import AnsweredRequest, send_requests

    monkeypatch.setattr(vllm_replica_methods, "MAX_USERS", 3)
    lock = threading.Lock()
    in_flight, most, sent_at = [0], [0], {}
    start = time.perf_counter()

    def send(i: int) -> AnsweredRequest:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            sent_at[i] = time.perf_counter() - start
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return AnsweredRequest(i, f"r{i}", 10, 0, 0.01, None, ())

    ticks = []
    order = [4, 0, 3, 1, 2, 5, 7, 6]
    # A burst: every request at once, at most 3 in flight; answers in the order given.
    burst = send_requests(order, send, poisson_arrivals(8, 1e6), lambda: ticks.append(1))
    assert [a.request_index for a in burst] == order and len(ticks) == 8
    assert most[0] == 3
    # One at a time without an arrival process.
    most[0] = 0
    alone = send_requests(order[:3], send, None, None)
    assert [a.request_index for a in alone] == order[:3] and most[0] == 1
    # A slow process: each request waits for its time.
    arrivals = poisson_arrivals(3, 10.0, seed=1)
    start = time.perf_counter()
    send_requests([0, 1, 2], send, arrivals, None)
    due = [float(t - arrivals.times_s[0]) for t in arrivals.times_s]
    assert all(sent_at[i] >= due[i] - 0.005 for i in range(3)), (sent_at, due)
