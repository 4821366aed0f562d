"""How long one tenant's call waits while another tenant fills the proxy's upstream pool with
slow calls (docs/DESIGN.md, "The proxy": connections shared between tenants).

Run: ``.venv/bin/python benchmarks/micro/bench_proxy_tenant_share.py`` (``--flood 520
--hold-s 3 --rounds 3``; ``--json`` for machine-readable output). On 127.0.0.1 it starts an
upstream (a Starlette app in a thread of this process) that holds every call of model
``hold`` for ``--hold-s`` seconds and answers every other at once, and, per run,
``contextpilot-server --upstream <it>/v1`` with two tenants (alice, bob) and the default pool
of 512 connections, in its own process. Each round alice sends ``--flood`` calls at once (a
burst, as slow generations arrive together); once the upstream holds as many of them as the
pool lets through, bob sends one quick call, timed from sent to answered. Two runs, in this
order:

* ``no reserve``: ``--upstream-tenant-connections 512``, so alice may hold every connection
  and bob's call waits for the first of hers to end;
* ``shared``: the default share (three quarters of the pool per tenant), so connections are
  left for bob.

Printed: bob's median and largest wait per run, and the medians' ratio shared / no reserve
(below 1 is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

_ANSWER = {"object": "chat.completion", "choices": []}
"""What every call gets (the proxy passes it on unread but for its absent usage)."""
_KEYS = {"alice": "alice-key", "bob": "bob-key"}
_POOL = 512
"""The proxy's default ``--upstream-connections``."""
_FILL_S = 60.0
"""The longest wait for a burst to fill the pool."""


class HoldingUpstream:
    """Holds each ``hold`` call ``hold_s`` seconds; counts the calls in flight per ``x-who``."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.in_flight: Counter[str] = Counter()

    def app(self) -> Starlette:
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            who = request.headers.get("x-who", "")
            self.in_flight[who] += 1  # one event loop: no lock needed
            try:
                if body.get("model") == "hold":
                    await asyncio.sleep(self.hold_s)
                return JSONResponse(_ANSWER)
            finally:
                self.in_flight[who] -= 1

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(app: Starlette) -> tuple[uvicorn.Server, str]:
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=4096)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


def _call(model: str, who: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return body, {"x-who": who, "authorization": f"Bearer {_KEYS[who]}"}


async def _run(
    upstream: HoldingUpstream, url: str, args: argparse.Namespace, cap: int | None
) -> list[float]:
    port = _free_port()
    command = [
        sys.executable, "-m", "contextpilot_integrations.service.server",
        "--port", str(port), "--upstream", f"{url}/v1", "--log-level", "warning",
    ]  # fmt: skip
    if cap is not None:
        command += ["--upstream-tenant-connections", str(cap)]
    env = {**os.environ, "CONTEXTPILOT_API_KEYS": ",".join(f"{t}={k}" for t, k in _KEYS.items())}
    proxy = subprocess.Popen(command, env=env)
    base = f"http://127.0.0.1:{port}"
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with session.get(f"{base}/health") as answer:
                        if answer.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy did not start within 30 s")
                await asyncio.sleep(0.1)

            async def post(model: str, who: str) -> float:
                body, headers = _call(model, who)
                began = time.perf_counter()
                async with session.post(
                    f"{base}/v1/chat/completions", json=body, headers=headers
                ) as answer:
                    await answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"{who}'s call: status {answer.status}")
                return time.perf_counter() - began

            through = min(cap if cap is not None else _POOL - _POOL // 4, args.flood)
            waits = []
            for _ in range(args.rounds):
                flood = [asyncio.create_task(post("hold", "alice")) for _ in range(args.flood)]
                deadline = time.monotonic() + _FILL_S
                while upstream.in_flight["alice"] < through:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the upstream holds {upstream.in_flight['alice']} of alice's calls "
                            f"after {_FILL_S:g} s, not {through}"
                        )
                    await asyncio.sleep(0.01)
                waits.append(await post("quick", "bob"))
                await asyncio.gather(*flood)
            return waits
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=520, help="alice's calls at once")
    parser.add_argument("--hold-s", type=float, default=3.0, help="seconds each is held")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per run, one bob call each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    upstream = HoldingUpstream(args.hold_s)
    server, url = _serve(upstream.app())
    try:
        runs = {
            "no reserve": asyncio.run(_run(upstream, url, args, _POOL)),
            "shared": asyncio.run(_run(upstream, url, args, None)),
        }
    finally:
        server.should_exit = True
    figures = {
        name: {"median_s": statistics.median(waits), "max_s": max(waits)}
        for name, waits in runs.items()
    }
    ratio = figures["shared"]["median_s"] / figures["no reserve"]["median_s"]
    if args.json:
        print(json.dumps({"runs": figures, "shared_vs_no_reserve": ratio}))
        return 0
    print(
        f"alice: bursts of {args.flood} calls held {args.hold_s:g} s each; bob: one call per "
        f"burst, {args.rounds} bursts a run"
    )
    for name, row in figures.items():
        print(f"  {name:<10} bob's wait: median {row['median_s']:.3f} s, max {row['max_s']:.3f} s")
    print(f"  shared / no reserve (median): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
