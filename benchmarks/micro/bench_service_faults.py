"""Hangs and server errors of the index service under fuzzed and concurrent requests, with a
hostile KV-event stream running at the same time (target: 0 hangs and 0 server errors across at
least 10,000 fuzzed and 10,000 concurrent requests).

Run: ``.venv/bin/python benchmarks/micro/bench_service_faults.py`` (defaults: 10,000 + 10,000;
``--fuzzed 500 --concurrent 500`` for a quick run, ``--json`` for machine-readable output;
``tests/service/test_fault_injection.py`` runs a small one in CI).

Set-up: ``contextpilot-server`` with two tenants (a key file), a KV-event stream from a
protocol publisher (:class:`~contextpilot_integrations.sync.event_publisher.KVEventPublisher`),
a snapshot saved every half second and a small index bound (LRU evictions all along). A
hostile thread publishes, in a loop, blocks that are their own parent, pairs that name each
other, their removal, msgpack nested 1,100 deep, garbage payloads, frames of the wrong shape
and absurd sequence numbers, between valid stores and removals of the planned requests.

* **fuzzed**: mutated valid bodies (fields dropped, retyped, nested deep, huge numbers, unknown
  fields, lone surrogates, truncated or non-JSON bodies, another tenant's name) to every
  endpoint, unknown paths and methods, with alice's, bob's, a wrong or no key; 32 at a time.
* **concurrent**: valid requests (plans with conversations, batches, evictions, usage, forgets,
  statistics, metrics, health, snapshots) from both tenants, 128 at a time.

A request that gets no answer within ``--timeout`` seconds is a hang; a 5xx is a server error.
At the end ``/health`` must answer within a second and SIGTERM must stop the server with its
snapshot saved.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

KEYS = {"alice": "alice-fault-key-7c1e", "bob": "bob-fault-key-93ab"}
ENDPOINTS = [
    ("POST", "/v1/plan"),
    ("POST", "/v1/plan_batch"),
    ("POST", "/v1/evict"),
    ("POST", "/v1/conversations/forget"),
    ("POST", "/v1/usage"),
    ("POST", "/v1/snapshot"),
    ("GET", "/v1/layout"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("GET", "/openapi.json"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Bodies
# --------------------------------------------------------------------------------------------


def valid_body(path: str, rng: random.Random, worker: int) -> Any:
    """A valid body for ``path``."""
    words = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(5, 40)))
    blocks = [f"passage {rng.randrange(200)}: {words}" for _ in range(rng.randrange(1, 8))]
    scope: dict[str, Any] = {}
    if rng.random() < 0.5:
        scope["conversation_id"] = f"chat-{worker}-{rng.randrange(4)}"
        if rng.random() < 0.3:
            scope["turn"] = rng.randrange(1, 20)
    rid = f"rid-{worker}-{rng.randrange(10**9)}"
    if path == "/v1/plan":
        return {"query": "question?", "blocks": blocks, "rid": rid, "scope": scope}
    if path == "/v1/plan_batch":
        return {
            "requests": [
                {"query": f"q{i}", "blocks": blocks[i:] or ["x"], "rid": f"{rid}-{i}"}
                for i in range(rng.randrange(0, 4))
            ]
        }
    if path == "/v1/evict":
        return {"rid": f"rid-{worker}-{rng.randrange(10**9)}"}
    if path == "/v1/conversations/forget":
        return {"conversation_id": f"chat-{worker}-{rng.randrange(4)}"}
    if path == "/v1/usage":
        prompt = rng.randrange(0, 10_000)
        return {"rid": rid, "prompt_tokens": prompt, "cached_tokens": rng.randrange(prompt + 1)}
    if path == "/v1/snapshot":
        return {}
    return None


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


_ODD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    -(2**70),
    1e308,
    -0.0,
    1.5,
    "",
    "x" * 600,
    "\u0000",
    "é\u202e",
    [],
    {},
    ["a", 1, None],
    {"turn": 1},
]


def _odd(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.05:
        return _nested(rng.choice([50, 300, 600]))
    if roll < 0.08:
        return ["block"] * rng.randrange(1, 3_000)
    return copy.deepcopy(rng.choice(_ODD_VALUES))


def mutate(body: Any, rng: random.Random) -> Any:
    """A mutated copy of a JSON value (one to three mutations at random places)."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        body = _mutate_once(body, rng)
    return body


