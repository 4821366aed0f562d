"""What offline ordering can reach: bounds on, and the exact optimum of, the unlimited-cache hit.

The problem
-----------
Request ``i`` holds a set ``S_i`` of *units*, each with a weight in tokens: its distinct blocks
(a text repeated within one request is a second unit, held by the requests that repeat it) and
its tail (annotation and question, shareable only by a request with the same question). The
system prompt, ``s`` tokens, is a prefix of every prompt. An ordering gives every request a
permutation of its units. With an unlimited prefix cache, whatever the schedule, every node of
the batch's prefix trie is computed once, by the first request through it, and matched by every
later one, so the cached tokens of the batch are::

    cached = (N - 1) s + sum over trie nodes v of (|M_v| - 1) w_v        (M_v: requests through v)

and the hit ratio is ``1 - trie tokens / prompt tokens``. (The engine's last-token rule and block
rounding only lower the real figure, so every bound below holds for them too.) A unit's weight
``w_u`` is its rendered segment's token count at its heaviest prompt position (the label
``[Doc 10]`` may cost a token more than ``[Doc 9]``), so the bounds hold for every position; the
optimum computed with these weights exceeds the true one by at most that token per shared node.

The optimum is a tree (:func:`optimal_orders`)
------------------------------------------------
**Theorem.** ``max over orderings of cached = (N - 1) s + max over rooted binary trees T with the
requests as leaves of sum over internal nodes P of w(I_P)``, where ``I_P`` is the intersection
of ``S_i`` over the leaves ``i`` below ``P``.

*Reached:* order top-down (the paper's offline build, section 4.1): node ``P`` appends the units
``I_P \\ I_parent(P)`` to its parent's order, a leaf appends the rest. Every leaf below ``P``
then shares those units at one trie node, saving ``(|P| - 1) w(I_P \\ I_parent)``; summed over
``P`` this is ``sum_P (children(P) - 1) w(I_P)`` (telescoping), ``sum_P w(I_P)`` for a binary tree.
*Not exceeded:* the member sets of a trie's nodes form a laminar family, so a tree ``T'``. A
unit ``u`` labels disjoint trie nodes, each inside ``H_u`` (the requests holding ``u``) and so
inside one maximal node ``M*`` of ``T'`` contained in ``H_u``; those nodes save at most
``(|M*| - 1) w_u``, which is what the top-down order of ``T'`` credits ``u``. Splitting a node
with more than two children into two never lowers ``sum_P (children(P) - 1) w(I_P)``.

So the cluster build is optimal *given its tree*; only the tree is left to choose (an NP-hard
problem: it is Camin-Sokal parsimony with units as characters, Day, Johnson and Sankoff 1986).
:func:`optimal_orders` solves it exactly for up to :data:`MAX_EXACT_REQUESTS` requests by the
subset recursion ``f(Z) = w(I_Z) + max over splits Z = A + B of f(A) + f(B)`` (``3**N / 2`` steps,
vectorised per subset size).

Upper bounds for a whole workload (:func:`offline_bounds`)
----------------------------------------------------------
*Spanning forest* (:func:`spanning_forest_bound`). Give each internal node ``P`` of ``T`` the
edge between the leftmost leaves of its two children: these ``N - 1`` edges form a spanning tree
of the requests, and ``w(I_P) <= w(S_a & S_b)`` for the edge ``(a, b)``. So the optimum is at
most the maximum spanning forest of the overlap graph (edge weight ``w(S_i & S_j)``). It is
never above today's bound (each request's best overlap with any other; up to the label token
above): rooting each tree, a request's parent edge weighs at most its best overlap, and each
root is credited nothing.

*Prefix intersection* (:func:`prefix_intersection_bound`). Request ``i`` in order ``b_1..b_k``
meets ``b_t`` at a trie node whose requests all start with ``b_1..b_t``, so hold all of them:
``|M| <= c_t = |H_{b_1} & ... & H_{b_t}|``. Writing ``(|M_v| - 1) w_v`` as ``w_v (1 - 1/|M_v|)``
for each of its ``|M_v|`` requests::

    cached - (N - 1) s = sum_i sum_t w_{b_t} (1 - 1/|M_{v(i,t)}|)
                      <= sum_i max over orders of S_i of sum_t w_{b_t} (1 - 1/c_t)

Each request's maximum is a dynamic program over the subsets of its shared units (units held by
one request only go last and save nothing). Beyond ``exact_units`` shared units per request the
rest are credited ``w_u (1 - 1/n_u)`` (``c_t <= n_u``), which keeps the bound valid.

*Two-level LP* (:func:`two_level_lp_bound`). The prefix bound lets every holder of a unit count
all the others at it, though each request starts with one unit only (a hub ``{a, b, c}`` with
the singles ``{a}, {b}, {c}``: the bound credits 2, the optimum is 1). The LP pays each trie
node of depth 1 and 2 once (a facility-location relaxation) and the deeper ones by the prefix
shares, so it is never looser than the prefix bound; it keeps an integrality gap (every pair of
four blocks as a request: it credits 4, the optimum is 3).

The tighter bound is the smallest of the three; each holds for every ordering and schedule
(``tests/bench/test_bounds.py`` checks them against the exact optimum on random batches, and the
optimum against brute force). Measured by ``benchmarks/bench_bounds.py`` (k=10): the tighter
bound's hit ratio is 0.539 / 0.455 / 0.455 on MultiHop-RAG / MTRAG / LoCoMo against today's
0.646 / 0.577 / 0.649, and 5-7% above the exact optimum on slices of 16 connected requests.

A tail unit may stand anywhere in these orders (a relaxation: only a request with the same
question can share it), so the optimum of a batch with repeated questions may read a tail's
tokens above the true one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.optimize import linprog
from scipy.sparse.csgraph import minimum_spanning_tree

from contextpilot_integrations.bench.methods import PreparedWorkload
from contextpilot_integrations.core.clustering import trie_tokens
from contextpilot_integrations.core.plan import Plan

__all__ = [
    "MAX_EXACT_REQUESTS",
    "OfflineBounds",
    "OptimalOrders",
    "OrderingProblem",
    "cached_tokens",
    "connected_slices",
    "offline_bounds",
    "optimal_orders",
    "ordering_problem",
    "orders_of_plans",
    "prefix_intersection_bound",
    "spanning_forest_bound",
    "two_level_lp_bound",
]

MAX_EXACT_REQUESTS = 18
"""Largest slice :func:`optimal_orders` takes (``3**18 / 2`` steps, a few seconds)."""

DEFAULT_EXACT_UNITS = 14
"""Shared units per request the prefix-intersection program orders exactly (``2**14`` subsets)."""

UnitKey = tuple[str, str, int]
"""``("block", text, occurrence)`` (occurrence 1 for the first copy in a request) or
``("tail", question, 1)``."""


@dataclass(frozen=True)
class OrderingProblem:
    """A batch as the ordering sees it.

    Attributes:
        units: per request, its unit indices in retriever order (its tail last), no repeats.
        unit_tokens: ``(U,)`` int64, the tokens a unit saves each time it is shared (its
            segment at its heaviest position).
        shared_tokens: tokens of the system prompt, a prefix of every request.
        prompt_tokens: ``(N,)`` int64, each request's baseline prompt (retriever order).
        unit_ids: unit key (:data:`UnitKey`) -> unit index.
    """

    units: tuple[tuple[int, ...], ...]
    unit_tokens: np.ndarray
    shared_tokens: int = 0
    prompt_tokens: np.ndarray | None = None
    unit_ids: Mapping[UnitKey, int] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.units)

    def holders(self) -> sparse.csr_matrix:
        """``(N, U)`` 0/1 int64 incidence matrix: request ``i`` holds unit ``u``."""
        n, u = len(self.units), len(self.unit_tokens)
        lengths = np.fromiter((len(x) for x in self.units), dtype=np.int64, count=n)
        rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
        cols = np.fromiter((v for x in self.units for v in x), dtype=np.int64, count=lengths.sum())
        data = np.ones(cols.size, dtype=np.int64)
        return sparse.csr_matrix((data, (rows, cols)), shape=(n, max(u, 1)))

    def restrict(self, requests: Sequence[int]) -> OrderingProblem:
        """The sub-batch of ``requests`` (indices), its units renumbered."""
        keep = sorted({u for i in requests for u in self.units[i]})
        new = {u: j for j, u in enumerate(keep)}
        ids = {k: new[v] for k, v in self.unit_ids.items() if v in new}
        prompts = None if self.prompt_tokens is None else self.prompt_tokens[list(requests)]
        return OrderingProblem(
            tuple(tuple(new[u] for u in self.units[i]) for i in requests),
            self.unit_tokens[keep].astype(np.int64),
            self.shared_tokens,
            prompts,
            ids,
        )


# --- Public API: the problem of a workload ----------------------------------------------------


def ordering_problem(prepared: PreparedWorkload) -> OrderingProblem:
    """The ordering problem of a retrieved workload, weighed as the benchmark renders it.

    A block unit weighs ``max over positions p < K`` of its rendered segment's tokens
    (``K``: the most blocks of any request); a tail unit, the larger of the question's tail
    with no annotation and with the annotation of all its blocks. Prompt tokens are the
    baseline prompts' (the denominator of the benchmark's upper bound).
    """
    layout, counter = prepared.layout, prepared.counter
    memo: dict[str, int] = {}

    def count(text: str) -> int:
        c = memo.get(text)
        if c is None:
            c = memo[text] = counter.count(text)
        return c

    positions = max((len(docs) for docs in prepared.retrieved), default=0)
    unit_ids: dict[UnitKey, int] = {}
    tokens: list[int] = []
    units: list[tuple[int, ...]] = []
    prompts = np.zeros(len(prepared.retrieved), dtype=np.int64)

    def unit(key: UnitKey, weight: int) -> int:
        index = unit_ids.get(key)
        if index is None:
            index = unit_ids[key] = len(tokens)
            tokens.append(weight)
        else:
            tokens[index] = max(tokens[index], weight)
        return index

    for i, request in enumerate(prepared.workload.requests):
        texts = prepared.block_texts(i)
        prompts[i] = sum(count(s) for s in layout.render_segments(texts, request.query))
        seen: dict[str, int] = {}
        mine: list[int] = []
        for text in texts:
            seen[text] = seen.get(text, 0) + 1
            key = ("block", text, seen[text])
            if key not in unit_ids:
                weight = max(count(layout.render_block(p, text)) for p in range(positions))
                unit(key, weight)
            mine.append(unit_ids[key])
        labels = [layout.label(p) for p in range(len(seen))]
        tail = max(
            count(layout.tail(request.query)),
            count(layout.tail(request.query, annotation_labels=labels)),
        )
        mine.append(unit(("tail", request.query, 1), tail))
        units.append(tuple(mine))
    return OrderingProblem(
        tuple(units),
        np.asarray(tokens, dtype=np.int64),
        count(layout.system_segment()),
        prompts,
        unit_ids,
    )


def cached_tokens(problem: OrderingProblem, orders: Sequence[Sequence[int]]) -> int:
    """Cached tokens of ``orders`` (unit indices per request) with an unlimited cache, any
    schedule: ``(N - 1) s`` plus the tokens the trie shares. An order may omit units (a
    planner that drops a duplicate block); they are not counted.

    Raises:
        ValueError: ``orders`` has another length than the problem, or a unit a request lacks.
    """
    if len(orders) != problem.requests:
        raise ValueError(f"{len(orders)} orders for {problem.requests} requests")
    weights = problem.unit_tokens
    token_of = []
    total = 0
    for i, order in enumerate(orders):
        if not set(order) <= set(problem.units[i]) or len(set(order)) != len(order):
            raise ValueError(f"order {i} is not a sub-permutation of the request's units")
        token_of.append({u: int(weights[u]) for u in order})
        total += sum(token_of[-1].values())
    n = problem.requests
    return max(n - 1, 0) * problem.shared_tokens + total - trie_tokens(orders, token_of)


def orders_of_plans(problem: OrderingProblem, plans: Sequence[Plan]) -> list[list[int]]:
    """The unit orders of a planner's plans (one per request, in the problem's order): the
    shown blocks in prompt order, then the tail. A block the plan does not show (a duplicate
    of an earlier input) is left out.

    Raises:
        KeyError: a shown block or a question that is not in the problem.
    """
    orders = []
    for plan in plans:
        shown = sorted((p for p in plan.placements if p.shown), key=lambda p: p.position or 0)
        seen: dict[str, int] = {}
        order = []
        for placement in shown:
            seen[placement.text] = seen.get(placement.text, 0) + 1
            order.append(problem.unit_ids[("block", placement.text, seen[placement.text])])
        order.append(problem.unit_ids[("tail", plan.query, 1)])
        orders.append(order)
    return orders


# --- Public API: upper bounds ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OfflineBounds:
    """Upper bounds on the cached tokens of any ordering and schedule, unlimited cache.

    Attributes:
        spanning_forest: :func:`spanning_forest_bound`.
        prefix_intersection: :func:`prefix_intersection_bound`.
        two_level_lp: :func:`two_level_lp_bound` (``None``: not computed, or not available).
    """

    spanning_forest: int
    prefix_intersection: int
    two_level_lp: int | None = None

    @property
    def tighter(self) -> int:
        """The smallest (each is valid)."""
        values = [self.spanning_forest, self.prefix_intersection, self.two_level_lp]
        return min(v for v in values if v is not None)


def offline_bounds(
    problem: OrderingProblem, *, lp: bool = True, exact_units: int = DEFAULT_EXACT_UNITS
) -> OfflineBounds:
    """The bounds of the module docstring; ``lp=False`` skips the linear program (the others
    take well under a second for 2,000 requests of 10 blocks; the program 1-15 s)."""
    return OfflineBounds(
        spanning_forest_bound(problem),
        prefix_intersection_bound(problem, exact_units=exact_units),
        two_level_lp_bound(problem, exact_units=exact_units) if lp else None,
    )


def spanning_forest_bound(problem: OrderingProblem) -> int:
    """``(N - 1) s`` + the maximum spanning forest of the overlap graph (tokens).

    Cost: one sparse product (the pairs of requests sharing a unit) and scipy's minimum
    spanning tree on it.
    """
    n = problem.requests
    base = max(n - 1, 0) * problem.shared_tokens
    if n < 2:
        return base
    if not len(problem.unit_tokens):
        return base
    holders = problem.holders()
    weighted = holders.multiply(problem.unit_tokens[None, :]).tocsr()
    overlap = sparse.triu(weighted @ holders.T, k=1).tocsr()
    overlap.eliminate_zeros()
    if overlap.nnz == 0:
        return base
    # Every spanning forest has the same number of edges per component, so the minimum
    # spanning forest of (C - w) is the maximum spanning forest of w.
    ceiling = float(overlap.data.max()) + 1.0
    flipped = overlap.astype(np.float64)
    flipped.data = ceiling - flipped.data
    forest = minimum_spanning_tree(flipped)
    return base + int(round(ceiling * forest.nnz - forest.sum()))


def prefix_intersection_bound(
    problem: OrderingProblem, *, exact_units: int = DEFAULT_EXACT_UNITS
) -> int:
    """``(N - 1) s + sum_i max over orders of S_i of sum_t w_t (1 - 1/c_t)``, rounded down.

    ``c_t`` is the number of requests holding all of the order's first ``t`` units. Each
    request's maximum is a dynamic program over the subsets of its shared units (at most
    ``exact_units`` of them, the heaviest; the others are credited ``w (1 - 1/n_u)``).
    Vectorised over the requests with the same number of shared units. Memory: at most
    ``2**exact_units`` floats per request of a chunk of 256.

    Raises:
        ValueError: ``exact_units`` is not in ``1..20``.
    """
    n = problem.requests
    base = max(n - 1, 0) * problem.shared_tokens
    if n < 2:
        return base
    tables = _SubsetTables(problem, exact_units)
    credit = tables.truncated_credit
    for chunk in tables.chunks():
        best = np.full(chunk.count.shape, np.inf)
        best[:, 0] = 0.0
        for layer in range(1, chunk.d + 1):
            at = chunk.subsets[chunk.popcount == layer]
            for t in range(chunk.d):
                has = at[(at >> t) & 1 == 1]
                step = best[:, has ^ (1 << t)] + chunk.weights[:, t : t + 1] / chunk.count[:, has]
                best[:, has] = np.minimum(best[:, has], step)
        credit += float((chunk.weights.sum(axis=1) - best[:, -1]).sum())
    return base + int(np.floor(credit + 1e-6))


def two_level_lp_bound(
    problem: OrderingProblem, *, exact_units: int = DEFAULT_EXACT_UNITS
) -> int | None:
    """The prefix-intersection bound with the trie's first two levels counted as nodes.

    The bound above lets every request count, at its first unit, all requests holding that
    unit, though each request has one first unit only. Here the nodes of depth 1 and 2 are
    counted whole, by a linear program (a relaxation of facility location):

    * ``y1[b]``, ``y2[b, b']`` in ``[0, 1]``: the trie has the node ``b`` at depth 1, the node
      ``(b, b')`` at depth 2 (weights ``w_b``, ``w_b'``);
    * per request ``i``, one unit of flow: its first shared unit ``b`` and second ``b'``
      (``x[i, b, b'] <= y2[b, b']``, and all of ``i``'s flow through ``b`` is ``<= y1[b]``),
      or "alone" at depth 1 (cost ``w(shared units of i)``) or at depth 2 (the rest of them);
    * below depth 2, request ``i`` pays ``h_i({b, b'})``: the least of ``sum_t w_t / c_t``
      over orders of its remaining shared units (``c_t`` as in the prefix bound), its share of
      those nodes.

    Any ordering maps to a feasible point of no larger cost (each node of depth 1 or 2 is paid
    once; deeper ones by their members' shares; a second unit held by ``i`` alone with ``b``
    makes every later node ``i``'s alone, which is "alone at depth 2"), so the trie weighs at
    least the LP optimum. It is never looser than the prefix bound (``y >= x`` for each of the
    ``c`` holders gives ``w y >= sum x w / c``). A margin of ``1e-6`` relative covers the LP
    solver's tolerances.

    Cost: about ``k**2`` variables per request (HiGHS through ``scipy.optimize.linprog``):
    0.8 s CPU for 500 MultiHop-RAG requests, 2.5 s for LoCoMo, 6.5 s and 0.5 GB for MTRAG
    (k=10).

    Returns:
        The bound on cached tokens, or ``None`` when some request has more than
        ``exact_units`` shared units or the solver fails.
    """
    n = problem.requests
    base = max(n - 1, 0) * problem.shared_tokens
    if n < 2:
        return base
    tables = _SubsetTables(problem, exact_units)
    if tables.truncated:
        return None
    program = _TwoLevelProgram(problem.unit_tokens.astype(np.float64))
    for chunk in tables.chunks():
        program.add(chunk)
    trie = program.solve(n)
    if trie is None:
        return None
    return base + int(np.floor(program.shared_tokens - trie))


class _TwoLevelProgram:
    """The linear program of :func:`two_level_lp_bound`, built chunk by chunk.

    Variables, in order: per chunk, "alone at depth 1" (one per request), "alone at depth 2"
    (one per request and first unit), the arcs ``x[i, b, b']`` (pairs some other request
    holds too); then ``y1`` per first unit, ``y2`` per arc key. Rows: one equality per request
    (its flow is 1); one ``flow through (i, b) - y1[b] <= 0`` per request and shared unit; one
    ``x - y2 <= 0`` per arc.
    """

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights
        self.shared_tokens = 0.0
        self.costs: list[np.ndarray] = []
        self.eq: list[tuple[np.ndarray, np.ndarray]] = []  # (request, variable)
        self.through: list[tuple[np.ndarray, np.ndarray]] = []  # (through row, variable)
        self.first_units: list[np.ndarray] = []  # per through row, its unit b
        self.arc_vars: list[np.ndarray] = []
        self.arc_keys: list[np.ndarray] = []  # b * U + b'
        self.variables = 0
        self.through_rows = 0

    def add(self, chunk: _Chunk) -> None:
        r, d = chunk.weights.shape
        shared = chunk.weights.sum(axis=1)
        self.shared_tokens += float(shared.sum())
        first, second = np.nonzero(~np.eye(d, dtype=bool))
        pair_mask = (1 << first) | (1 << second)
        request, pair = np.nonzero(chunk.count[:, pair_mask] >= 2)
        alone1 = self.variables + np.arange(r)
        alone2 = self.variables + r + np.arange(r * d).reshape(r, d)
        arcs = self.variables + r + r * d + np.arange(request.size)
        self.variables += r + r * d + request.size
        rest = _cost_to_go(chunk)
        self.costs += [
            shared,
            (shared[:, None] - chunk.weights).ravel(),
            rest[request, pair_mask[pair]],
        ]
        rows = chunk.rows
        self.eq.append(
            (
                np.concatenate([rows, np.repeat(rows, d), rows[request]]),
                np.concatenate([alone1, alone2.ravel(), arcs]),
            )
        )
        through = self.through_rows + np.arange(r * d).reshape(r, d)
        self.through_rows += r * d
        self.through.append(
            (
                np.concatenate([through.ravel(), through[request, first[pair]]]),
                np.concatenate([alone2.ravel(), arcs]),
            )
        )
        self.first_units.append(chunk.units.ravel())
        self.arc_vars.append(arcs)
        units = len(self.weights)
        self.arc_keys.append(
            chunk.units[request, first[pair]] * units + chunk.units[request, second[pair]]
        )

    def solve(self, requests: int) -> float | None:
        """The least trie weight of the shared units (less a margin for the solver's
        tolerances), or ``None`` when the solver fails."""
        if self.variables == 0:
            return 0.0
        y1_units, y1_index = np.unique(np.concatenate(self.first_units), return_inverse=True)
        y2_keys, y2_index = np.unique(np.concatenate(self.arc_keys), return_inverse=True)
        y1 = self.variables + np.arange(y1_units.size)
        y2 = self.variables + y1_units.size + np.arange(y2_keys.size)
        size = self.variables + y1_units.size + y2_keys.size
        c = np.concatenate(
            [*self.costs, self.weights[y1_units], self.weights[y2_keys % len(self.weights)]]
        )
        eq_rows, eq_cols = (np.concatenate(x) for x in zip(*self.eq))
        a_eq = sparse.csr_matrix(
            (np.ones(eq_rows.size), (eq_rows, eq_cols)), shape=(requests, size)
        )
        b_eq = np.zeros(requests)
        b_eq[eq_rows] = 1.0
        through_rows, through_cols = (np.concatenate(x) for x in zip(*self.through))
        arc_vars = np.concatenate(self.arc_vars)
        arc_rows = self.through_rows + np.arange(arc_vars.size)
        rows = np.concatenate([through_rows, np.arange(self.through_rows), arc_rows, arc_rows])
        cols = np.concatenate([through_cols, y1[y1_index], arc_vars, y2[y2_index]])
        values = np.concatenate(
            [
                np.ones(through_rows.size),
                -np.ones(self.through_rows),
                np.ones(arc_vars.size),
                -np.ones(arc_vars.size),
            ]
        )
        a_ub = sparse.csr_matrix(
            (values, (rows, cols)), shape=(self.through_rows + arc_vars.size, size)
        )
        result = linprog(
            c,
            A_ub=a_ub,
            b_ub=np.zeros(a_ub.shape[0]),
            A_eq=a_eq,
            b_eq=b_eq,
            bounds=(0, 1),
            method="highs",
        )
        if result.status != 0:
            return None
        return float(result.fun) - 1e-6 * (abs(float(result.fun)) + 1.0)


@dataclass
class _Chunk:
    """Requests with the same number ``d`` of shared units, and their subset counts.

    ``rows``: request indices (r,); ``units``: (r, d) their shared units; ``weights``: (r, d)
    their tokens; ``count``: (r, 2**d), requests holding every unit of the subset.
    """

    rows: np.ndarray
    units: np.ndarray
    weights: np.ndarray
    count: np.ndarray

    @property
    def d(self) -> int:
        return int(self.units.shape[1])

    @functools.cached_property
    def subsets(self) -> np.ndarray:
        return np.arange(1 << self.d)

    @functools.cached_property
    def popcount(self) -> np.ndarray:
        counts = np.zeros(1 << self.d, dtype=np.int64)
        for t in range(self.d):
            counts += (self.subsets >> t) & 1
        return counts


class _SubsetTables:
    """Per request, its shared units (held by another request too; the heaviest
    ``exact_units``) and how many requests hold each subset of them, in chunks."""

    def __init__(self, problem: OrderingProblem, exact_units: int) -> None:
        if not 1 <= exact_units <= 20:
            raise ValueError(f"exact_units must be in 1..20, got {exact_units}")
        holders = problem.holders()
        weights = problem.unit_tokens.astype(np.float64)
        held_by = np.asarray(holders.sum(axis=0)).ravel()
        self.truncated_credit = 0.0
        self.truncated = False
        exact: list[list[int]] = []
        for units in problem.units:
            shared = [u for u in units if held_by[u] >= 2]
            if len(shared) > exact_units:
                self.truncated = True
                shared.sort(key=lambda u: (-weights[u] * (1 - 1 / held_by[u]), u))
                rest = np.asarray(shared[exact_units:])
                self.truncated_credit += float((weights[rest] * (1 - 1 / held_by[rest])).sum())
                shared = shared[:exact_units]
            exact.append(shared)
        n = problem.requests
        # Bit t of masks[j, i] says that request j holds the t-th shared unit of request i.
        rows = np.fromiter((u for s in exact for u in s), dtype=np.int64)
        cols = np.repeat(np.arange(n), [len(s) for s in exact])
        bits = np.fromiter((1 << t for s in exact for t in range(len(s))), dtype=np.float64)
        placed = sparse.csr_matrix((bits, (rows, cols)), shape=(holders.shape[1], n))
        self._masks = (holders.astype(np.float64) @ placed).tocsc()
        self._exact = exact
        self._weights = weights

    def chunks(self) -> Iterator[_Chunk]:
        """The requests with shared units, grouped by their number ``d``, at most
        ``2**21`` subset counts a chunk."""
        by_size: dict[int, list[int]] = {}
        for i, s in enumerate(self._exact):
            if s:
                by_size.setdefault(len(s), []).append(i)
        masks = self._masks
        for d, members in sorted(by_size.items()):
            size = max(1, min(256, (1 << 21) >> d))
            for start in range(0, len(members), size):
                rows = np.asarray(members[start : start + size])
                count = np.zeros((rows.size, 1 << d), dtype=np.float64)
                for row, i in enumerate(rows):
                    values = masks.data[masks.indptr[i] : masks.indptr[i + 1]].astype(np.int64)
                    np.add.at(count[row], values, 1.0)
                # Superset sums: count[U] = requests whose mask contains U.
                for t in range(d):
                    view = count.reshape(rows.size, -1, 2, 1 << t)
                    view[:, :, 0, :] += view[:, :, 1, :]
                units = np.asarray([self._exact[i] for i in rows], dtype=np.int64)
                yield _Chunk(rows, units, self._weights[units], count)


def _cost_to_go(chunk: _Chunk) -> np.ndarray:
    """``(r, 2**d)``: from the subset ``U`` already placed, the least ``sum w_t / c_t`` over
    orders of the remaining shared units."""
    rest = np.full(chunk.count.shape, np.inf)
    rest[:, -1] = 0.0
    for layer in range(chunk.d - 1, -1, -1):
        at = chunk.subsets[chunk.popcount == layer]
        for t in range(chunk.d):
            lacks = at[(at >> t) & 1 == 0]
            after = lacks | (1 << t)
            step = chunk.weights[:, t : t + 1] / chunk.count[:, after] + rest[:, after]
            rest[:, lacks] = np.minimum(rest[:, lacks], step)
    return rest


# --- Public API: the exact optimum of a slice --------------------------------------------------


@dataclass(frozen=True, slots=True)
class OptimalOrders:
    """The best ordering of a small batch.

    Attributes:
        cached_tokens: its cached tokens (unlimited cache, any schedule).
        orders: per request, its units in that order (a permutation of the request's units).
    """

    cached_tokens: int
    orders: list[list[int]]


def optimal_orders(
    problem: OrderingProblem, *, max_requests: int = MAX_EXACT_REQUESTS
) -> OptimalOrders:
    """The exact optimum (the theorem of the module docstring), by the subset recursion.

    Cost: ``3**N / 2`` vectorised steps and ``2**N`` int64 of memory (N = 16: about a second).

    Raises:
        ValueError: more than ``max_requests`` requests.
    """
    n = problem.requests
    if n > max_requests:
        raise ValueError(f"the exact optimum takes at most {max_requests} requests, got {n}")
    if n == 0:
        return OptimalOrders(0, [])
    size = 1 << n
    holder_mask: dict[int, int] = {}
    for i, units in enumerate(problem.units):
        for u in units:
            holder_mask[u] = holder_mask.get(u, 0) | (1 << i)
    # shared[Z] = w(I_Z): the tokens of the units every request of Z holds.
    shared = np.zeros(size, dtype=np.int64)
    for u, mask in holder_mask.items():
        if mask & (mask - 1):
            shared[mask] += int(problem.unit_tokens[u])
    for t in range(n):
        view = shared.reshape(-1, 2, 1 << t)
        view[:, 0, :] += view[:, 1, :]
    best = np.zeros(size, dtype=np.int64)
    split = np.zeros(size, dtype=np.int64)
    subsets = np.arange(size, dtype=np.int64)
    popcount = np.zeros(size, dtype=np.int64)
    for t in range(n):
        popcount += (subsets >> t) & 1
    for s in range(2, n + 1):
        sets = subsets[popcount == s]
        bits = ((sets[:, None] >> np.arange(n)) & 1).astype(bool)
        position = np.nonzero(bits)[1].reshape(-1, s)
        # Splits Z = A + B with A holding Z's lowest member, B not empty.
        patterns = np.arange((1 << (s - 1)) - 1, dtype=np.int64)
        step = max(1, (1 << 22) // max(patterns.size, 1))
        for start in range(0, sets.size, step):
            z = sets[start : start + step]
            pos = position[start : start + step]
            part = np.broadcast_to((1 << pos[:, :1]), (z.size, patterns.size)).copy()
            for t in range(1, s):
                part |= ((patterns[None, :] >> (t - 1)) & 1) << pos[:, t : t + 1]
            value = best[part] + best[z[:, None] ^ part]
            choice = value.argmax(axis=1)
            rows = np.arange(z.size)
            best[z] = shared[z] + value[rows, choice]
            split[z] = part[rows, choice]
    orders = _orders_of_tree(problem, split, holder_mask)
    total = max(n - 1, 0) * problem.shared_tokens + int(best[size - 1])
    return OptimalOrders(total, orders)


def _orders_of_tree(
    problem: OrderingProblem, split: np.ndarray, holder_mask: Mapping[int, int]
) -> list[list[int]]:
    """Top-down orders of the tree ``split`` encodes: each node appends the units all its
    requests hold that its parent's requests did not all hold; a leaf appends the rest."""
    n = problem.requests
    orders: list[list[int]] = [[] for _ in range(n)]
    stack: list[tuple[int, frozenset[int]]] = [((1 << n) - 1, frozenset())]
    while stack:
        z, placed = stack.pop()
        if z & (z - 1) == 0:
            i = z.bit_length() - 1
            orders[i].extend(u for u in problem.units[i] if u not in placed)
            continue
        common = {u for u in problem.units[(z & -z).bit_length() - 1] if holder_mask[u] & z == z}
        new = sorted(common - placed)
        for i in range(n):
            if z >> i & 1:
                orders[i].extend(new)
        a = int(split[z])
        here = placed | frozenset(new)
        stack.append((z ^ a, here))
        stack.append((a, here))
    return orders


# --- Public API: slices ------------------------------------------------------------------------


def connected_slices(
    problem: OrderingProblem, size: int, count: int, *, seed: int = 0
) -> list[list[int]]:
    """``count`` groups of ``size`` requests that share blocks, for the exact optimum.

    Each grows from a random request (one that shares a block with another) by adding, one at
    a time, the request with the most overlap tokens with the group so far (ties: lowest
    index). A seed whose whole connected group is smaller than ``size`` is skipped; fewer
    than ``count`` groups come back when the draws run out (``20 * count`` draws).

    Returns:
        Lists of request indices (each sorted), deterministic for a given ``seed``.
    """
    holders = problem.holders()
    tail_free = problem.unit_tokens.copy()
    for key, u in problem.unit_ids.items():
        if key[0] == "tail":
            tail_free[u] = 0
    weighted = holders.multiply(tail_free[None, : holders.shape[1]]).tocsr()
    overlap = (weighted @ holders.T).tocsr()
    overlap.setdiag(0)
    overlap.eliminate_zeros()
    candidates = np.flatnonzero(np.diff(overlap.indptr) > 0)
    rng = np.random.default_rng(seed)
    slices: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(20 * count):
        if len(slices) == count or candidates.size == 0:
            break
        start = int(rng.choice(candidates))
        group = [start]
        score = overlap[start].toarray().ravel().astype(np.float64)
        score[start] = -np.inf
        while len(group) < size:
            nxt = int(np.argmax(score))
            if score[nxt] <= 0:
                break
            group.append(nxt)
            score += overlap[nxt].toarray().ravel()
            score[group] = -np.inf
        members = tuple(sorted(group))
        if len(group) == size and members not in seen:
            seen.add(members)
            slices.append(list(members))
    return slices
