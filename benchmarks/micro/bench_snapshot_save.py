"""Plan latency while the index service saves a large snapshot (plans must not stall on a
save; target: plan p99 <= 10 ms while a 100,000-request snapshot is being saved).

Run: ``.venv/bin/python benchmarks/micro/bench_snapshot_save.py`` (``--requests 20000`` for a
quick run, ``--json`` for machine-readable output). It writes a snapshot of ``--requests``
indexed requests (10 blocks of ~200 tokens each, Zipf-popular over a pool as in
``bench_service.py``) and ``--conversations`` conversations of ``--turns`` turns, then plans
(conversation turns of 10 blocks) from ``--threads`` threads while another thread saves
``--saves`` checkpoints, one after the other. A plan counts as "during a save" when it started
after a save was asked for and before it was answered. Two set-ups:

* **in process**: an :class:`IndexService` restored from the snapshot, ``IndexService.plan``
  on the planning threads, ``save_snapshot`` on the saver: what a save costs plans through
  the locks, the GIL and the garbage collector, with no network and no other process;
* **over HTTP**: ``contextpilot-server --snapshot`` on it, plans through
  :class:`ContextPilotClient`, saves by ``POST /v1/snapshot``; also the server-side time of
  each plan (its ``contextpilot_http_request_duration_seconds`` histogram, during saves). On a
  small shared machine the end-to-end figures include the waits for a CPU of the server's
  event loop (the saver takes a core), which the server-side figure does not.

Figures (milliseconds): plan p50, p99 and max during saves and outside them, the number of
plans in each, and the save durations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig

TARGET_P99_MS = 10.0
POOL = 5_000


def write_large_snapshot(
    path: Path, requests: int, conversations: int, turns: int, seed: int = 0
) -> None:
    """A snapshot of ``requests`` indexed requests and some conversations, saved by the
    service itself (so the file has the service's format)."""
    rng = np.random.default_rng(seed)
    service = IndexService(ServiceConfig(snapshot_path=path, max_requests=requests + 100_000))
    pilot = service.pilot_of()
    p = 1.0 / np.arange(1, POOL + 1)
    p /= p.sum()
    ids = rng.choice(POOL, size=(requests, 10), p=p) * 1_000_003 + 17
    for number, row in enumerate(ids.tolist()):
        blocks = list(dict.fromkeys(row)) + [2**63 + number]  # one block of its own
        pilot.index.insert(f"req-{number}", blocks, [200] * len(blocks))
    for conversation in range(conversations):
        for turn in range(turns):
            texts = [f"c{conversation} t{turn} b{b}: " + "lorem ipsum " * 60 for b in range(10)]
            pilot.plan("q", texts, scope=Scope(f"conversation-{conversation}"))
    service.save_snapshot(final=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, snapshot: Path, max_requests: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextpilot_integrations.service.server",
            "--port",
            str(port),
            "--snapshot",
            str(snapshot),
            "--max-requests",
            str(max_requests),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("contextpilot-server did not start")
        time.sleep(0.1)


def measure(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as directory:
        snapshot = Path(directory) / "index.json"
        started = time.perf_counter()
        write_large_snapshot(snapshot, args.requests, args.conversations, args.turns)
        size = snapshot.stat().st_size
        print(
            f"wrote a {size / 1e6:.1f} MB snapshot of {args.requests} requests and "
            f"{args.conversations} conversations in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
        figures = {"requests": float(args.requests), "snapshot_bytes": float(size)}
        service = IndexService(
            ServiceConfig(snapshot_path=snapshot, max_requests=args.requests + 100_000)
        )

        def plan_in_process(worker: int, number: int) -> None:
            texts, scope = _request(worker, number)
            service.plan(PlanRequest(f"question {number}", texts, scope=scope))

        figures.update(_run("in_process", plan_in_process, service.save_snapshot, args))
        port = free_port()
        server = start_server(port, snapshot, args.requests + 100_000)
        url = f"http://127.0.0.1:{port}"
        clients = [ContextPilotClient(url, fallback=False) for _ in range(args.threads)]
        saver = ContextPilotClient(url, fallback=False, batch_timeout=600)
        try:

            def plan_over_http(worker: int, number: int) -> None:
                texts, scope = _request(worker, number)
                clients[worker].plan(f"question {number}", texts, scope=scope)

            before = _server_histogram(url)
            http = _run("http", plan_over_http, saver.save_snapshot, args)
            after = _server_histogram(url)
            figures.update(http)
            figures.update(_server_side(before, after))
        finally:
            for client in (*clients, saver):
                client.close()
            server.send_signal(signal.SIGTERM)
            server.wait(120)
        figures["load_average_1min"] = os.getloadavg()[0]
        figures["cpus"] = float(os.cpu_count() or 0)
        return figures


def _request(worker: int, number: int) -> tuple[list[str], Scope]:
    texts = [f"w{worker} n{number % 50} b{b}: " + "lorem ipsum " * 60 for b in range(10)]
    return texts, Scope(f"bench-{worker}-{number % 20}")


def _run(
    name: str,
    plan: Callable[[int, int], None],
    save: Callable[[], bool],
    args: argparse.Namespace,
) -> dict[str, float]:
    """Plan from ``args.threads`` threads while ``save`` runs ``args.saves`` times."""
    windows: list[tuple[float, float]] = []
    samples: list[tuple[float, float]] = []  # (start, latency ms)
    done = threading.Event()
    lock = threading.Lock()

    def planner(worker: int) -> None:
        number = 0
        while not done.is_set():
            begin = time.perf_counter()
            plan(worker, number)
            elapsed = (time.perf_counter() - begin) * 1000.0
            with lock:
                samples.append((begin, elapsed))
            number += 1
            time.sleep(args.pause_ms / 1000.0)

    threads = [threading.Thread(target=planner, args=(w,)) for w in range(args.threads)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # warm up outside any save
    for _ in range(args.saves):
        begin = time.perf_counter()
        assert save(), "the save failed"
        windows.append((begin, time.perf_counter()))
        time.sleep(0.5)
    done.set()
    for thread in threads:
        thread.join()

    def during(start: float) -> bool:
        return any(a <= start <= b for a, b in windows)

    inside = np.array([ms for start, ms in samples if during(start)])
    outside = np.array([ms for start, ms in samples if not during(start)])
    saves = [b - a for a, b in windows]
    return {
        f"{name}_save_median_s": float(np.median(saves)),
        f"{name}_plans_during_saves": float(len(inside)),
        f"{name}_during_p50_ms": _percentile(inside, 50),
        f"{name}_during_p99_ms": _percentile(inside, 99),
        f"{name}_during_max_ms": float(inside.max()) if len(inside) else 0.0,
        f"{name}_plans_outside_saves": float(len(outside)),
        f"{name}_outside_p50_ms": _percentile(outside, 50),
        f"{name}_outside_p99_ms": _percentile(outside, 99),
    }


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _server_histogram(url: str) -> dict[float, float]:
    """The server's cumulative ``/v1/plan`` latency buckets (upper bound s -> count)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = (
        r'contextpilot_http_request_duration_seconds_bucket\{endpoint="/v1/plan",'
        r'le="([^"]+)"\} ([0-9.e+]+)'
    )
    return {float(m.group(1)): float(m.group(2)) for m in re.finditer(pattern, text)}


def _server_side(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Share of the plans of the HTTP run that the server answered within 10 ms, and the
    bucket bound below which 99 % of them fall (server-side time: request in to response
    out)."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts[math.inf]
    p99_bound = next((bound for bound, count in counts.items() if count >= 0.99 * total), 0.0)
    return {
        "http_server_within_10ms": counts.get(0.01, 0.0) / total if total else 0.0,
        "http_server_p99_bound_ms": p99_bound * 1000.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="planning client threads")
    parser.add_argument("--pause-ms", type=float, default=2.0, help="between a thread's plans")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(
        f"{args.saves} checkpoints of {int(figures['requests'])} requests "
        f"({figures['snapshot_bytes'] / 1e6:.1f} MB); load average "
        f"{figures['load_average_1min']:.2f} on {int(figures['cpus'])} CPUs"
    )
    for name, title in (("in_process", "in process"), ("http", "over HTTP")):
        p99 = figures[f"{name}_during_p99_ms"]
        verdict = "meets" if p99 <= TARGET_P99_MS else "MISSES"
        print(
            f"{title:10}  saves {figures[f'{name}_save_median_s']:.2f} s each; "
            f"{int(figures[f'{name}_plans_during_saves'])} plans during saves: p50 "
            f"{figures[f'{name}_during_p50_ms']:.2f} ms, p99 {p99:.2f} ms, max "
            f"{figures[f'{name}_during_max_ms']:.2f} ms (target p99 <= {TARGET_P99_MS} ms: "
            f"{verdict}); outside: p50 {figures[f'{name}_outside_p50_ms']:.2f} ms, p99 "
            f"{figures[f'{name}_outside_p99_ms']:.2f} ms"
        )
    print(
        f"over HTTP, server side: {figures['http_server_within_10ms']:.1%} of the plans "
        f"answered within 10 ms; p99 below {figures['http_server_p99_bound_ms']:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