def _mutate_once(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        action = rng.random()
        if action < 0.25:
            del value[key]
        elif action < 0.35:
            value[f"extra_{rng.randrange(9)}"] = _odd(rng)
        elif action < 0.45 and key in ("scope", "tenant") or action < 0.5:
            value[key] = _odd(rng)
        else:
            value[key] = _mutate_once(value[key], rng)
        if rng.random() < 0.1:  # another tenant's name
            value.setdefault("scope", {})
            if isinstance(value["scope"], dict):
                value["scope"]["tenant"] = rng.choice(["bob", "alice", "mallory"])
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        index = rng.randrange(len(value))
        value[index] = _mutate_once(value[index], rng) if rng.random() < 0.6 else _odd(rng)
        return value
    return _odd(rng)


def fuzzed_request(
    rng: random.Random, worker: int
) -> tuple[str, str, bytes | None, dict[str, str]]:
    """method, path, raw body, headers of one fuzzed request."""
    method, path = rng.choice(ENDPOINTS)
    if rng.random() < 0.05:
        path = rng.choice(["/v1/nothing", "/v1/plan/x", "/../etc/passwd", "/v1/%ff", "/docs"])
    if rng.random() < 0.05:
        method = rng.choice(["PUT", "DELETE", "PATCH", "GET", "POST"])
    body = valid_body(path, rng, worker)
    roll = rng.random()
    if roll < 0.05 and path in ("/v1/plan", "/v1/conversations/forget"):  # as another tenant
        target = body.setdefault("scope", {}) if path == "/v1/plan" else body
        target["tenant"] = rng.choice(["alice", "bob", "mallory"])
        raw: bytes | None = json.dumps(body).encode()
    elif roll < 0.7:
        raw = json.dumps(mutate(body, rng)).encode()
    elif roll < 0.78:
        raw = json.dumps(body).encode()[: rng.randrange(1, 40)]  # truncated
    elif roll < 0.84:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # not JSON
    elif roll < 0.87:
        raw = b'{"query": "\\ud800", "blocks": ["\\udfff"]}'  # lone surrogates
    elif roll < 0.9:
        depth = rng.choice([2_000, 50_000])  # nested deeper than any parser recursion
        raw = b'{"query": "q", "blocks": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        raw = None if body is None else json.dumps(body).encode()
    key = rng.choice([KEYS["alice"], KEYS["bob"], "wrong-key", None])
    headers = {"content-type": rng.choice(["application/json", "text/plain", "application/x"])}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return method, path, raw, headers


def concurrent_request(
    rng: random.Random, worker: int
) -> tuple[str, str, bytes | None, dict[str, str]]:
    method, path = rng.choices(ENDPOINTS, weights=[40, 8, 8, 4, 8, 1, 3, 4, 2, 6, 1])[0]
    body = valid_body(path, rng, worker)
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer {KEYS[rng.choice(['alice', 'bob'])]}",
    }
    return method, path, None if body is None else json.dumps(body).encode(), headers


# --------------------------------------------------------------------------------------------
# The hostile event stream
# --------------------------------------------------------------------------------------------


def hostile_events(engine: KVEventPublisher, stop: threading.Event, rng: random.Random) -> int:
    """Publish hostile and valid traffic until ``stop``; returns the batches sent."""
    sent = 0
    next_hash = 10_000
    while not stop.is_set():
        next_hash += 10
        h = next_hash
        choice = sent % 7
        if choice == 0:  # a block that is its own parent, a pair naming each other, removal
            events: list[KVEvent] = [
                BlockStored(block_hashes=[h], parent_block_hash=h, session_id="x"),
                BlockStored(block_hashes=[h + 1], parent_block_hash=h + 2),
                BlockStored(block_hashes=[h + 2], parent_block_hash=h + 1),
                BlockRemoved(block_hashes=[h, h + 1, h + 2]),
            ]
            engine.publish(KVEventBatch(ts=time.time(), events=events))
        elif choice == 1:  # msgpack nested 1,100 deep
            engine.publish_payload(b"\x91" * 1_100 + b"\x00")  # fixarray of one, 1,100 deep
        elif choice == 2:  # garbage
            engine.publish_payload(bytes(rng.randrange(256) for _ in range(64)))
        elif choice == 3:  # frames of the wrong shape, an absurd sequence number
            engine.send_raw_frames([b"", (2**64 - 1).to_bytes(8, "big"), b"\xc1"])
            engine.send_raw_frames([b"only one frame"])
        else:  # valid stores and removals
            stored = BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, session_id="y")
            engine.publish(KVEventBatch(ts=time.time(), events=[stored]))
            engine.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[h])]))
        sent += 1
        stop.wait(0.005)
    return sent


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


