"""The embedded multi-replica benchmark: N replicas of the prefix-cache model behind a gateway.

On one retrieved workload and one *total* KV capacity, each of ``N`` replicas is an
:class:`~contextpilot_bench.engine.EmbeddedEngine` with ``capacity // N`` tokens (its own cache,
the same model as the single-engine benchmark), and the methods are:

``baseline round_robin`` / ``baseline cache_aware`` / ``baseline prefix_hash``
    Retriever order, arrival order, routed by the gateway model of that SMG policy
    (:mod:`~contextpilot_bench.gateway_policies`).
``contextpilot cache_aware``
    One replica-blind :class:`~contextpilot_integrations.ContextPilot` (one index, as for one
    engine) plans the prompts; the gateway's ``cache_aware`` routes them. Its index is told of
    every replica's evictions (the request ids each replica's cache dropped).
``contextpilot routing``
    :class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter` (one pilot per
    replica) picks the replica with the order; each replica's evictions reach only its pilot.

and the reference :data:`ONE_REPLICA`: one ContextPilot on one engine holding the whole capacity.

``online`` (the main mode): requests are planned and sent one at a time in arrival order.
``offline``: ContextPilot plans the workload as one batch (``plan_batch``) and sends it in its
schedule (the router partitions the batch across the replicas); the baselines are the same in
both modes. The gateway's loads are requests in flight: the last ``in_flight_per_replica * N``
routed (:class:`~contextpilot_bench.gateway_policies.InFlight`); the router counts its own load
(by default the prompt tokens of its last routed requests). Figures per method
(:class:`ReplicaRun`): hit ratio in total and per replica, requests and prompt tokens per
replica and their max/min.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contextpilot_bench.engine import EmbeddedEngine, Served
from contextpilot_bench.gateway_policies import (
    PREFIX_TOKENS,
    CacheAware,
    GatewayPolicy,
    GatewayRequest,
    InFlight,
    new_policy,
)
from contextpilot_bench.methods import (
    MODES,
    MethodResult,
    PreparedWorkload,
    RequestRecord,
    run_method,
)
from contextpilot_integrations.core.blocks import TokenCounter, TokenizerCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import PlanRequest

__all__ = [
    "DEFAULT_IN_FLIGHT_PER_REPLICA",
    "ONE_REPLICA",
    "REPLICA_METHODS",
    "Fleet",
    "ReplicaRun",
    "compare_replicas",
    "gateway_request",
    "parse_replica_counts",
    "run_embedded_replica_method",
]

logger = logging.getLogger(__name__)

BASELINE_POLICIES = {
    "baseline round_robin": "round_robin",
    "baseline cache_aware": "cache_aware",
    "baseline prefix_hash": "prefix_hash",
}
BLIND = "contextpilot cache_aware"
ROUTING = "contextpilot routing"
REPLICA_METHODS = (*BASELINE_POLICIES, BLIND, ROUTING)
"""The methods compared at each replica count, in report order."""
ONE_REPLICA = "contextpilot 1 replica"
"""The reference: one ContextPilot on one engine with the whole capacity."""
DEFAULT_IN_FLIGHT_PER_REPLICA = 4
"""Requests in flight per replica, as the gateway's load counts them."""


def parse_replica_counts(text: str) -> list[int]:
    """``--replicas``: comma-separated replica counts, e.g. ``1,2,8,32``.

    Raises:
        ValueError: not integers >= 1, empty, or repeated.
    """
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--replicas must be integers separated by commas, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--replicas must be integers >= 1, got {text!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"--replicas must not repeat, got {text!r}")
    return counts


# --- the fleet -------------------------------------------------------------------------------


