"""The benchmarked methods, run side by side on one retrieved workload.

Methods (each yields one :class:`RequestRecord` per request, through a fresh engine):

``baseline``
    Retriever order, arrival order, no order annotation: an application without ContextPilot.
``contextpilot``
    One fresh :class:`~contextpilot_integrations.ContextPilot` per run, following the engine's
    cache: ``ContextPilot(engine=EngineLink(engine.cache_sync))`` for an engine that publishes
    KV events (the core's engine link evicts from the index), else the request ids the engine model
    evicts are passed back to :meth:`ContextPilot.evict` (the eviction sync of the paper,
    section 4.3). ``offline``: the whole workload is one batch of
    :class:`~contextpilot_integrations.core.request.PlanRequest`,
    :meth:`ContextPilot.plan_batch`, sent in ``batch.schedule`` order. ``online``:
    :meth:`ContextPilot.plan` one request at a time in arrival order.
``clairvoyant-arrival``
    A reference for the online mode: the order a planner that knows every future request
    would give each request, served without rescheduling. Each request's blocks come in the
    order the offline mode gives them (one :meth:`ContextPilot.plan_batch` over the whole
    workload), and the requests are sent in arrival order, as the baseline and the online mode
    send them. It is the fair reference for the online mode, which sees the same arrival
    order but not the future: the online mode's share of it says what anticipating later
    requests could still gain. Not a bound: the offline build does not maximise the hits of
    the arrival order, and an online order can beat it.
``contextpilot warm-start`` (``--warm-start half``)
    Every method serves the second half of the requests (by arrival); this one is ContextPilot
    whose pilot first learned the first half (:meth:`ContextPilot.warm_start`: the ordering
    memories only, no request indexed or sent), printed beside ``clairvoyant-arrival`` of the
    same second half.
``upper-bound``
    Not a real schedule: unlimited cache and free order, so each request is credited with the
    largest token overlap (the tokens of the blocks both prompts contain) with any other
    request, plus the system prompt; one sparse product ``W @ A.T`` (requests x blocks), so the
    cost is the number of request pairs that share a block, not ``N**2``. The engine rule
    applies (the last prompt token recomputed; whole blocks only), with the benchmark's token
    counter: against a real engine's own counts (chat template included) it is approximate.

Cache capacity (``--cache-tokens``): an integer is a number of tokens; a number with a decimal
point (``0.05``) is a fraction of the workload's *unique block tokens* (the sum, over distinct
retrieved block texts, of their token counts); ``unlimited`` (or ``none``) is no limit. The
system prompt is shared by all requests and takes cache space like any other segment.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from scipy import sparse
from tqdm import tqdm

from contextpilot_bench.engine import EmbeddedEngine, Engine, Served
from contextpilot_bench.prefix_cache_model import CacheStats
from contextpilot_bench.retrieval import retrieve_top_k
from contextpilot_bench.workloads import Document, Workload
from contextpilot_integrations.core.blocks import TokenCounter, block_id
from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest

if TYPE_CHECKING:
    from contextpilot_integrations.sync.engine_link import EngineLink

__all__ = [
    "CLAIRVOYANT_ARRIVAL",
    "METHODS",
    "MethodResult",
    "PreparedWorkload",
    "RequestRecord",
    "WARM_START",
    "engine_link",
    "new_pilot",
    "pilot_link",
    "parse_cache_tokens",
    "prepare_workload",
    "resolve_cache_tokens",
    "run_method",
    "run_methods",
    "run_warm_started",
    "send",
    "upper_bound_records",
]

logger = logging.getLogger(__name__)

CLAIRVOYANT_ARRIVAL = "clairvoyant-arrival"
WARM_START = "contextpilot warm-start"
"""With ``--warm-start half``: ContextPilot on the second half, warm-started on the first."""
METHODS = ("baseline", "contextpilot", "upper-bound", CLAIRVOYANT_ARRIVAL)
MODES = ("offline", "online")


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request cost.

    Attributes:
        request_index: position of the request in the workload's arrival order.
        rid: the request id sent to the engine.
        prompt_tokens: tokens of the whole prompt (system prompt, blocks, tail).
        cached_tokens: prompt tokens served from the prefix cache (``None``: the engine did
            not report them).
        ttft_s: time to first token in seconds (real engines only).
    """

    request_index: int
    rid: str
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float | None = None