async def _drive(
    url: str, count: int, concurrency: int, fuzz: bool, timeout_s: float, seed: int
) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for number in range(count):
        queue.put_nowait(number)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def worker(number: int) -> None:
            rng = random.Random(seed * 1_000 + number)
            while not queue.empty():
                queue.get_nowait()
                build = fuzzed_request if fuzz else concurrent_request
                method, path, raw, headers = build(rng, number)
                try:
                    response = await client.request(method, path, content=raw, headers=headers)
                except httpx.TimeoutException:
                    outcomes["hang"] += 1
                    continue
                except httpx.TransportError as exc:
                    outcomes[f"transport error {type(exc).__name__}"] += 1
                    continue
                outcomes[str(response.status_code)] += 1

        await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return outcomes


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as directory:
        keys = Path(directory) / "keys.json"
        keys.write_text(json.dumps({"tenants": {t: {"keys": [k]} for t, k in KEYS.items()}}))
        snapshot = Path(directory) / "index.json"
        publisher, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with KVEventPublisher(publisher, replay) as engine:
            server = subprocess.Popen(
                [
                    sys.executable, "-m", "contextpilot_integrations.service.server",
                    "--port", str(port), "--api-keys", str(keys),
                    "--kv-events", publisher, "--kv-events-replay", replay,
                    "--snapshot", str(snapshot), "--snapshot-interval", "0.5",
                    "--max-requests", "2000", "--shutdown-timeout", "5",
                    "--log-level", "error",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                _wait_healthy(url, server)
                stop = threading.Event()
                sent: list[int] = []
                hostile = threading.Thread(
                    target=lambda: sent.append(hostile_events(engine, stop, random.Random(1)))
                )
                hostile.start()
                started = time.perf_counter()
                fuzzed = asyncio.run(_drive(url, args.fuzzed, 32, True, args.timeout, args.seed))
                fuzz_s = time.perf_counter() - started
                started = time.perf_counter()
                concurrent = asyncio.run(
                    _drive(url, args.concurrent, 128, False, args.timeout, args.seed)
                )
                concurrent_s = time.perf_counter() - started
                stop.set()
                hostile.join()
                health_started = time.perf_counter()
                healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
                health_s = time.perf_counter() - health_started
            finally:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(60)
                    exit_code: int | None = server.returncode
                except subprocess.TimeoutExpired:
                    server.kill()
                    exit_code = None
            log = server.stderr.read().decode(errors="replace") if server.stderr else ""
        saved = json.loads(snapshot.read_text()).get("final") if snapshot.exists() else None
    both = fuzzed + concurrent
    return {
        "fuzzed_requests": sum(fuzzed.values()),
        "concurrent_requests": sum(concurrent.values()),
        "hangs": both["hang"],
        "server_errors": sum(n for status, n in both.items() if status.startswith("5")),
        "transport_errors": sum(n for status, n in both.items() if status.startswith("transport")),
        "fuzzed_statuses": dict(sorted(fuzzed.items())),
        "concurrent_statuses": dict(sorted(concurrent.items())),
        "fuzzed_s": fuzz_s,
        "concurrent_s": concurrent_s,
        "hostile_event_batches": sent[0] if sent else 0,
        "healthy_after": healthy and health_s < 1.0,
        "stopped_by_sigterm": exit_code in (0, -signal.SIGTERM),
        "final_snapshot_saved": saved is True,
        "server_log_tail": log[-2000:],
    }


def _wait_healthy(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("contextpilot-server did not start")
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzzed", type=int, default=10_000)
    parser.add_argument("--concurrent", type=int, default=10_000)
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds: longer is a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    verdict = "meets" if figures["hangs"] == 0 and figures["server_errors"] == 0 else "MISSES"
    print(
        f"{figures['fuzzed_requests']} fuzzed requests in {figures['fuzzed_s']:.1f} s, "
        f"{figures['concurrent_requests']} concurrent in {figures['concurrent_s']:.1f} s, "
        f"{figures['hostile_event_batches']} hostile event batches meanwhile"
    )
    print(
        f"hangs {figures['hangs']}, server errors {figures['server_errors']} (target 0 and 0: "
        f"{verdict}); transport errors {figures['transport_errors']}"
    )
    print(f"fuzzed statuses {figures['fuzzed_statuses']}")
    print(f"concurrent statuses {figures['concurrent_statuses']}")
    print(
        f"healthy after: {figures['healthy_after']}; stopped by SIGTERM: "
        f"{figures['stopped_by_sigterm']}; final snapshot saved: {figures['final_snapshot_saved']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
