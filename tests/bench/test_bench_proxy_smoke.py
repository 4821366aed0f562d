"""The proxy micro-benchmark (``benchmarks/micro/bench_proxy.py``) runs end to end with
``--quick``: a real upstream and a real ``contextpilot-server --upstream`` on 127.0.0.1, every
request answered, and each figure printed beside its target. No figure is asserted against its
target: the targets are for the full run on a quiet machine."""

from __future__ import annotations

import json
import os
import pstats
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "micro" / "bench_proxy.py"
FIGURE_LINES = (
    r"^end-to-end, direct: p50 / p99 +[\d.]+ / [\d.]+ ms",
    r"^end-to-end, proxy: p50 / p99 +[\d.]+ / [\d.]+ ms",
    r"^added by the proxy: p50 +-?[\d.]+ ms +<= 2 ms: (meets|MISSES)$",
    r"^added by the proxy: p99 +-?[\d.]+ ms +<= 10 ms: (meets|MISSES)$",
    r"^streamed, first byte added: p50 +-?[\d.]+ ms +<= 2 ms: (meets|MISSES)$",
    r"^proxy CPU time per request +[\d.]+ ms",
    r"^  its threads' context switches per request +[\d.]+",
    r"^proxy RSS after the warm-up +[\d.]+ MiB",
    r"^proxy RSS after 300 +[\d.]+ MiB",
)


def run_quick(*extra: str) -> str:
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_quick_run_prints_every_figure_beside_its_target() -> None:
    out = run_quick()
    for pattern in FIGURE_LINES:
        assert re.search(pattern, out, re.M), f"no line matching {pattern!r} in:\n{out}"
    assert "failed requests" not in out, out
    assert "include waits for a CPU" in out, out  # the caveat on a machine with few cores


def test_quick_run_as_json_answers_every_request_and_plans_real_work() -> None:
    """With two CPUs or more (Linux), the proxy pinned to the last one, the rest elsewhere."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = ["--cpus-proxy", str(allowed[-1])] if len(allowed) >= 2 else []
    figures = json.loads(run_quick("--json", "--clients", "8", "--think-ms", "5", *pinned))
    if pinned:
        assert figures["pinned"] and figures["cpus_proxy"] == pinned[1]
        assert figures["cpus_upstream"] == figures["cpus_clients"]
        clients = figures["cpus_clients"].replace("-", ",").split(",")
        assert {int(c) for c in clients} <= set(allowed[:-1])
    assert figures["requests"] == 300 and figures["clients"] == 8
    assert figures["errors_direct"] == figures["errors_proxy"] == 0, figures
    assert 0 < figures["streamed"] < figures["requests"]
    assert figures["pointers_per_request"] > 0  # repeated documents became pointers
    assert figures["proxy_switches_per_request"] > 0  # each call wakes a worker thread
    assert 6_000 < figures["mean_prompt_tokens"] < 10_000
    assert [after for after, _ in figures["rss_mb"]] == [0, 30, 75, 150, 225, 300]


def test_profile_proxy_writes_the_event_loops_and_the_worker_threads_profiles(
    tmp_path: Path,
) -> None:
    """The worker threads, where the calls are planned, have a profile of their own."""
    path = tmp_path / "proxy.pstats"
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--requests", "40", "--warmup", "8", "--clients", "8",
         "--think-ms", "5", "--profile-proxy", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    loop = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    threads = pstats.Stats(f"{path}.threads").stats  # type: ignore[attr-defined]
    planned = [f for f in threads if f[0].endswith("message_planner.py") and f[2] == "plan"]
    assert planned and threads[planned[0]][1] >= 40  # every proxied call planned in a thread
    assert not any(f[0].endswith("message_planner.py") and f[2] == "plan" for f in loop)


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--cpus-proxy", "0", "--cpus-rest", "0"], "share CPUs 0"),
        (["--cpus-proxy", "100000"], "CPUs 100000 do not exist"),
        (["--cpus-proxy", "one"], "--cpus-proxy must be CPU numbers"),
        (["--cpus-rest", "0"], "needs --cpus-proxy"),
    ],
)
def test_cpu_lists_that_cannot_be_pinned_are_refused_before_anything_starts(
    flags: list[str], refusal: str
) -> None:
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert completed.returncode == 2 and refusal in completed.stderr, completed.stderr
