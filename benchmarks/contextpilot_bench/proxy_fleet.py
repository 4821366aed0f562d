"""The proxy with the replica router hosted in it, served in this process in front of a gateway
(``contextpilot-server --upstream GATEWAY --replicas-config ...``; docs/DESIGN.md, "The
proxy"), for the ``contextpilot-proxy-smg`` method of
:mod:`~contextpilot_bench.vllm_replica_methods`.

In this process (:mod:`~contextpilot_bench.served_app`) so that the run reads the router's own
figures after it (where each request landed, as the replicas' KV events told it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from contextpilot_bench.served_app import served_app
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.routing import ReplicaRouter

__all__ = ["proxy_over_gateway"]


@contextmanager
def proxy_over_gateway(
    gateway_url: str, replicas: Sequence[Mapping[str, Any]], layout: PromptLayout
) -> Iterator[tuple[str, ReplicaRouter]]:
    """The proxy in front of ``gateway_url`` (its root), routing over ``replicas`` (their
    ``ReplicaSpec`` mappings, KV events included) with the gateway's routing key; yields its
    root URL and its router (the one of a service without keys), stopped on exit.

    Raises:
        RuntimeError: it did not start within
            :data:`~contextpilot_bench.served_app.STARTUP_S`.
    """
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    fleet = {"mode": "gateway", "replicas": [dict(r) for r in replicas]}
    config = ServiceConfig(
        layout=layout,
        proxy=ProxyConfig(f"{gateway_url}/v1", fleet=fleet),  # type: ignore[arg-type]
    )
    app = create_app(config)
    with served_app(app) as url:
        yield url, app.state.proxy.routing.router_of(None)