@dataclass
class MethodResult:
    """One method's run.

    Attributes:
        method: method name.
        records: one record per request, in the order the requests were sent.
        plan_seconds: wall time spent planning (ContextPilot calls; 0 for the others).
        cache: the embedded cache model's counters (``None`` for a real engine / the bound).
        index: ContextPilot index statistics after the run (contextpilot only).
    """

    method: str
    records: list[RequestRecord]
    plan_seconds: float = 0.0
    cache: CacheStats | None = None
    index: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens or 0 for r in self.records)

    @property
    def prefill_tokens(self) -> int:
        """Tokens the engine had to compute: prompt tokens minus cached tokens."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens / prompt tokens (0 for an empty run)."""
        total = self.prompt_tokens
        return self.cached_tokens / total if total else 0.0


# --- the prepared workload -------------------------------------------------------------------


@dataclass
class PreparedWorkload:
    """A workload with its retrieval done, shared by all methods of a run.

    Attributes:
        workload: the workload.
        k: documents retrieved per request.
        retrieved: per request (arrival order), the top-k documents, best first.
        layout: the prompt layout every method renders with.
        counter: the token counter every method counts with.
    """

    workload: Workload
    k: int
    retrieved: list[list[Document]]
    layout: PromptLayout
    counter: TokenCounter

    def block_texts(self, i: int) -> list[str]:
        """Block texts of request ``i`` in retriever order."""
        return [d.text for d in self.retrieved[i]]

    @property
    def unique_block_tokens(self) -> int:
        """Sum of the token counts of the distinct retrieved block texts."""
        texts = {d.text for docs in self.retrieved for d in docs}
        return sum(self.counter.count(t) for t in texts)

    def halves(self) -> tuple[PreparedWorkload, PreparedWorkload]:
        """The first ``n // 2`` requests (in the order held: by arrival once
        :meth:`reordered`) and the rest, each with its retrieved documents."""
        half = len(self.retrieved) // 2
        w = self.workload
        return tuple(  # type: ignore[return-value]
            PreparedWorkload(
                Workload(w.name, w.corpus, w.requests[part]),
                self.k,
                self.retrieved[part],
                self.layout,
                self.counter,
            )
            for part in (slice(0, half), slice(half, None))
        )

    def reordered(self, order: Sequence[int]) -> PreparedWorkload:
        """The same workload with its requests (and their retrieved documents) in ``order``,
        a permutation of the request indices: the arrival order of a replay.

        Raises:
            ValueError: ``order`` is not a permutation of ``range(len(requests))``.
        """
        n = len(self.retrieved)
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must be a permutation of range({n})")
        if list(order) == list(range(n)):
            return self
        w = self.workload
        requests = tuple(w.requests[i] for i in order)
        retrieved = [self.retrieved[i] for i in order]
        return PreparedWorkload(
            Workload(w.name, w.corpus, requests), self.k, retrieved, self.layout, self.counter
        )


def prepare_workload(
    workload: Workload,
    k: int,
    *,
    layout: PromptLayout | None = None,
    counter: TokenCounter,
) -> PreparedWorkload:
    """Retrieve the top-``k`` documents of every request (BM25, scoped per corpus)."""
    retrieved = retrieve_top_k(workload, k)
    return PreparedWorkload(workload, k, retrieved, layout or PromptLayout(), counter)


# --- cache capacity --------------------------------------------------------------------------


def parse_cache_tokens(text: str) -> int | float | None:
    """Parse ``--cache-tokens``.

    Returns:
        ``None`` for ``unlimited``/``none``; an ``int`` (tokens) for an integer literal; a
        ``float`` (fraction of unique block tokens) for a number with a decimal point or an
        exponent.

    Raises:
        ValueError: not a number, not finite (``inf``: spell no limit ``unlimited``), or not
            > 0 (the message names the value).
    """
    value = text.strip().lower()
    if value in ("unlimited", "none"):
        return None
    try:
        parsed: int | float = int(value)
    except ValueError:
        try:
            parsed = float(value)
        except ValueError:
            raise ValueError(
                f"--cache-tokens must be an int (tokens), a fraction such as 0.05, or "
                f"'unlimited'; got {text!r}"
            ) from None
    if not (parsed > 0 and math.isfinite(parsed)):
        raise ValueError(
            f"--cache-tokens must be a finite number > 0 (no limit: 'unlimited'), got {text!r}"
        )
    return parsed


