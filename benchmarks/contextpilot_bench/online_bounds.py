"""How much of the gap between the online mode and ``clairvoyant-arrival`` an online planner
could close: two references printed beside the clairvoyant order (``--online-bounds``).

``contextpilot oracle-history``
    The best history a deployment could learn from: ContextPilot whose pilot first learned
    (:meth:`ContextPilot.warm_start`: the popularity and co-occurrence memories only) the very
    requests it then serves online, in arrival order, none of them indexed (no plan counts a
    request as cached before it was sent), with a co-occurrence memory of at least twice the
    workload so nothing learned is forgotten while it serves. What it misses of
    ``clairvoyant-arrival`` no ordering rule that learns from past traffic through these
    memories recovers, however long the deployment has run: the same requests again are the
    most any history could say about them.
``lookahead-K``
    An aligner that knows the next ``K`` requests and nothing further: each request in arrival
    order is planned in one batch (:meth:`ContextPilot.plan_batch`, the offline build) with
    the ``K`` requests after it, against the index of the requests sent so far; only its own
    plan is sent, and the ``K`` others are taken out of the index again (each is planned for
    real when its turn comes). ``lookahead-0`` is the batch rule on one request (the matched
    prefix, then the rest in the offline build's order), with no memory of past traffic;
    as ``K`` grows towards the workload's length it approaches ``clairvoyant-arrival`` (the
    first request is planned exactly as there). The share of the clairvoyant figure each ``K``
    reaches is how much of the gain needs that much knowledge of the future.

Both are references, not planners a user runs: they read requests before they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from contextpilot_bench.engine import EmbeddedEngine, Engine
from contextpilot_bench.methods import (
    MethodResult,
    PreparedWorkload,
    RequestRecord,
    new_pilot,
    run_warm_started,
    send,
)
from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.request import PlanRequest

__all__ = [
    "DEFAULT_LOOKAHEADS",
    "LOOKAHEAD_PREFIX",
    "ORACLE_HISTORY",
    "is_online_bound",
    "lookahead_name",
    "parse_lookaheads",
    "run_lookahead",
    "run_online_bounds",
    "run_oracle_history",
]

ORACLE_HISTORY = "contextpilot oracle-history"
LOOKAHEAD_PREFIX = "lookahead-"
DEFAULT_LOOKAHEADS = (0, 1, 4, 16, 64)
"""The lookaheads ``--online-bounds`` runs when given no list."""


def lookahead_name(k: int) -> str:
    """The method name of lookahead ``k`` (``"lookahead-16"``)."""
    return f"{LOOKAHEAD_PREFIX}{k}"


def is_online_bound(method: str) -> bool:
    """Whether ``method`` is one of this module's references."""
    return method == ORACLE_HISTORY or method.startswith(LOOKAHEAD_PREFIX)


def parse_lookaheads(text: str) -> list[int]:
    """``--online-bounds``: comma-separated lookaheads, each an int >= 0, none repeated.

    Raises:
        ValueError: an empty list, a value that is not an int >= 0, or a repeated value.
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--online-bounds must be integers >= 0 separated by commas, got {text!r}"
        ) from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--online-bounds must be integers >= 0, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"--online-bounds must not repeat a value, got {text!r}")
    return values


def run_oracle_history(
    prepared: PreparedWorkload, *, engine_factory: Callable[[], Engine], progress: bool = False
) -> MethodResult:
    """Method :data:`ORACLE_HISTORY` (module docstring) on ``prepared``, online."""
    horizon = max(OrderingConfig().cooccurrence_memory, 2 * len(prepared.retrieved))
    return run_warm_started(
        prepared,
        prepared,
        mode="online",
        engine_factory=engine_factory,
        progress=progress,
        ordering=OrderingConfig(cooccurrence_memory=horizon),
        method=ORACLE_HISTORY,
    )


def run_lookahead(
    prepared: PreparedWorkload, k: int, *, engine_factory: Callable[[], Engine]
) -> MethodResult:
    """Method ``lookahead-k`` (module docstring) on ``prepared`` through a fresh engine.

    Raises:
        ValueError: ``k`` below 0.
    """
    if k < 0:
        raise ValueError(f"lookahead must be >= 0, got {k}")
    name = lookahead_name(k)
    requests = prepared.workload.requests
    n = len(requests)
    engine = engine_factory()
    records = []
    plan_seconds = 0.0
    with new_pilot(prepared, engine) as pilot:
        engine.sync(pilot)
        for i, request in enumerate(requests):
            start = time.perf_counter()
            ahead = range(i + 1, min(n, i + 1 + k))
            batch = pilot.plan_batch(
                [PlanRequest(request.query, prepared.block_texts(i), f"{name}-{request.id}")]
                + [
                    PlanRequest(requests[j].query, prepared.block_texts(j), f"{name}-ahead-{j}")
                    for j in ahead
                ]
            )
            for j in ahead:  # known, not sent: planned for real at its own turn
                pilot.evict(f"{name}-ahead-{j}")
            plan = batch.plans[0]
            plan_seconds += time.perf_counter() - start
            sent = send(engine, plan.rid, plan.segments, pilot)
            records.append(
                RequestRecord(i, plan.rid, sent.prompt_tokens, sent.cached_tokens, sent.ttft_s)
            )
            for rid in engine.take_evicted_rids():
                pilot.evict(rid)
        engine.sync(pilot)
    result = MethodResult(name, records, plan_seconds=plan_seconds)
    if isinstance(engine, EmbeddedEngine):
        result.cache = engine.model.stats()
    return result


def run_online_bounds(
    prepared: PreparedWorkload,
    lookaheads: Sequence[int],
    *,
    engine_factory: Callable[[], Engine],
    progress: bool = False,
) -> list[MethodResult]:
    """:func:`run_oracle_history`, then :func:`run_lookahead` for each of ``lookaheads``."""
    results = [run_oracle_history(prepared, engine_factory=engine_factory, progress=progress)]
    for k in lookaheads:
        results.append(run_lookahead(prepared, k, engine_factory=engine_factory))
    return results