class Fleet:
    """``replicas`` embedded engines sharing a total capacity: ``capacity_tokens // replicas``
    tokens each (``None``: unlimited each).

    Args:
        replicas: how many (>= 1).
        capacity_tokens: the total capacity in tokens, or None.
        counter, tokenizer, block_size: as :class:`~.engine.EmbeddedEngine`.
    """

    def __init__(
        self,
        replicas: int,
        capacity_tokens: int | None,
        *,
        counter: TokenCounter,
        tokenizer: TokenizerCounter | None = None,
        block_size: int = 1,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.capacity_per_replica = None if capacity_tokens is None else capacity_tokens // replicas
        self.engines = [
            EmbeddedEngine(
                self.capacity_per_replica,
                counter=counter,
                tokenizer=tokenizer,
                block_size=block_size,
            )
            for _ in range(replicas)
        ]

    def serve(self, replica: int, rid: str, segments: Sequence[str]) -> Served:
        """Run one request on ``replica``'s engine."""
        return self.engines[replica].serve(rid, segments)

    def evicted(self) -> list[list[str]]:
        """Per replica, the request ids its cache dropped since the last call."""
        return [engine.take_evicted_rids() for engine in self.engines]


def gateway_request(
    segments: Sequence[str], counter: TokenCounter, tokenizer: TokenizerCounter | None = None
) -> GatewayRequest:
    """What the gateway sees of a prompt: its text and its head of
    :data:`~.gateway_policies.PREFIX_TOKENS` tokens (token ids with ``tokenizer``; else the
    leading text those tokens cover by ``counter``, the last segment cut in proportion)."""
    text = "".join(segments)
    if tokenizer is not None:
        return GatewayRequest(text, tuple(tokenizer.encode(text)[:PREFIX_TOKENS]))
    head, left = [], PREFIX_TOKENS
    for segment in segments:
        tokens = counter.count(segment)
        if tokens <= left:
            head.append(segment)
            left -= tokens
            continue
        head.append(segment[: len(segment) * left // tokens])
        break
    return GatewayRequest(text, "".join(head))


# --- results ---------------------------------------------------------------------------------


@dataclass
class ReplicaRun:
    """One method's run on ``replicas`` replicas.

    Attributes:
        method: :data:`REPLICA_METHODS` or :data:`ONE_REPLICA`.
        replicas: how many.
        capacity_per_replica: tokens (None: unlimited).
        result: the records in send order (:class:`~.methods.MethodResult`).
        placed: the replica of each record, parallel to ``result.records``.
        routing: the router's or gateway's own figures (how many requests it pinned, ...).
    """

    method: str
    replicas: int
    capacity_per_replica: int | None
    result: MethodResult
    placed: list[int]
    routing: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.result.hit_ratio

    def _per_replica(self, value: Callable[[RequestRecord], int]) -> list[int]:
        out = [0] * self.replicas
        for replica, record in zip(self.placed, self.result.records, strict=True):
            out[replica] += value(record)
        return out

    @property
    def requests_per_replica(self) -> list[int]:
        return self._per_replica(lambda r: 1)

    @property
    def prompt_tokens_per_replica(self) -> list[int]:
        return self._per_replica(lambda r: r.prompt_tokens)

    @property
    def cached_tokens_per_replica(self) -> list[int]:
        return self._per_replica(lambda r: r.cached_tokens or 0)

    @property
    def hit_ratio_per_replica(self) -> list[float | None]:
        """Cached / prompt tokens of each replica (None for one that served nothing)."""
        return [
            cached / prompt if prompt else None
            for cached, prompt in zip(
                self.cached_tokens_per_replica, self.prompt_tokens_per_replica, strict=True
            )
        ]


# --- the methods -----------------------------------------------------------------------------


@dataclass
class _Context:
    prepared: PreparedWorkload
    fleet: Fleet
    mode: str
    in_flight: int
    counter: TokenCounter
    tokenizer: TokenizerCounter | None
    records: list[RequestRecord] = field(default_factory=list)
    placed: list[int] = field(default_factory=list)
    plan_seconds: float = 0.0

    def send(self, index: int, rid: str, segments: Sequence[str], replica: int) -> None:
        served = self.fleet.serve(replica, rid, segments)
        self.records.append(
            RequestRecord(index, rid, served.prompt_tokens, served.cached_tokens, served.ttft_s)
        )
        self.placed.append(replica)

    def run(self, method: str, routing: dict[str, Any]) -> ReplicaRun:
        result = MethodResult(method, self.records, plan_seconds=self.plan_seconds)
        n = len(self.fleet.engines)
        return ReplicaRun(method, n, self.fleet.capacity_per_replica, result, self.placed, routing)


def _gateway_figures(policy: GatewayPolicy) -> dict[str, Any]:
    figures: dict[str, Any] = {"policy": policy.name}
    if isinstance(policy, CacheAware):
        figures.update(pinned=policy.pinned, balanced=policy.balanced)
    return figures


def _through_gateway(
    context: _Context,
    policy: GatewayPolicy,
    prompts: Callable[[], Sequence[tuple[int, str, Sequence[str]]]] | None,
    pilot: ContextPilot | None,
) -> None:
    """Send each ``(request index, rid, segments)`` through ``policy``; ``prompts`` None: the
    baseline's, else a callable planning them (all at once, offline) or a pilot planning each
    (online); evictions go to ``pilot``."""
    prepared = context.prepared
    loads = InFlight(len(context.fleet.engines), context.in_flight)
    requests = prepared.workload.requests

    def route(index: int, rid: str, segments: Sequence[str]) -> None:
        replica = policy.route(
            gateway_request(segments, context.counter, context.tokenizer), loads.loads
        )
        loads.routed(replica)
        context.send(index, rid, segments, replica)
        for dropped in context.fleet.evicted():
            if pilot is not None:
                for rid_dropped in dropped:
                    pilot.evict(rid_dropped)

    if pilot is None:
        for i, request in enumerate(requests):
            segments = prepared.layout.render_segments(prepared.block_texts(i), request.query)
            route(i, f"baseline-{request.id}", segments)
        return
    if prompts is not None:
        for index, rid, planned in prompts():
            route(index, rid, planned)
        return
    for i, request in enumerate(requests):
        start = time.perf_counter()
        plan = pilot.plan(request.query, prepared.block_texts(i), rid=f"contextpilot-{request.id}")
        context.plan_seconds += time.perf_counter() - start
        route(i, plan.rid, plan.segments)


def _batch(prepared: PreparedWorkload) -> list[PlanRequest]:
    return [
        PlanRequest(r.query, prepared.block_texts(i), f"contextpilot-{r.id}")
        for i, r in enumerate(prepared.workload.requests)
    ]


def _run_blind(context: _Context) -> ReplicaRun:
    prepared = context.prepared
    policy = new_policy("cache_aware", len(context.fleet.engines))
    with ContextPilot(layout=prepared.layout, token_counter=context.counter) as pilot:
        prompts = None
        if context.mode == "offline":

            def prompts() -> list[tuple[int, str, Sequence[str]]]:
                start = time.perf_counter()
                batch = pilot.plan_batch(_batch(prepared))
                context.plan_seconds += time.perf_counter() - start
                return [(i, batch.plans[i].rid, batch.plans[i].segments) for i in batch.schedule]

        _through_gateway(context, policy, prompts, pilot)
    return context.run(BLIND, _gateway_figures(policy))


def _run_routing(context: _Context) -> ReplicaRun:
    prepared = context.prepared
    n = len(context.fleet.engines)
    names = {f"replica-{i}": i for i in range(n)}
    router = ReplicaRouter(
        [{"name": name} for name in names], layout=prepared.layout, token_counter=context.counter
    )

    def send(index: int, plan: Plan) -> None:
        context.send(index, plan.rid, plan.segments, names[plan.replica or ""])
        for dropped in context.fleet.evicted():
            for rid in dropped:
                router.evict(rid)

    with router:
        if context.mode == "offline":
            start = time.perf_counter()
            batch = router.plan_batch(_batch(prepared))
            context.plan_seconds += time.perf_counter() - start
            for i in batch.schedule:
                send(i, batch.plans[i])
        else:
            for i, request in enumerate(prepared.workload.requests):
                start = time.perf_counter()
                plan = router.plan(
                    request.query, prepared.block_texts(i), rid=f"contextpilot-{request.id}"
                )
                context.plan_seconds += time.perf_counter() - start
                send(i, plan)
        stats = router.stats()["routing"]
    return context.run(ROUTING, {"router": stats})


def run_embedded_replica_method(
    method: str,
    prepared: PreparedWorkload,
    replicas: int,
    capacity_tokens: int | None,
    *,
    counter: TokenCounter,
    tokenizer: TokenizerCounter | None = None,
    block_size: int = 1,
    mode: str = "online",
    in_flight_per_replica: int = DEFAULT_IN_FLIGHT_PER_REPLICA,
) -> ReplicaRun:
    """Run one of :data:`REPLICA_METHODS` (or :data:`ONE_REPLICA`, on one engine) on a fresh
    fleet of ``replicas`` replicas sharing ``capacity_tokens`` (module docstring).

    Raises:
        ValueError: an unknown method or mode, or ``replicas`` / ``in_flight_per_replica`` < 1.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if in_flight_per_replica < 1:
        raise ValueError(f"in_flight_per_replica must be >= 1, got {in_flight_per_replica}")
    if method == ONE_REPLICA:
        result = run_method(
            "contextpilot",
            prepared,
            mode=mode,
            engine_factory=lambda: EmbeddedEngine(
                capacity_tokens, counter=counter, tokenizer=tokenizer, block_size=block_size
            ),
        )
        result.method = ONE_REPLICA
        return ReplicaRun(ONE_REPLICA, 1, capacity_tokens, result, [0] * len(result.records))
    fleet = Fleet(
        replicas, capacity_tokens, counter=counter, tokenizer=tokenizer, block_size=block_size
    )
    context = _Context(prepared, fleet, mode, in_flight_per_replica * replicas, counter, tokenizer)
    if method in BASELINE_POLICIES:
        policy = new_policy(BASELINE_POLICIES[method], replicas)
        _through_gateway(context, policy, None, None)
        return context.run(method, _gateway_figures(policy))
    if method == BLIND:
        return _run_blind(context)
    if method == ROUTING:
        return _run_routing(context)
    raise ValueError(f"unknown method {method!r}; choose from {[*REPLICA_METHODS, ONE_REPLICA]}")


def compare_replicas(
    prepared: PreparedWorkload,
    counts: Sequence[int],
    capacity_tokens: int | None,
    *,
    methods: Sequence[str] = REPLICA_METHODS,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> tuple[ReplicaRun, dict[int, list[ReplicaRun]]]:
    """The reference (:data:`ONE_REPLICA`) and, per replica count, each method's run.

    Args:
        prepared: the retrieved workload.
        counts: replica counts (each >= 1).
        capacity_tokens: the total capacity, the same at every count (None: unlimited).
        methods: from :data:`REPLICA_METHODS`.
        progress: called with a line as each run finishes (e.g. ``logger.info``).
        options: ``counter``, ``tokenizer``, ``block_size``, ``mode``,
            ``in_flight_per_replica`` (:func:`run_embedded_replica_method`).
    """
    say = progress or (lambda line: None)

    def timed(method: str, n: int) -> ReplicaRun:
        start = time.perf_counter()
        run = run_embedded_replica_method(method, prepared, n, capacity_tokens, **options)
        say(
            f"{n} replica(s), {method}: hit ratio {run.hit_ratio:.4f} in "
            f"{time.perf_counter() - start:.1f} s"
        )
        return run

    reference = timed(ONE_REPLICA, 1)
    return reference, {n: [timed(m, n) for m in methods] for n in counts}
