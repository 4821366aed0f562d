"""The proxy's planning window over N replicas, replayed in virtual time on the paged model.

The replicas benchmark's one-replica reference (``1-replica model hit``) is the stream of a
plan made over the whole workload at once: an offline schedule. The proxy sees its calls in
arrival order and plans each window alone, so its ratio to that reference mixes two costs:
"two replicas against one" and "online windows against one offline plan". This replays the
same arrival process through the same window (the core's closing rule,
:meth:`~contextpilot_integrations.core.window.window_policy.WindowPolicy.group`, with the
proxy's ``max_batch`` and adaptive closing) and the same planner the proxy hosts (a
:class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`: ``plan_batch`` for a
window, ``plan`` for a window of one, as ``PlanningWindow`` does), sending each window's plans
in its schedule order to one paged prefix-cache model per replica
(:class:`~contextpilot_bench.prefix_cache_model.PrefixCacheModel`, vLLM's block pool) and
handing each model's evictions to the router, as the replicas' KV events do. Pipelined, each
window is planned before the previous one is served, as the live proxy plans a window while
the previous window's calls still wait at their replica: what a router that knows (or does
not know) the replicas' KV capacity then believes cached shows.

With one replica holding the fleet's total KV it is the same-arrival one-replica ContextPilot
figure (the fair denominator of the proxy's hit ratio); with the fleet's replicas it is what
the proxy's routing would reach if every call were served in schedule order, one at a time.
Nothing sleeps: 160 requests take seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextpilot_bench.arrivals import Arrivals
from contextpilot_bench.methods import PreparedWorkload
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.core.window.window_policy import WindowPolicy

__all__ = ["WindowedFleetRun", "run_windowed_fleet_model"]


@dataclass(frozen=True)
class WindowedFleetRun:
    """One replay.

    Attributes:
        replicas: how many replicas (paged models) served it.
        capacity_tokens: each replica's KV capacity, tokens.
        window_ms: the planning window.
        requests: how many requests were sent.
        windows: how many windows the arrivals closed.
        pipelined, known_capacity: as :func:`run_windowed_fleet_model` was called.
        prompt_tokens, cached_tokens: over every request.
        prompt_tokens_per_replica: in replica order.
    """

    replicas: int
    capacity_tokens: int
    window_ms: float
    requests: int
    windows: int
    pipelined: bool
    known_capacity: bool
    prompt_tokens: int
    cached_tokens: int
    prompt_tokens_per_replica: tuple[int, ...]

    @property
    def hit_ratio(self) -> float:
        """Cached over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_batch(self) -> float:
        """Requests per window."""
        return self.requests / self.windows if self.windows else 0.0


def run_windowed_fleet_model(
    prepared: PreparedWorkload,
    arrivals: Arrivals,
    window_ms: float,
    *,
    replicas: int,
    capacity_tokens: int,
    block_size: int,
    tokenize: Callable[[Sequence[Mapping[str, str]]], list[int]],
    max_batch: int = 64,
    adaptive: bool = True,
    known_capacity: bool = False,
    pipelined: bool = False,
    router_options: Mapping[str, Any] | None = None,
) -> WindowedFleetRun:
    """Replay ``prepared`` at ``arrivals`` through windows of ``window_ms`` (module docstring).

    Args:
        replicas: paged models, each of ``capacity_tokens`` (>= 1).
        tokenize: chat messages -> the token ids the engine prefills.
        max_batch, adaptive: the window's most requests and its adaptive closing (the
            proxy's ``PlanningWindow`` defaults).
        known_capacity: the router is told each replica's KV capacity (its
            ``kv_capacity_tokens``), as the proxy's fleet may be.
        pipelined: each window is planned before the previous one is served, as the live
            proxy plans a window while the previous window's calls still wait at their
            replica (False: served before the next is planned).
        router_options: more ``ReplicaRouter`` keywords (the fleet's ``load``,
            ``max_imbalance``).

    Raises:
        ValueError: ``replicas`` < 1, or ``arrivals`` does not have one time per request.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    requests = prepared.workload.requests
    if len(arrivals.order) != len(requests):
        raise ValueError(f"{len(arrivals.order)} arrival times for {len(requests)} requests")
    batch = [
        PlanRequest(requests[i].query, prepared.block_texts(i), f"model-{requests[i].id}")
        for i in arrivals.order
    ]
    policy = WindowPolicy(window_s=window_ms / 1000, max_batch=max_batch, adaptive=adaptive)
    windows = policy.group(list(zip(arrivals.times_s.tolist(), batch, strict=True)))
    names = [f"replica-{i}" for i in range(replicas)]
    models = {
        name: PrefixCacheModel(capacity_tokens, block_size=block_size, paged=True) for name in names
    }
    served = dict.fromkeys(names, 0)
    prompt = cached = 0
    with ReplicaRouter(
        [
            {"name": name, **({"kv_capacity_tokens": capacity_tokens} if known_capacity else {})}
            for name in names
        ],
        layout=prepared.layout,
        token_counter=prepared.counter,
        **(router_options or {}),
    ) as router:

        def serve(plans: list[Plan]) -> None:
            nonlocal prompt, cached
            for plan in plans:
                name = plan.replica or names[0]
                ids = tokenize(plan.messages)
                cached += models[name].serve(ids, rid=plan.rid)
                prompt += len(ids)
                served[name] += len(ids)
                for model in models.values():
                    for rid in model.take_evicted_rids():
                        router.evict(rid)

        waiting: list[Plan] = []
        for _, members in windows:
            plans = _plan_window(router, [batch[i] for i in members])
            if pipelined:
                serve(waiting)
                waiting = plans
            else:
                serve(plans)
        serve(waiting)
    return WindowedFleetRun(
        replicas,
        capacity_tokens,
        window_ms,
        len(batch),
        len(windows),
        pipelined,
        known_capacity,
        prompt,
        cached,
        tuple(served[name] for name in names),
    )


def _plan_window(router: ReplicaRouter, requests: list[PlanRequest]) -> list[Plan]:
    """One window's plans in the order they are sent (its schedule)."""
    if len(requests) == 1:
        (request,) = requests
        return [router.plan(request.query, request.blocks, rid=request.rid)]
    planned = router.plan_batch(requests)
    return [planned.plans[i] for i in planned.schedule]
