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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.routing_config import LoadKind

if TYPE_CHECKING:
    from contextpilot_integrations.service.proxy.replica_routing import ReplicaRouting

__all__ = ["ProxySettings", "proxy_over_gateway"]

STARTUP_S = 30.0


@dataclass(frozen=True)
class ProxySettings:
    """How the benchmark starts the proxy.

    Attributes:
        window_ms: its planning window (``contextpilot-server --window-ms``); 0: each call
            planned alone as it comes.
        load, max_imbalance: its router's rule (the fleet's ``load`` and ``max_imbalance``);
            ``None``: the fleet's defaults.
    """

    window_ms: float = 0.0
    load: LoadKind | None = None
    max_imbalance: float | None = None


@contextmanager
def proxy_over_gateway(
    gateway_url: str,
    replicas: Sequence[Mapping[str, Any]],
    layout: PromptLayout,
    settings: ProxySettings | None = None,
) -> Iterator[tuple[str, ReplicaRouting]]:
    """The proxy in front of ``gateway_url`` (its root), routing over ``replicas`` (their
    ``ReplicaSpec`` mappings, KV events included) with the gateway's routing key; yields its
    root URL and its replica routing (its router of a service without keys:
    ``router_of(None)``), stopped on exit.

    Raises:
        RuntimeError: it did not start within :data:`STARTUP_S`.
    """
    import uvicorn

    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    settings = settings or ProxySettings()
    fleet: dict[str, Any] = {"mode": "gateway", "replicas": [dict(r) for r in replicas]}
    if settings.load is not None:
        fleet["load"] = settings.load
    if settings.max_imbalance is not None:
        fleet["max_imbalance"] = settings.max_imbalance
    config = ServiceConfig(
        layout=layout,
        proxy=ProxyConfig(f"{gateway_url}/v1", fleet=fleet),  # type: ignore[arg-type]
        window_ms=settings.window_ms,
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
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.proxy.routing
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_S)
        sock.close()
