"""The proxy with the replica router hosted in it, served in this process in front of a gateway
(``contextpilot-server --upstream GATEWAY --replicas-config ...``; docs/DESIGN.md, "The
proxy"), for the ``contextpilot-proxy-smg`` method of
:mod:`~contextpilot_bench.vllm_replica_methods`.

In this process (:mod:`~contextpilot_bench.served_app`) so that the run reads the router's own
figures after it (where each request landed, as the replicas' KV events told it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from contextpilot_bench.served_app import served_app
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.replicas.routing_config import LoadKind

if TYPE_CHECKING:
    from contextpilot_integrations.service.proxy.replica_routing import ReplicaRouting

__all__ = ["ProxySettings", "proxy_over_gateway"]

CALIBRATION_S = 120.0
"""Longest wait, before the first call, for the proxy to learn the gateway's worker indexes."""


DEFAULT_PROXY_HOLD_MS = 10_000.0
"""The benchmark's proxy method's ``window_hold_ms`` when it has a planning window
(milliseconds): long enough to cover the door's wait under the benchmark's bursts."""


@dataclass(frozen=True)
class ProxySettings:
    """How the benchmark starts the proxy.

    Attributes:
        window_ms: its planning window (``contextpilot-server --window-ms``); 0: each call
            planned alone as it comes.
        load, max_imbalance: its router's rule (the fleet's ``load`` and ``max_imbalance``);
            ``None``: the fleet's defaults.
        ordered, max_in_flight: the replica's door (the fleet's keys, off in the proxy by
            default): the benchmark's bursts behind SMG are what it is for, so it is on here,
            at most 4 calls in flight per replica.
        window_hold_ms: the most the planning window is held open past its length while every
            replica has calls waiting at its door (the fleet's key; 0: never held).
        window_max_batch: most calls one window gathers (``--window-max-batch``): the
            benchmark's workloads are a few hundred calls, so a burst or a backlog of all of
            them is planned as one batch, as the offline reference plans them.
        target_workers: send each call to its replica's worker by SMG's worker index (the
            fleet's key, off in the proxy by default; the gateway then runs
            ``consistent_hashing``); False: by the routing key alone.
        kv_capacity_tokens: each replica's KV capacity in tokens, in the proxy's fleet (the
            replicas' ``kv_capacity_tokens``): ``"auto"`` (default): the proxy asks each
            replica's engine, learnt before this yields; an int: given; None: not known,
            nothing asked.
    """

    window_ms: float = 0.0
    load: LoadKind | None = None
    max_imbalance: float | None = None
    ordered: bool = True
    max_in_flight: int | None = 4
    window_hold_ms: float = 0.0
    window_max_batch: int = 256
    target_workers: bool = True
    kv_capacity_tokens: int | Literal["auto"] | None = "auto"


@contextmanager
def proxy_over_gateway(
    gateway_url: str,
    replicas: Sequence[Mapping[str, Any]],
    layout: PromptLayout,
    settings: ProxySettings | None = None,
) -> Iterator[tuple[str, ReplicaRouting]]:
    """The proxy in front of ``gateway_url`` (its root), routing over ``replicas`` (their
    ``ReplicaSpec`` mappings, KV events included) with the gateway's routing key (and its
    worker index, learnt before this yields: ``settings.target_workers``); yields its root URL
    and its replica routing (its router of a service without keys: ``router_of(None)``),
    stopped on exit.

    Raises:
        RuntimeError: it did not start within
            :data:`~contextpilot_bench.served_app.STARTUP_S`.
    """
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    settings = settings or ProxySettings()
    capacity = settings.kv_capacity_tokens
    fleet: dict[str, Any] = {
        "mode": "gateway",
        "replicas": [{**r, "kv_capacity_tokens": capacity} for r in replicas],
    }
    if settings.load is not None:
        fleet["load"] = settings.load
    if settings.max_imbalance is not None:
        fleet["max_imbalance"] = settings.max_imbalance
    fleet["ordered"] = settings.ordered
    fleet["max_in_flight"] = settings.max_in_flight
    fleet["window_hold_ms"] = settings.window_hold_ms
    fleet["target_workers"] = settings.target_workers
    config = ServiceConfig(
        layout=layout,
        proxy=ProxyConfig(f"{gateway_url}/v1", fleet=fleet),  # type: ignore[arg-type]
        window_ms=settings.window_ms,
        window_max_batch=settings.window_max_batch,
    )
    app = create_app(config)
    with served_app(app) as url:
        routing = app.state.proxy.routing
        deadline = time.monotonic() + CALIBRATION_S
        while routing.workers.state == "pending" and time.monotonic() < deadline:
            time.sleep(0.05)
        while (
            routing.fleet.learn_kv_capacity
            and routing.learnt_kv_capacity is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        yield url, routing