def resolve_cache_tokens(spec: int | float | None, unique_block_tokens: int) -> int | None:
    """Capacity in tokens: ``spec`` tokens, or ``ceil(spec * unique_block_tokens)`` for a float.

    Raises:
        ValueError: ``spec`` is not > 0.
    """
    if spec is None:
        return None
    if not spec > 0:
        raise ValueError(f"cache capacity must be > 0, got {spec!r}")
    if isinstance(spec, float):
        return max(1, math.ceil(spec * unique_block_tokens))
    return int(spec)


# --- methods ---------------------------------------------------------------------------------


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


def engine_link(cache_sync: Mapping[str, Any] | None) -> EngineLink | None:
    """An unbound engine link following ``cache_sync`` (the pilot given it binds, starts and
    closes it), None without one; the ``sync`` extra is imported only then."""
    if cache_sync is None:
        return None
    from contextpilot_integrations.sync.engine_link import EngineLink

    return EngineLink(cache_sync)


def pilot_link(pilot: ContextPilot | None) -> EngineLink | None:
    """``pilot``'s engine link, None without one: an :class:`EngineLink` (the benchmark gives
    its pilots none other, :func:`engine_link`)."""
    return cast("EngineLink | None", pilot.engine if pilot is not None else None)


def new_pilot(
    prepared: PreparedWorkload, engine: Engine, ordering: OrderingConfig | None = None
) -> ContextPilot:
    """The ContextPilot a method runs with: the workload's layout and counter, following
    ``engine`` through ``engine=engine_link(engine.cache_sync)``, ordering as ``ordering``
    says (default the library's); the caller closes it."""
    return ContextPilot(
        layout=prepared.layout,
        token_counter=prepared.counter,
        engine=engine_link(engine.cache_sync),
        ordering=ordering,
    )


def send(engine: Engine, rid: str, segments: Sequence[str], pilot: ContextPilot | None) -> Served:
    """Serve one request; when ``pilot`` follows the engine through its engine link, give the
    link the prompt's token ids (attribution of the engine's KV events by token matching)."""
    served = engine.serve(rid, segments)
    link = pilot_link(pilot)
    if link is not None and served.token_ids is not None:
        link.register_tokens(rid, served.token_ids)
    return served


def _record(index: int, rid: str, served: Served) -> RequestRecord:
    return RequestRecord(index, rid, served.prompt_tokens, served.cached_tokens, served.ttft_s)


def _run_baseline(prepared: PreparedWorkload, engine: Engine, progress: bool) -> MethodResult:
    records = []
    layout = prepared.layout
    with _progress(len(prepared.retrieved), "baseline", progress) as bar:
        for i, request in enumerate(prepared.workload.requests):
            rid = f"baseline-{request.id}"
            segments = layout.render_segments(prepared.block_texts(i), request.query)
            records.append(_record(i, rid, send(engine, rid, segments, None)))
            bar.update()
    engine.sync(None)
    return MethodResult("baseline", records)


