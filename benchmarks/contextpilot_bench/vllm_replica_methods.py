"""The methods compared on N engine replicas, each on emptied caches behind a fresh gateway.

``baseline-round_robin``, ``baseline-cache_aware``
    Retriever order, arrival order, through SMG with that policy (a deployment without it).
``contextpilot-cache_aware``
    One replica-blind :class:`~contextpilot_integrations.core.pilot.ContextPilot` plans the
    workload as one batch (``plan_batch``) and its schedule goes through SMG's ``cache_aware``:
    ContextPilot's prompts, the gateway's choice of replica.
``contextpilot-routed-smg``
    A :class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter` (one index and
    engine link per replica, fed by its KV events) partitions and plans the batch; each plan's
    routing key goes in :data:`~contextpilot_integrations.llm_call.engine_fields.ROUTING_HEADER`
    and SMG routes on it (``--routing-key-headers x-contextpilot-route --routing-key-override``
    over ``round_robin``, ``--assignment-mode delegate``: the schedule's first requests carry
    the router's probe keys, one per replica in turn, so they spread one per worker; not
    ``min_group``, which pins two keys met one after the other to one worker; docs/DESIGN.md,
    "The smg gateway").
``contextpilot-routed-direct``
    The same router in its ``"direct"`` mode: each request is sent to its plan's ``base_url``.
``contextpilot-proxy-smg``
    The router hosted in the proxy (:mod:`~contextpilot_bench.proxy_fleet`) in front of SMG:
    each request goes to the proxy with its documents marked in the body
    (``contextpilot.documents``), in the workload's order, as an app's users send them (it
    knows no schedule); the proxy plans them on the replica it picks (its KV events, its
    load) and forwards to SMG with the routing key and, by default, the replica's worker index
    (``ProxySettings.target_workers``: SMG under ``consistent_hashing``; without it the same
    SMG as ``contextpilot-routed-smg``, the routing key alone). With a planning window
    (``window_ms``) the calls arriving within it are planned as one batch by the router
    (``plan_batch``: partitioned, ordered, scheduled) and forwarded in its schedule order;
    without one each is planned alone as it comes.

Each method starts with every replica's prefix cache emptied
(:meth:`~contextpilot_bench.vllm_replica_fleet.VllmCpuFleet.reset`) and, behind SMG, a
gateway of its own (nothing it learnt from an earlier method carries over). Requests are
streamed (TTFT), with the plan's rid as ``session_id``/``request_id``, one at a time, or, with
an arrival process (:class:`~contextpilot_bench.arrivals.Arrivals`), each at its arrival time
with at most :data:`MAX_USERS` in flight, the same times for every method: the k-th arrival is
the k-th request of the method's order (the batch schedule of a method that planned the
workload as one batch beforehand, the workload's order for the others). Per replica the
figures are the differences of the workers' ``/metrics`` counters over the method
(:mod:`~contextpilot_bench.vllm_metrics`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from contextpilot_bench.arrivals import Arrivals
from contextpilot_bench.engine_client import EngineClient
from contextpilot_bench.methods import PreparedWorkload
from contextpilot_bench.proxy_fleet import ProxySettings, proxy_over_gateway
from contextpilot_bench.smg_gateway import SmgGateway
from contextpilot_bench.vllm_metrics import WorkerCounters
from contextpilot_bench.vllm_replica_fleet import VllmCpuFleet
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.llm_call.engine_fields import (
    ROUTING_HEADER,
    engine_base_url,
    engine_headers,
)

__all__ = [
    "BASELINE_METHODS",
    "MAX_USERS",
    "PROXY_METHOD",
    "VLLM_REPLICA_METHODS",
    "ROUTED_METHODS",
    "ReplicaMethodRun",
    "AnsweredRequest",
    "methods_for",
    "run_vllm_replica_method",
    "send_requests",
]

BASELINE_METHODS = ("baseline-round_robin", "baseline-cache_aware")
ROUTED_METHODS = {"smg": "contextpilot-routed-smg", "direct": "contextpilot-routed-direct"}
PROXY_METHOD = "contextpilot-proxy-smg"
VLLM_REPLICA_METHODS = (
    *BASELINE_METHODS,
    "contextpilot-cache_aware",
    *ROUTED_METHODS.values(),
    PROXY_METHOD,
)

MAX_USERS = 256
"""Most requests in flight at once under an arrival process: a request arriving while as many
wait for their answers is sent when one ends (users who wait for their answer); the clients'
connection pools hold as many."""

_GATEWAYS = {
    "baseline-round_robin": "smg round_robin",
    "baseline-cache_aware": "smg cache_aware",
    "contextpilot-cache_aware": "smg cache_aware",
    "contextpilot-routed-smg": "smg routing key",
    "contextpilot-routed-direct": "direct",
    PROXY_METHOD: "proxy, smg routing key",
}


@dataclass(frozen=True, slots=True)
class AnsweredRequest:
    """One request as sent and answered.

    Attributes:
        request_index: its position in the workload's arrival order.
        rid: the id sent (``session_id``, ``request_id``).
        prompt_tokens, cached_tokens: the engine's ``usage`` (cached 0 when not reported).
        ttft_s: time to first token, seconds, through the gateway when there is one.
        replica: where the router planned it (routed methods; after the run: where the
            router learnt it went), else None.
        token_ids: the prompt's token ids (the model's chat template, as the server applies
            it), for the one-replica model of the same stream.
    """

    request_index: int
    rid: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    replica: str | None
    token_ids: tuple[int, ...] = field(repr=False)


@dataclass
class ReplicaMethodRun:
    """One method's run over the fleet.

    Attributes:
        method: one of :data:`VLLM_REPLICA_METHODS`.
        gateway: how requests reached the replicas (``smg <policy>``, ``smg routing key``:
            :data:`~contextpilot_integrations.llm_call.engine_fields.ROUTING_HEADER` over
            ``round_robin``, ``direct``: the plan's ``base_url``).
        requests: in send order.
        workers: per replica, what its ``/metrics`` counted during the method.
        plan_seconds: planning time (ContextPilot methods).
        seconds: the whole method, gateway start included.
        gateway_startup_s: SMG's startup (None: direct).
        router: the router's statistics after the run (routed methods): per replica ``routed``
            requests and prompt tokens, ``remapped`` requests and keys, evictions applied.
    """

    method: str
    gateway: str
    requests: list[AnsweredRequest]
    workers: dict[str, WorkerCounters]
    plan_seconds: float = 0.0
    seconds: float = 0.0
    gateway_startup_s: float | None = None
    router: dict[str, Any] | None = None


def _baseline_messages(prepared: PreparedWorkload) -> list[list[dict[str, str]]]:
    layout = prepared.layout
    return [
        layout.render_messages(prepared.block_texts(i), r.query)
        for i, r in enumerate(prepared.workload.requests)
    ]


def _batch(prepared: PreparedWorkload, prefix: str) -> list[PlanRequest]:
    return [
        PlanRequest(r.query, prepared.block_texts(i), f"{prefix}-{r.id}")
        for i, r in enumerate(prepared.workload.requests)
    ]


def _router_figures(router: ReplicaRouter) -> dict[str, Any]:
    stats = router.stats()
    replicas = {}
    for name, replica in stats["replicas"].items():
        sync = replica["sync"] or {}
        replicas[name] = {
            "routed_requests": replica["routed_requests"],
            "routed_prompt_tokens": replica["routed_prompt_tokens"],
            "key": replica["key"],
            "key_confirmed": replica["confirmed"],
            "index_requests": replica["index"]["requests"],
            "evictions_applied": int((sync.get("evictions") or {}).get("kv-events", 0)),
            "kv_budget": replica["kv_budget"],
        }
    routing = stats["routing"]
    return {
        "replicas": replicas,
        "remapped": routing["remapped"],
        "remapped_keys": routing["remapped_keys"],
        "balance": routing["balance"],
    }


def run_vllm_replica_method(
    method: str,
    prepared: PreparedWorkload,
    fleet: VllmCpuFleet,
    *,
    smg_binary: str | None = None,
    progress: Callable[[], None] | None = None,
    arrivals: Arrivals | None = None,
    proxy_settings: ProxySettings | None = None,
) -> ReplicaMethodRun:
    """Run ``method`` (:data:`VLLM_REPLICA_METHODS`) over ``fleet`` on emptied caches.

    Args:
        arrivals: when each request is sent (module docstring); ``None``: one at a time.
        proxy_settings: the proxy's planning window and routing rule
            (``contextpilot-proxy-smg``).

    Raises:
        ValueError: an unknown method.
        EngineError: a replica or the gateway failed a request.
        RuntimeError, TimeoutError: the gateway did not start.
    """
    if method not in VLLM_REPLICA_METHODS:
        raise ValueError(f"method must be one of {VLLM_REPLICA_METHODS}, got {method!r}")
    began = time.perf_counter()
    fleet.reset()
    before = fleet.counters()
    if method == PROXY_METHOD:
        return _run_through_proxy(
            prepared, fleet, before, began, smg_binary, progress, arrivals,
            proxy_settings or ProxySettings(),
        )  # fmt: skip
    tokenize = fleet.instances[0].server.tokenize
    router: ReplicaRouter | None = None
    gateway: SmgGateway | None = None
    plan_seconds = 0.0
    try:
        if method in BASELINE_METHODS:
            policy = method.split("-", 1)[1]
            gateway = SmgGateway(fleet.urls, policy=policy, binary=smg_binary).start()
            order = list(range(len(prepared.workload.requests)))
            plans: list[Plan | None] = [None] * len(order)
            messages = _baseline_messages(prepared)
        else:
            from contextpilot_integrations.sync.engine_link import EngineLink

            start = time.perf_counter()
            if method == "contextpilot-cache_aware":
                pilot = ContextPilot(layout=prepared.layout, token_counter=prepared.counter)
                batch = pilot.plan_batch(_batch(prepared, method))
            else:
                router = ReplicaRouter(
                    fleet.replica_specs(),
                    mode="gateway" if method == ROUTED_METHODS["smg"] else "direct",
                    layout=prepared.layout,
                    token_counter=prepared.counter,
                    link_factory=EngineLink,
                )
                batch = router.plan_batch(_batch(prepared, method))
            plan_seconds = time.perf_counter() - start
            order = list(batch.schedule)
            plans = list(batch.plans)
            messages = [plan.messages for plan in batch.plans]
            if method == "contextpilot-cache_aware":
                gateway = SmgGateway(fleet.urls, policy="cache_aware", binary=smg_binary).start()
            elif method == ROUTED_METHODS["smg"]:
                gateway = SmgGateway(
                    fleet.urls,
                    policy="round_robin",
                    routing_header=ROUTING_HEADER,
                    assignment_mode="delegate",
                    binary=smg_binary,
                ).start()
        through = (
            EngineClient(gateway.base_url, model=fleet.model_name, max_connections=MAX_USERS)
            if gateway is not None
            else None
        )

        def send(i: int) -> AnsweredRequest:
            plan, prompt = plans[i], messages[i]
            rid = plan.rid if plan is not None else f"{method}-{prepared.workload.requests[i].id}"
            client = through or fleet.client_for(engine_base_url(plan) or "")
            answer = client.chat(
                prompt,
                rid=rid,
                max_tokens=fleet.instances[0].answer_tokens,
                headers=engine_headers(plan) if plan is not None else None,
            )
            replica = plan.replica if plan is not None else None
            return AnsweredRequest(
                i,
                rid,
                answer.prompt_tokens,
                answer.cached_tokens or 0,
                answer.ttft_s,
                replica,
                tuple(tokenize(prompt)),
            )

        try:
            sent = send_requests(order, send, arrivals, progress)
        finally:
            if through is not None:
                through.close()
        fleet.wait_for_events()
        if router is not None:
            _wait_quiet(router)
            sent = [_landed(request, router) for request in sent]
        after = fleet.counters()
        figures = _router_figures(router) if router is not None else None
    finally:
        if router is not None:
            router.close()
        if gateway is not None:
            gateway.stop()
    return ReplicaMethodRun(
        method,
        _GATEWAYS[method],
        sent,
        {name: after[name].minus(before[name]) for name in fleet.names},
        plan_seconds=plan_seconds,
        seconds=time.perf_counter() - began,
        gateway_startup_s=gateway.startup_seconds if gateway is not None else None,
        router=figures,
    )


def _run_through_proxy(
    prepared: PreparedWorkload,
    fleet: VllmCpuFleet,
    before: dict[str, WorkerCounters],
    began: float,
    smg_binary: str | None,
    progress: Callable[[], None] | None,
    arrivals: Arrivals | None,
    settings: ProxySettings,
) -> ReplicaMethodRun:
    """The ``contextpilot-proxy-smg`` method (module docstring). The prompt the proxy sends is
    not seen here, so its requests carry no token ids (the one-replica model is the
    reference row's)."""
    layout = prepared.layout
    requests = prepared.workload.requests
    order = list(arrivals.order) if arrivals is not None else list(range(len(requests)))
    # Targeted: SMG's worker index is honoured under consistent_hashing only, and a routing
    # key's sticky selector would come first (docs/DESIGN.md, "The smg gateway").
    targeted = settings.target_workers
    with (
        SmgGateway(
            fleet.urls,
            policy="consistent_hashing" if targeted else "round_robin",
            routing_header=None if targeted else ROUTING_HEADER,
            assignment_mode=None if targeted else "delegate",
            binary=smg_binary,
        ) as gateway,
        proxy_over_gateway(gateway.base_url, fleet.replica_specs(), layout, settings) as (
            url,
            routing,
        ),
        EngineClient(url, model=fleet.model_name, max_connections=MAX_USERS) as client,
    ):
        router = routing.router_of(None)

        def send(i: int) -> AnsweredRequest:
            request = requests[i]
            rid = f"{PROXY_METHOD}-{request.id}"
            answer = client.chat(
                [{"role": "system", "content": layout.system_prompt},
                 {"role": "user", "content": request.query}],
                rid=rid,
                max_tokens=fleet.instances[0].answer_tokens,
                extra_body={"contextpilot": {"documents": prepared.block_texts(i)}},
            )  # fmt: skip
            return AnsweredRequest(
                i, rid, answer.prompt_tokens, answer.cached_tokens or 0, answer.ttft_s, None, ()
            )

        sent = send_requests(order, send, arrivals, progress)
        fleet.wait_for_events()
        _wait_quiet(router)
        figures = _router_figures(router)
        figures["window"] = routing.stats()[""]["window"]
        figures["door"] = {
            "ordered": routing.order.ordered,
            "max_in_flight": routing.order.max_in_flight,
            **routing.order.stats(),
        }
        figures["workers"] = routing.workers.stats()
        figures["window_ms"] = settings.window_ms
        figures["window_hold_ms"] = settings.window_hold_ms
        figures["window_max_batch"] = settings.window_max_batch
        known = [r["kv_budget"]["capacity_tokens"] for r in figures["replicas"].values()
                 if r["kv_budget"] is not None]  # fmt: skip
        figures["kv_capacity_tokens"] = min(known) if known else None  # what the router holds
        figures["load"] = router.config.load
        figures["max_imbalance"] = router.config.max_imbalance
        startup = gateway.startup_seconds
    after = fleet.counters()
    return ReplicaMethodRun(
        PROXY_METHOD,
        "proxy, smg worker index" if targeted else _GATEWAYS[PROXY_METHOD],
        sent,
        {name: after[name].minus(before[name]) for name in fleet.names},
        seconds=time.perf_counter() - began,
        gateway_startup_s=startup,
        router=figures,
    )


def send_requests(
    order: Sequence[int],
    send: Callable[[int], AnsweredRequest],
    arrivals: Arrivals | None,
    progress: Callable[[], None] | None,
) -> list[AnsweredRequest]:
    """``send`` each request of ``order``: one at a time (``arrivals`` None), or the k-th at
    the k-th arrival time from now, at most :data:`MAX_USERS` in flight. Returns the answers
    in ``order``.

    Raises:
        EngineError: a request failed (the others sent are waited for first).
    """
    if arrivals is None:
        out = []
        for i in order:
            out.append(send(i))
            if progress is not None:
                progress()
        return out
    times = [float(t) - float(arrivals.times_s[0]) for t in arrivals.times_s]
    users = threading.BoundedSemaphore(MAX_USERS)
    lock = threading.Lock()
    start = time.perf_counter()

    def user(i: int) -> AnsweredRequest:
        try:
            answer = send(i)
        finally:
            users.release()
        if progress is not None:
            with lock:
                progress()
        return answer

    with ThreadPoolExecutor(max_workers=MAX_USERS) as pool:
        futures = []
        for i, at in zip(order, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            users.acquire()
            futures.append(pool.submit(user, i))
        return [future.result() for future in futures]


def _wait_quiet(router: ReplicaRouter, quiet_s: float = 0.4, timeout_s: float = 15.0) -> None:
    """Until the router's links have applied every batch that arrived (quiet for ``quiet_s``)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        stats = router.stats()["replicas"]
        key = tuple(
            tuple(r["sync"]["source"]["subscriber"][f] for f in ("received", "applied"))
            for r in stats.values()
            if r["sync"] is not None
        )
        if key != last:
            last, since = key, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def _landed(request: AnsweredRequest, router: ReplicaRouter) -> AnsweredRequest:
    """``request`` with the replica the router learnt it reached (its engine's events)."""
    replica = router.replica_of(request.rid)
    if replica is None or replica == request.replica:
        return request
    return AnsweredRequest(
        request.request_index,
        request.rid,
        request.prompt_tokens,
        request.cached_tokens,
        request.ttft_s,
        replica,
        request.token_ids,
    )


def methods_for(router: str, methods: str | None) -> list[str]:
    """The methods of a run: ``--methods`` (comma-separated, from :data:`VLLM_REPLICA_METHODS`), or
    the baselines, ContextPilot via ``cache_aware`` and the routing ``--router`` names.

    Raises:
        ValueError: an unknown router or method, or a repeated method.
    """
    if router not in ROUTED_METHODS:
        raise ValueError(f"--router must be one of {sorted(ROUTED_METHODS)}, got {router!r}")
    if methods is None:
        return [*BASELINE_METHODS, "contextpilot-cache_aware", ROUTED_METHODS[router]]
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in VLLM_REPLICA_METHODS]
    if not chosen or unknown:
        raise ValueError(
            f"--methods: unknown {unknown or chosen}; choose from {VLLM_REPLICA_METHODS}"
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"--methods must not repeat, got {chosen}")
    return chosen
