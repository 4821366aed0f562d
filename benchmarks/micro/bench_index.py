"""Speed and memory of the context index, each figure printed beside its target.

Run: ``.venv/bin/python benchmarks/micro/bench_index.py`` (``--quick`` skips the 100,000-context
build). Workload: synthetic contexts of k=15 blocks drawn from 50,000 block ids with Zipf
popularity (p(rank r) proportional to 1/r), each block 200 tokens.

Figures:
* offline build of 2,000 contexts (``ContextPilot.plan_batch``: ordering, index inserts,
  schedule and rendering), median of 5 runs, target <= 0.5 s;
* offline build of 100,000 contexts, wall time and peak memory (RSS of a child process),
  targets <= 60 s and <= 4 GB;
Each timing is also given in CPU seconds, which other processes on a busy machine do not inflate.

* online hot path (search, align, insert, annotate, render: ``ContextPilot.plan``) with
  10,000 contexts already indexed: median and p99 per request, targets <= 0.2 ms and
  <= 2 ms; and the same with 100,000 indexed, to show the cost does not grow with the index.

``--against REV --runs N`` prints only the 10,000-indexed hot path's CPU median, ``N`` times
for the library at git revision ``REV`` and for the working tree's, alternating (each run a
fresh process), with the median of each and their ratio: a change's effect measured in one
session, where the load of a shared machine moves a single figure by more than the change.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.request import PlanRequest

BLOCKS = 50_000
K = 15


def synthetic_requests(n: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, BLOCKS + 1)
    p /= p.sum()
    draws = rng.choice(BLOCKS, size=(n, 4 * K), p=p)
    body = "lorem ipsum " * 66  # ~200 tokens by the default counter
    out = []
    for row in draws:
        ids = list(dict.fromkeys(row.tolist()))[:K]
        out.append([f"block {i}: {body}" for i in ids])
    return out


def build_seconds(n: int, seed: int = 0) -> tuple[float, float]:
    """Wall and CPU seconds of ``plan_batch`` over ``n`` synthetic contexts (one batch)."""
    requests = [
        PlanRequest(f"q{i}", blocks) for i, blocks in enumerate(synthetic_requests(n, seed))
    ]
    pilot = ContextPilot(max_requests=None)
    start, start_cpu = time.perf_counter(), time.process_time()
    pilot.plan_batch(requests)
    return time.perf_counter() - start, time.process_time() - start_cpu


def child_build(n: int) -> None:
    """Run in a child process so its peak RSS is the build's alone."""
    seconds, cpu = build_seconds(n)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_gb": peak_kib / 1024**2}))


def hot_path(indexed: int, probes: int = 2_000) -> tuple[float, float, float, float]:
    """Median and p99 per ``plan()`` in ms: wall clock, then this thread's CPU time."""
    pilot = ContextPilot(max_requests=None)
    for i, blocks in enumerate(synthetic_requests(indexed, seed=1)):
        pilot.plan(f"warm {i}", blocks)
    probe_requests = synthetic_requests(probes, seed=2)
    times, cpu_times = [], []
    for i, blocks in enumerate(probe_requests):
        start, start_cpu = time.perf_counter(), time.thread_time()
        pilot.plan(f"probe {i}", blocks)
        cpu_times.append(time.thread_time() - start_cpu)
        times.append(time.perf_counter() - start)
    ms, cpu_ms = np.array(times) * 1000, np.array(cpu_times) * 1000
    return (
        float(np.median(ms)),
        float(np.percentile(ms, 99)),
        float(np.median(cpu_ms)),
        float(np.percentile(cpu_ms, 99)),
    )


def child_hot_path() -> None:
    """Run in a child process: the 10,000-indexed hot path of the library on its path."""
    import contextpilot_integrations

    cpu_median = hot_path(10_000)[2]
    print(json.dumps({"cpu_median": cpu_median, "library": contextpilot_integrations.__file__}))


def against(revision: str, runs: int) -> None:
    """The hot path's CPU median at ``revision`` and in the working tree, alternating."""
    repo = Path(__file__).resolve().parents[2]
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", revision, "contextpilot_integrations"],
        check=True,
        capture_output=True,
    ).stdout
    medians: dict[str, list[float]] = {revision: [], "working tree": []}
    with tempfile.TemporaryDirectory() as copy:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            # The archive is this repository's own; ``data`` is the safe filter where it exists.
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(copy, **safe)  # type: ignore[arg-type]
        for _ in range(runs):
            for name, root in ((revision, copy), ("working tree", str(repo))):
                out = subprocess.run(
                    [sys.executable, __file__, "--child-hot-path"],
                    check=True,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": root},
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                if not result["library"].startswith(root):
                    raise RuntimeError(f"{name} ran the library at {result['library']}")
                medians[name].append(result["cpu_median"])
    for name, values in medians.items():
        listed = " ".join(f"{v:.3f}" for v in values)
        print(f"{name}: CPU median per plan() {statistics.median(values):.3f} ms ({listed})")
    ratio = statistics.median(medians["working tree"]) / statistics.median(medians[revision])
    print(f"working tree / {revision}: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 100,000-context build")
    parser.add_argument("--against", metavar="REV", help="compare the hot path with git REV")
    parser.add_argument("--runs", type=int, default=6, help="runs of each with --against")
    parser.add_argument("--child-build", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-hot-path", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_build:
        child_build(args.child_build)
        return
    if args.child_hot_path:
        child_hot_path()
        return
    if args.against:
        against(args.against, args.runs)
        return

    rows = []
    build_seconds(200)  # warm imports and numpy
    runs = [build_seconds(2_000, seed) for seed in range(5)]
    wall = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    rows.append(("offline build, 2,000 contexts (median of 5)", f"{wall:.3f} s", "<= 0.5 s"))
    rows.append(("  CPU time", f"{cpu:.3f} s", ""))
    if not args.quick:
        out = subprocess.run(
            [sys.executable, __file__, "--child-build", "100000"],
            check=True,
            capture_output=True,
            text=True,
        )
        big = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(("offline build, 100,000 contexts", f"{big['seconds']:.1f} s", "<= 60 s"))
        rows.append(("  CPU time", f"{big['cpu']:.1f} s", ""))
        rows.append(("  peak memory (RSS)", f"{big['peak_gb']:.2f} GB", "<= 4 GB"))
    for indexed in (10_000, 100_000) if not args.quick else (10_000,):
        median, p99, cpu_median, cpu_p99 = hot_path(indexed)
        label = f"online plan(), {indexed:,} indexed"
        rows.append((f"{label}: median", f"{median:.3f} ms", "<= 0.2 ms"))
        rows.append((f"{label}: p99", f"{p99:.3f} ms", "<= 2 ms"))
        rows.append(("  CPU time: median / p99", f"{cpu_median:.3f} / {cpu_p99:.3f} ms", ""))

    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} CPUs; wall-clock")
    print("figures are inflated when other processes compete for the cores, CPU times are not")
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>12}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>12}  {target}")


if __name__ == "__main__":
    main()