def _run_contextpilot(
    prepared: PreparedWorkload,
    engine: Engine,
    mode: str,
    pilot: ContextPilot,
    progress: bool,
) -> MethodResult:
    requests = prepared.workload.requests
    rids = [f"contextpilot-{r.id}" for r in requests]
    records = []
    plan_seconds = 0.0
    engine.sync(pilot)
    if mode == "offline":
        start = time.perf_counter()
        batch = _plan_whole_workload(prepared, pilot, rids)
        plan_seconds = time.perf_counter() - start
        with _progress(len(requests), "contextpilot", progress) as bar:
            for i in batch.schedule:
                plan = batch.plans[i]
                records.append(_record(i, plan.rid, send(engine, plan.rid, plan.segments, pilot)))
                bar.update()
    else:
        with _progress(len(requests), "contextpilot", progress) as bar:
            for i, request in enumerate(requests):
                start = time.perf_counter()
                plan = pilot.plan(request.query, prepared.block_texts(i), rid=rids[i])
                plan_seconds += time.perf_counter() - start
                records.append(_record(i, plan.rid, send(engine, plan.rid, plan.segments, pilot)))
                start = time.perf_counter()
                for rid in engine.take_evicted_rids():
                    pilot.evict(rid)
                plan_seconds += time.perf_counter() - start
                bar.update()
    engine.sync(pilot)
    return MethodResult("contextpilot", records, plan_seconds=plan_seconds, index=pilot.stats())


def run_warm_started(
    prepared: PreparedWorkload,
    sample: PreparedWorkload,
    *,
    mode: str,
    engine_factory: Callable[[], Engine],
    progress: bool = False,
    ordering: OrderingConfig | None = None,
    method: str = WARM_START,
) -> MethodResult:
    """ContextPilot (``mode`` as :func:`run_method`) on ``prepared`` through a fresh engine, its
    pilot (ordering as ``ordering`` says) first warm-started (:meth:`ContextPilot.warm_start`)
    on ``sample``'s requests, which are neither indexed nor sent: named ``method`` (default
    :data:`WARM_START`).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    engine = engine_factory()
    with new_pilot(prepared, engine, ordering) as pilot:
        pilot.warm_start(
            [
                PlanRequest(r.query, sample.block_texts(i))
                for i, r in enumerate(sample.workload.requests)
            ]
        )
        result = _run_contextpilot(prepared, engine, mode, pilot, progress)
    result.method = method
    if isinstance(engine, EmbeddedEngine):
        result.cache = engine.model.stats()
    return result


def _plan_whole_workload(
    prepared: PreparedWorkload, pilot: ContextPilot, rids: Sequence[str]
) -> BatchPlan:
    """The offline mode's plan: every request of the workload in one batch."""
    requests = prepared.workload.requests
    return pilot.plan_batch(
        [PlanRequest(r.query, prepared.block_texts(i), rids[i]) for i, r in enumerate(requests)]
    )


def _run_clairvoyant_arrival(
    prepared: PreparedWorkload, engine: Engine, pilot: ContextPilot, progress: bool
) -> MethodResult:
    """The offline mode's plans sent in arrival order (``batch.plans`` is in input order)."""
    rids = [f"{CLAIRVOYANT_ARRIVAL}-{r.id}" for r in prepared.workload.requests]
    engine.sync(pilot)
    start = time.perf_counter()
    batch = _plan_whole_workload(prepared, pilot, rids)
    plan_seconds = time.perf_counter() - start
    records = []
    with _progress(len(rids), CLAIRVOYANT_ARRIVAL, progress) as bar:
        for i, plan in enumerate(batch.plans):
            records.append(_record(i, plan.rid, send(engine, plan.rid, plan.segments, pilot)))
            bar.update()
    engine.sync(pilot)
    return MethodResult(
        CLAIRVOYANT_ARRIVAL, records, plan_seconds=plan_seconds, index=pilot.stats()
    )


