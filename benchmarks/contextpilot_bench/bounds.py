"""What offline ordering can reach: upper bounds on the unlimited-cache hit of a whole workload.

The problem is :mod:`~contextpilot_bench.ordering_problem`'s; its exact optimum (a tree ``T``
with the requests as leaves crediting ``w(I_P)`` per internal node ``P``) is
:mod:`~contextpilot_bench.optimal_orders`'s, for small slices. :func:`offline_bounds` gives:

*Spanning forest* (:func:`spanning_forest_bound`). The edges between the leftmost leaves of each
internal node's two children form a spanning tree, and ``w(I_P) <= w(S_a & S_b)`` for its edge
``(a, b)``, so the optimum is at most the maximum spanning forest of the overlap graph. It is
never above the best-pair bound (each request's best overlap with any other): rooting each
tree, a request's parent edge weighs at most its best overlap, and a root is credited nothing.

*Prefix intersection* (:func:`prefix_intersection_bound`). Request ``i`` in order ``b_1..b_k``
meets ``b_t`` at a trie node held by at most ``c_t = |H_{b_1} & ... & H_{b_t}|`` requests, so
``cached - (N - 1) s <= sum_i max over orders of S_i of sum_t w_{b_t} (1 - 1/c_t)``, each
request's maximum a dynamic program over its shared units (beyond ``exact_units`` the rest are
credited ``w_u (1 - 1/n_u)``, which keeps the bound valid).

*Two-level LP* (:func:`two_level_lp_bound`). The prefix bound lets every holder of a unit count
all the others at it, though each request starts with one unit only (a hub ``{a, b, c}`` with
the singles ``{a}, {b}, {c}``: it credits 2, the optimum is 1). The LP pays each trie node of
depth 1 and 2 once (a facility-location relaxation), the deeper ones by the prefix shares, so it
is never looser than the prefix bound; it keeps an integrality gap (every pair of four blocks:
it credits 4, the optimum is 3).

The tighter bound is the smallest; each holds for every ordering and schedule
(``tests/bench/test_bounds.py`` checks them against the exact optimum and brute force).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linprog
from scipy.sparse.csgraph import minimum_spanning_tree

from contextpilot_bench.ordering_problem import (
    OrderingProblem,
)

__all__ = [
    "OfflineBounds",
    "offline_bounds",
    "prefix_intersection_bound",
    "spanning_forest_bound",
    "two_level_lp_bound",
]

DEFAULT_EXACT_UNITS = 14
"""Shared units per request the prefix-intersection program orders exactly (``2**14`` subsets)."""


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
    """The bounds of the module docstring; ``lp=False`` skips the linear program (by far the
    slowest of the three)."""
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

    Cost: about ``k**2`` variables per request (HiGHS through ``scipy.optimize.linprog``).

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
