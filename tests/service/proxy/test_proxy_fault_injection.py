"""Fault injection through the proxy: fuzzed and concurrent requests of two tenants against a
real ``contextpilot-server --upstream`` in front of an upstream that fails, stalls and
disconnects at random; none lost, none answered with another request's answer, nothing
crossing tenants, and the server healthy and stopped by SIGTERM after (docs/DESIGN.md, "The
proxy", "Never break a request", "Isolation").

The request counts are small in CI; ``CONTEXTPILOT_PROXY_FAULT_REQUESTS=10000`` runs 10,000 +
10,000 (as ``benchmarks/micro/bench_proxy_faults.py`` does by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parents[3] / "benchmarks" / "micro" / "bench_proxy_faults.py"


def test_fuzzed_and_concurrent_requests_with_a_failing_upstream() -> None:
    count = os.environ.get("CONTEXTPILOT_PROXY_FAULT_REQUESTS", "200")
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--fuzzed", count, "--concurrent", count, "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    figures = json.loads(completed.stdout) if completed.stdout.startswith("{") else None
    assert figures is not None, completed.stderr[-3000:]
    print(
        f"{figures['fuzzed_requests']} fuzzed + {figures['concurrent_requests']} concurrent "
        f"requests: {figures['lost']} lost, {figures['wrong_answers']} wrong answers, "
        f"{figures['cross_tenant']} cross-tenant"
    )
    assert figures["fuzzed_requests"] == figures["concurrent_requests"] == int(count)
    failures = figures["failure_examples"]
    assert figures["lost"] == figures["wrong_answers"] == 0, failures
    assert figures["cross_tenant"] == 0 and figures["body_faults"] == {}, figures
    assert figures["usage_plan_mismatches"] == 0 and figures["usage_listed"] > 0, figures
    assert figures["bodies_checked"] >= int(count), figures  # retries are received twice
    assert figures["salts_and_rid_tags_per_tenant"], figures
    assert figures["healthy_after"] and figures["stopped_by_sigterm"], figures
    # Every fault was drawn and answered as it should be.
    outcomes = figures["concurrent_outcomes"]
    for outcome in ("answered", "cut short, as asked", "502 naming the upstream"):
        assert outcomes.get(outcome, 0) > 0, outcomes
    assert completed.returncode == 0, completed.stdout[-3000:]