def upper_bound_records(prepared: PreparedWorkload, block_size: int = 1) -> list[RequestRecord]:
    """Per request: the largest block-token overlap with any other request, plus the system
    prompt (unlimited cache, free order).

    Block identity is ``block_id`` of the block text; a block's weight is the token count of
    its rendered segment in the request's own (baseline) prompt. Prompt tokens are those of the
    baseline prompt. Cached tokens are ``min(overlap + system, prompt - 1)`` rounded down to
    ``block_size``.

    Returns:
        One record per request in arrival order.
    """
    layout, counter = prepared.layout, prepared.counter
    n = len(prepared.retrieved)
    column: dict[int, int] = {}
    rows: list[int] = []
    cols: list[int] = []
    weights: list[int] = []
    prompt_tokens = np.zeros(n, dtype=np.int64)
    system_tokens = np.zeros(n, dtype=np.int64)
    token_memo: dict[str, int] = {}

    def count(text: str) -> int:
        c = token_memo.get(text)
        if c is None:
            c = token_memo[text] = counter.count(text)
        return c

    for i, request in enumerate(prepared.workload.requests):
        texts = prepared.block_texts(i)
        segments = layout.render_segments(texts, request.query)
        prompt_tokens[i] = sum(count(s) for s in segments)
        system_tokens[i] = count(segments[0])
        seen: set[int] = set()
        for text, segment in zip(texts, segments[1:-1], strict=True):
            bid = block_id(text)
            if bid in seen:
                continue
            seen.add(bid)
            rows.append(i)
            cols.append(column.setdefault(bid, len(column)))
            weights.append(count(segment))
    shape = (n, max(len(column), 1))
    weighted = sparse.csr_matrix((np.asarray(weights, dtype=np.int64), (rows, cols)), shape=shape)
    present = sparse.csr_matrix((np.ones(len(rows), dtype=np.int64), (rows, cols)), shape=shape)
    overlap = (weighted @ present.T).tocsr()  # overlap[i, j] = tokens of i's blocks also in j
    overlap.setdiag(0)
    overlap.eliminate_zeros()
    best = np.asarray(overlap.max(axis=1).todense()).ravel() if n else np.zeros(0, np.int64)
    cached = np.minimum(best + system_tokens, np.maximum(prompt_tokens - 1, 0))
    cached -= cached % block_size
    return [
        RequestRecord(i, f"upper-bound-{r.id}", int(prompt_tokens[i]), int(cached[i]))
        for i, r in enumerate(prepared.workload.requests)
    ]


def run_method(
    method: str,
    prepared: PreparedWorkload,
    *,
    mode: str,
    engine_factory: Callable[[], Engine],
    pilot_factory: Callable[[], ContextPilot] | None = None,
    block_size: int = 1,
    progress: bool = False,
) -> MethodResult:
    """Run one method through a fresh engine from ``engine_factory``.

    Args:
        method: one of :data:`METHODS`.
        prepared: the retrieved workload.
        mode: ``"offline"`` or ``"online"`` (only ``contextpilot`` differs;
            ``clairvoyant-arrival`` is the offline plan in either).
        engine_factory: returns a fresh (empty-cache) engine.
        pilot_factory: returns a fresh ContextPilot (for ``contextpilot`` and
            ``clairvoyant-arrival``), the caller's to close (default: :func:`new_pilot`, closed
            after the run).
        block_size: engine block size for the upper bound.
        progress: show a tqdm progress bar on stderr.

    Raises:
        ValueError: unknown method or mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if method == "upper-bound":
        return MethodResult(method, upper_bound_records(prepared, block_size))
    if method == "baseline":
        engine = engine_factory()
        result = _run_baseline(prepared, engine, progress)
    elif method == "contextpilot":
        engine = engine_factory()
        if pilot_factory is not None:
            result = _run_contextpilot(prepared, engine, mode, pilot_factory(), progress)
        else:
            with new_pilot(prepared, engine) as pilot:
                result = _run_contextpilot(prepared, engine, mode, pilot, progress)
    elif method == CLAIRVOYANT_ARRIVAL:
        engine = engine_factory()
        if pilot_factory is not None:
            result = _run_clairvoyant_arrival(prepared, engine, pilot_factory(), progress)
        else:
            with new_pilot(prepared, engine) as pilot:
                result = _run_clairvoyant_arrival(prepared, engine, pilot, progress)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(engine, EmbeddedEngine):
        result.cache = engine.model.stats()
    return result


def run_methods(
    methods: Sequence[str],
    prepared: PreparedWorkload,
    **kwargs: object,
) -> list[MethodResult]:
    """:func:`run_method` for each method, in the given order (same keyword arguments).

    Raises:
        ValueError: an unknown or repeated method.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods must not repeat, got {list(methods)}")
    results = []
    for method in methods:
        start = time.perf_counter()
        results.append(run_method(method, prepared, **kwargs))  # type: ignore[arg-type]
        logger.info("%s done in %.2f s", method, time.perf_counter() - start)
    return results
