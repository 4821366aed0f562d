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
    assert "contextpilot-proxy-smg" in methods_for("smg", "contextpilot-proxy-smg")
