"""Latency the index service adds to one plan over loopback, against the in-process call.

Run: ``.venv/bin/python benchmarks/micro/bench_service.py`` (``--quick`` for fewer requests,
``--json`` for machine-readable output). It starts ``contextpilot-server`` (``python -m
contextpilot_integrations.service.server``, one uvicorn worker) on 127.0.0.1, and sends the
same request stream to it through :class:`ContextPilotClient` and to an in-process
:class:`ContextPilot`, so both indexes go through the same states. The two are measured in
alternating rounds, so that load from other processes on the machine hits both alike.

Workload: synthetic requests of ``--blocks`` blocks (default 10) of about ``--block-tokens``
tokens (default 200, ~800 bytes) drawn with Zipf popularity from 5,000 block texts (p(rank r)
proportional to 1/r), so requests share prefixes as retrieved contexts do.

Figures (milliseconds):

* in-process ``ContextPilot.plan``: median and p99;
* service ``ContextPilotClient.plan`` (HTTP POST, JSON both ways, the plan rebuilt as the
  core's ``Plan``): median and p99;
* added latency = service median - in-process median; **target <= 1 ms**;
* the same in CPU time per plan (client process + server process - in-process; the server's
  from ``/proc/<pid>/stat``, so Linux only), which does not depend on what else runs on the
  machine: on a shared, loaded machine the wall-clock figures include the waits for a CPU at
  each of the two process wake-ups of a round trip, which the in-process call does not have;
* where it goes: a bare HTTP round trip (``GET /health`` through httpx), the server's JSON
  encoding of a plan and the client's decoding of it, each measured alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import httpx
import numpy as np
import pydantic_core

from contextpilot_integrations import ContextPilot, PromptLayout
from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.client.schemas import PlanResponse

TARGET_ADDED_MS = 1.0
POOL = 5_000


def synthetic_requests(n: int, blocks: int, block_tokens: int, seed: int) -> list[list[str]]:
    """``n`` requests of ``blocks`` distinct block texts, Zipf-popular over a pool."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, POOL + 1)
    p /= p.sum()
    filler = "lorem ipsum " * max(1, block_tokens * 4 // 12)  # ~4 bytes per token
    out = []
    for row in rng.choice(POOL, size=(n, 4 * blocks), p=p):
        ids = list(dict.fromkeys(row.tolist()))[:blocks]
        out.append([f"block {i}: {filler}" for i in ids])
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextpilot_integrations.service.server",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("contextpilot-server did not start")
        time.sleep(0.05)


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def measure(args: argparse.Namespace) -> dict[str, float]:
    requests = synthetic_requests(args.warmup + args.requests, args.blocks, args.block_tokens, 0)
    queries = [f"question {i}?" for i in range(len(requests))]
    port = free_port()
    server = start_server(port)
    try:
        local = ContextPilot()
        with ContextPilotClient(f"http://127.0.0.1:{port}", fallback=False) as client:
            for i in range(args.warmup):  # both indexes go through the same states
                local.plan(queries[i], requests[i], rid=f"w{i}")
                client.plan(queries[i], requests[i], rid=f"w{i}")
            in_process: list[float] = []
            service: list[float] = []
            cpu = {"in_process": 0.0, "client": 0.0, "server": 0.0}
            rounds = max(1, args.requests // args.round_size)
            for r in range(rounds):
                span = range(
                    args.warmup + r * args.round_size, args.warmup + (r + 1) * args.round_size
                )
                started = time.process_time()
                for i in span:
                    in_process.append(timed(lambda i=i: local.plan(queries[i], requests[i])))
                cpu["in_process"] += time.process_time() - started
                started, server_started = time.process_time(), _cpu_s(server.pid)
                for i in span:
                    service.append(timed(lambda i=i: client.plan(queries[i], requests[i])))
                cpu["client"] += time.process_time() - started
                cpu["server"] += _cpu_s(server.pid) - server_started
            http = httpx.Client()
            health_url = f"http://127.0.0.1:{port}/health"
            round_trip = [timed(lambda: http.get(health_url)) for _ in range(500)]
            http.close()
        sample = local.plan(queries[0], requests[0])
        encoded = pydantic_core.to_json(PlanResponse.encode(sample))
        layout = PromptLayout()
        encode_ms = [
            timed(lambda: pydantic_core.to_json(PlanResponse.encode(sample))) for _ in range(500)
        ]
        decode_ms = [
            timed(lambda: PlanResponse.model_validate_json(encoded).to_core(layout))
            for _ in range(500)
        ]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    in_median = statistics.median(in_process)
    service_median = statistics.median(service)
    per_plan_ms = {name: seconds * 1000.0 / len(service) for name, seconds in cpu.items()}
    return {
        "requests": float(len(service)),
        "blocks": float(args.blocks),
        "plan_bytes": float(len(encoded)),
        "in_process_median_ms": in_median,
        "in_process_p99_ms": percentile(in_process, 99),
        "service_median_ms": service_median,
        "service_p99_ms": percentile(service, 99),
        "added_median_ms": service_median - in_median,
        "in_process_cpu_ms": per_plan_ms["in_process"],
        "client_cpu_ms": per_plan_ms["client"],
        "server_cpu_ms": per_plan_ms["server"],
        "added_cpu_ms": per_plan_ms["client"] + per_plan_ms["server"] - per_plan_ms["in_process"],
        "http_round_trip_median_ms": statistics.median(round_trip),
        "server_encode_median_ms": statistics.median(encode_ms),
        "client_decode_median_ms": statistics.median(decode_ms),
        "load_average_1min": os.getloadavg()[0],
        "cpus": float(os.cpu_count() or 0),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--round-size", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block-tokens", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="400 requests")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.warmup = 400, 100
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    verdict = "meets" if figures["added_median_ms"] <= TARGET_ADDED_MS else "MISSES"
    print(
        f"{int(figures['requests'])} plans of {args.blocks} blocks (~{args.block_tokens} tokens "
        f"each, {int(figures['plan_bytes'])}-byte plan JSON); load average "
        f"{figures['load_average_1min']:.2f} on {int(figures['cpus'])} CPUs"
    )
    print(
        f"in-process plan      median {figures['in_process_median_ms']:.3f} ms, "
        f"p99 {figures['in_process_p99_ms']:.3f} ms"
    )
    print(
        f"service plan         median {figures['service_median_ms']:.3f} ms, "
        f"p99 {figures['service_p99_ms']:.3f} ms"
    )
    print(
        f"added by the service median {figures['added_median_ms']:.3f} ms "
        f"(target <= {TARGET_ADDED_MS} ms: {verdict})"
    )
    cpu_verdict = "meets" if figures["added_cpu_ms"] <= TARGET_ADDED_MS else "MISSES"
    print(
        f"added CPU per plan   {figures['added_cpu_ms']:.3f} ms (client "
        f"{figures['client_cpu_ms']:.3f} + server {figures['server_cpu_ms']:.3f} - in-process "
        f"{figures['in_process_cpu_ms']:.3f}; target <= {TARGET_ADDED_MS} ms: {cpu_verdict})"
    )
    print(
        f"  of which: bare HTTP round trip {figures['http_round_trip_median_ms']:.3f} ms, "
        f"server JSON encode {figures['server_encode_median_ms']:.3f} ms, "
        f"client decode to Plan {figures['client_decode_median_ms']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
