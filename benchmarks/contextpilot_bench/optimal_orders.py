"""The exact optimum of the unlimited-cache hit for a small batch, and slices to compute it on.

Notation (units, weights, the prefix trie, the cached tokens of an ordering):
:mod:`~contextpilot_bench.ordering_problem`.

**Theorem.** ``max over orderings of cached = (N - 1) s + max over rooted binary trees T with the
requests as leaves of sum over internal nodes P of w(I_P)``, where ``I_P`` is the intersection
of ``S_i`` over the leaves ``i`` below ``P``. *Reached:* order top-down (the paper's offline
build, section 4.1): node ``P`` appends ``I_P \\ I_parent(P)`` to its parent's order, a leaf the
rest; every leaf below ``P`` then shares those units at one trie node, and the savings telescope
to ``sum_P (children(P) - 1) w(I_P)``. *Not exceeded:* the member sets of a trie's nodes form a
laminar family, so a tree ``T'``; a unit ``u`` labels disjoint trie nodes, each inside one
maximal node ``M*`` of ``T'`` contained in ``H_u``, which save at most ``(|M*| - 1) w_u``, what
the top-down order of ``T'`` credits ``u``. Splitting a node with more than two children never
lowers the sum.

So the cluster build is optimal *given its tree*; only the tree is left to choose (NP-hard: it
is Camin-Sokal parsimony with units as characters, Day, Johnson and Sankoff 1986).
:func:`optimal_orders` solves it exactly for up to :data:`MAX_EXACT_REQUESTS` requests by the
subset recursion ``f(Z) = w(I_Z) + max over splits Z = A + B of f(A) + f(B)``. A tail unit may
stand anywhere in these orders (a relaxation: only a request with the same question can share
it), so the optimum of a batch with repeated questions may read a tail's tokens above the true
one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from contextpilot_bench.ordering_problem import OrderingProblem

__all__ = ["MAX_EXACT_REQUESTS", "OptimalOrders", "connected_slices", "optimal_orders"]

MAX_EXACT_REQUESTS = 18
"""Largest slice :func:`optimal_orders` takes (``3**18 / 2`` steps, a few seconds)."""


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

    Cost: ``3**N / 2`` vectorised steps and ``2**N`` int64 of memory.

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
