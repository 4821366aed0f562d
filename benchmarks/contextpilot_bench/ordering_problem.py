"""The ordering problem of a batch: units, their weights in tokens, and the cached tokens of
an ordering with an unlimited prefix cache.

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

Its exact optimum: :mod:`~contextpilot_bench.optimal_orders`; bounds on it for a
whole workload: :mod:`~contextpilot_bench.bounds`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from contextpilot_bench.methods import PreparedWorkload
from contextpilot_integrations.core.ordering.clustering import trie_tokens
from contextpilot_integrations.core.plan import Plan

__all__ = [
    "OrderingProblem",
    "UnitKey",
    "cached_tokens",
    "ordering_problem",
    "orders_of_plans",
]

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
