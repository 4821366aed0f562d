"""Offline build: order every context of a batch so that shared blocks form common prefixes.

Two builders, both returning one block order per context (a permutation of its blocks):

* ``"cluster"`` -- the paper's build (ContextPilot, section 4.1): pairwise distances
  (:mod:`.distance`), agglomerative clustering (scipy ``linkage``), each internal node's blocks
  = the intersection of its children's (linkage: see below), then top-down: a node's order is
  its parent's order followed by its own new blocks; a leaf appends its unshared rest in
  retriever order. Empty intersection nodes contribute nothing (the index's radix tree never
  materialises them). Memory is ``O(N**2)`` (the condensed distance vector), so it is used up
  to ``cluster_limit`` contexts.
* ``"frequency"`` -- a conditional frequency tree (the FP-tree construction of Han et al.,
  SIGMOD 2000, applied per group): all contexts start in one group; at each level every
  context takes next the block whose sharing in its current group saves the most tokens
  (``(contexts of the group holding it - 1) * tokens``; ties: more frequent in the whole batch,
  then block order), and contexts that took the same block form the child group;
  a context whose best block is held by no other context of its group stops and appends its
  rest in retriever order. Vectorised per level: ``O(N * k * k log(N k))``, memory ``O(N k)``,
  so it scales to 100,000 contexts.

``"auto"`` builds both up to ``cluster_limit`` contexts and keeps the one whose prefix trie
holds fewer tokens (:func:`trie_tokens`: the batch's prefill with unlimited cache), and uses
``"frequency"`` above. Complete linkage is used rather than the public implementation's
average linkage: it gives the higher offline hit ratio on the benchmark's workloads
(``benchmarks/micro/bench_ordering.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy.cluster.hierarchy import linkage

from contextpilot_integrations.core.ordering.distance import DEFAULT_ALPHA, pairwise_distances

__all__ = ["BuildMethod", "order_batch", "trie_tokens"]

BuildMethod = Literal["auto", "cluster", "frequency"]
DEFAULT_CLUSTER_LIMIT = 4096


def order_batch(
    contexts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]] | None = None,
    *,
    method: BuildMethod = "auto",
    alpha: float = DEFAULT_ALPHA,
    weight_by_tokens: bool = True,
    cluster_limit: int = DEFAULT_CLUSTER_LIMIT,
) -> list[list[int]]:
    """Return each context's blocks in prefix-sharing order.

    Args:
        contexts: ``N`` contexts, block ids in retriever order, no repeats within one.
        tokens: tokens per block, same shape (``None`` = 1 each).
        method: ``"auto"``, ``"cluster"`` or ``"frequency"`` (see the module docstring).
        alpha: position-gap weight of the paper's distance (``"cluster"`` only).
        weight_by_tokens: weigh shared blocks by tokens instead of counting them.
        cluster_limit: largest batch ``"auto"`` sends to ``"cluster"``.

    Returns:
        ``N`` lists; list ``i`` is a permutation of ``contexts[i]``. Deterministic.

    Raises:
        ValueError: an unknown ``method``, an empty context or a repeated block.
    """
    n = len(contexts)
    if n == 0:
        return []
    if method not in ("auto", "cluster", "frequency"):
        raise ValueError(f"method must be 'auto', 'cluster' or 'frequency', got {method!r}")
    weights = tokens if (weight_by_tokens and tokens is not None) else None
    if n == 1:
        return [list(contexts[0])]
    if method == "cluster":
        return _order_by_clustering(contexts, weights, alpha)
    if method == "frequency" or n > cluster_limit:
        return _order_by_frequency(contexts, weights)
    candidates = [
        _order_by_clustering(contexts, weights, alpha),
        _order_by_frequency(contexts, weights),
    ]
    token_of = [dict(zip(c, w)) for c, w in zip(contexts, tokens)] if tokens is not None else None
    return min(candidates, key=lambda orders: trie_tokens(orders, token_of))


def trie_tokens(
    orders: Sequence[Sequence[int]], token_of: Sequence[dict[int, int]] | None = None
) -> int:
    """Tokens a prefix cache holds after all ``orders`` ran: the size of their prefix trie.

    With unlimited cache this is the batch's prefill (each distinct prefix is computed once),
    so a smaller trie means more reuse. Sorting makes the trie's shared prefixes adjacent:
    each sequence adds the tokens past its longest common prefix with the one before it.

    Args:
        orders: block id sequences.
        token_of: per sequence, block id -> tokens (``None``: 1 per block).
    """
    ranked = sorted(range(len(orders)), key=lambda i: tuple(orders[i]))
    total = 0
    previous: Sequence[int] = ()
    for i in ranked:
        current = orders[i]
        common = 0
        limit = min(len(previous), len(current))
        while common < limit and previous[common] == current[common]:
            common += 1
        weights = token_of[i] if token_of is not None else None
        total += sum(weights[b] for b in current[common:]) if weights else len(current) - common
        previous = current
    return total


def _order_by_clustering(
    contexts: Sequence[Sequence[int]],
    weights: Sequence[Sequence[int]] | None,
    alpha: float,
) -> list[list[int]]:
    n = len(contexts)
    condensed = pairwise_distances(contexts, alpha=alpha, weights=weights)
    merges = linkage(condensed, method="complete")
    rank = [{block: r for r, block in enumerate(c)} for c in contexts]
    members: list[frozenset[int]] = [frozenset(c) for c in contexts]
    first_leaf = list(range(n))
    children: list[tuple[int, int]] = []
    for left, right in merges[:, :2].astype(np.int64):
        members.append(members[left] & members[right])
        first_leaf.append(min(first_leaf[left], first_leaf[right]))
        children.append((int(left), int(right)))

    orders: list[list[int]] = [[] for _ in range(n)]
    root = 2 * n - 2
    stack: list[tuple[int, list[int], frozenset[int]]] = [(root, [], frozenset())]
    while stack:
        cluster, prefix, placed = stack.pop()
        own = members[cluster] - placed
        if cluster < n:
            rest = sorted(own, key=rank[cluster].__getitem__)
            orders[cluster] = prefix + rest
            continue
        if own:
            # Order a node's new blocks as its first (lowest-index) leaf ranks them.
            leaf_rank = rank[first_leaf[cluster]]
            prefix = prefix + sorted(own, key=leaf_rank.__getitem__)
            placed = members[cluster]
        left, right = children[cluster - n]
        stack.append((right, prefix, placed))
        stack.append((left, prefix, placed))
    return orders


def _order_by_frequency(
    contexts: Sequence[Sequence[int]],
    weights: Sequence[Sequence[int]] | None,
) -> list[list[int]]:
    n = len(contexts)
    lengths = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=n)
    if (lengths == 0).any():
        raise ValueError(f"context {int(np.argmin(lengths))} is empty")
    total = int(lengths.sum())
    flat = np.fromiter((b for c in contexts for b in c), dtype=np.uint64, count=total)
    ctx = np.repeat(np.arange(n, dtype=np.int64), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    rank = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    if weights is None:
        w = np.ones(total, dtype=np.int64)
    else:
        w = np.fromiter((x for wc in weights for x in wc), dtype=np.int64, count=total)
    _, block = np.unique(flat, return_inverse=True)
    block = block.astype(np.int64)
    n_blocks = int(block.max()) + 1
    if np.unique(block * n + ctx).size != total:
        raise ValueError("a context repeats a block id")

    batch_freq = np.bincount(block, minlength=n_blocks)[block]
    group = np.zeros(n, dtype=np.int64)  # current group of each context
    active = np.ones(n, dtype=bool)  # still extending its shared prefix
    slot = np.full(total, -1, dtype=np.int64)  # output position of each placed entry
    level = 0
    while active.any():
        open_entries = np.flatnonzero((slot < 0) & active[ctx])
        if open_entries.size == 0:
            break
        key = group[ctx[open_entries]] * n_blocks + block[open_entries]
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        freq = counts[inverse]
        # Per context, the entry with the largest (tokens saved by sharing it in the group,
        # (frequency - 1) * tokens; frequency in the batch; -block index) goes next. Every key
        # is the same for every context of the group, so contexts that hold the same top
        # blocks all pick the same one.
        order = np.lexsort(
            (
                -block[open_entries],
                batch_freq[open_entries],
                (freq - 1) * w[open_entries],
                ctx[open_entries],
            )
        )
        sorted_ctx = ctx[open_entries][order]
        last = np.flatnonzero(np.r_[sorted_ctx[1:] != sorted_ctx[:-1], True])
        chosen = open_entries[order[last]]
        chosen_freq = freq[order[last]]
        chosen_ctx = ctx[chosen]
        shared = chosen_freq >= 2
        active[chosen_ctx[~shared]] = False
        chosen, chosen_ctx = chosen[shared], chosen_ctx[shared]
        if chosen.size == 0:
            break
        slot[chosen] = level
        _, new_group = np.unique(group[chosen_ctx] * n_blocks + block[chosen], return_inverse=True)
        group[chosen_ctx] = new_group
        level += 1

    # Unplaced entries follow the shared prefix in retriever order.
    unplaced = slot < 0
    slot[unplaced] = level + rank[unplaced]
    order = np.lexsort((slot, ctx))
    flat_ordered = flat[order]
    bounds = np.cumsum(lengths)[:-1]
    return [part.tolist() for part in np.split(flat_ordered, bounds)]


def order_behind_prefixes(
    contexts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]],
    **build: object,
) -> list[list[int]]:
    """Order a batch whose requests each already matched an indexed prefix.

    Requests that matched the same prefix keep it first and have the rest of their blocks
    ordered jointly by :func:`order_batch` (``build``: its keyword arguments), so the blocks
    they share form common prefixes behind it.

    Args:
        contexts: ``N`` contexts (block ids, no repeats; an empty one stays empty).
        tokens: tokens per block, same shape.
        prefixes: per context, the matched prefix (every id in that context).

    Returns:
        ``N`` lists; list ``i`` is ``prefixes[i]`` followed by the rest of ``contexts[i]``.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, context in enumerate(contexts):
        if context:
            groups.setdefault(tuple(prefixes[i]), []).append(i)
    orders: list[list[int]] = [[] for _ in contexts]
    for prefix, members in groups.items():
        in_prefix = set(prefix)
        rests = [[b for b in contexts[i] if b not in in_prefix] for i in members]
        token_of = [dict(zip(contexts[i], tokens[i])) for i in members]
        nonempty = [j for j, rest in enumerate(rests) if rest]
        ordered_rests = order_batch(
            [rests[j] for j in nonempty],
            [[token_of[j][b] for b in rests[j]] for j in nonempty],
            **build,  # type: ignore[arg-type]
        )
        for member in members:
            orders[member] = list(prefix)
        for j, ordered in zip(nonempty, ordered_rests):
            orders[members[j]].extend(ordered)
    return orders
