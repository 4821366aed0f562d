"""The proxy with the replica router hosted in it, served in this process in front of a gateway
(``contextpilot-server --upstream GATEWAY --replicas-config ...``; docs/DESIGN.md, "The
proxy"), for the ``contextpilot-proxy-smg`` method of
:mod:`~contextpilot_bench.vllm_replica_methods`.

In this process (uvicorn on a thread, lifespan on) so that the run reads the router's own
figures after it (where each request landed, as the replicas' KV events told it); the client
and the proxy then share the interpreter, which adds to the proxy's latency, never takes from
it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.routing import ReplicaRouter

__all__ = ["proxy_over_gateway"]

STARTUP_S = 30.0


@contextmanager
def proxy_over_gateway(
    gateway_url: str, replicas: Sequence[Mapping[str, Any]], layout: PromptLayout
) -> Iterator[tuple[str, ReplicaRouter]]:
    """The proxy in front of ``gateway_url`` (its root), routing over ``replicas`` (their
    ``ReplicaSpec`` mappings, KV events included) with the gateway's routing key; yields its
    root URL and its router (the one of a service without keys), stopped on exit.

    Raises:
        RuntimeError: it did not start within :data:`STARTUP_S`.
    """
    import uvicorn

    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    fleet = {"mode": "gateway", "replicas": [dict(r) for r in replicas]}
    config = ServiceConfig(
        layout=layout,
        proxy=ProxyConfig(f"{gateway_url}/v1", fleet=fleet),  # type: ignore[arg-type]
    )
    app = create_app(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the proxy did not start within {STARTUP_S:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.proxy.routing.router_of(None)
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_S)
        sock.close()
