"""Alignment: put a request's shared prefix first so the engine's prefix cache can hit.

ContextPilot paper, section 4.2 (context ordering): the blocks of the prefix the context index
matched come first, in the index's order; the remaining blocks follow. The paper keeps the
remaining blocks in retriever order (``"retriever"``). ``"popularity"`` orders them by a
popularity score (most first, ties in retriever order; the facade's score is the number of
indexed requests holding the block plus a recency-weighted count of earlier requests), so that
a block likely to be retrieved again sits early and later requests can share a longer prefix.
``"co-occurrence"`` (the facade's default) builds the rest block by block: next comes the block
that the most recent requests holding every block placed so far also held
(:class:`~.popularity.CooccurrenceMemory`), ties and the remainder by popularity; a later
request shares a prefix only with a request that holds all of it, so this places what the same
kind of request is likely to hold next. ``benchmarks/micro/bench_ordering.py`` measures the
orders in the online mode. Either way the original relevance order survives in the order
annotation (see :mod:`.rendering`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["RestOrder", "align"]

RestOrder = Literal["retriever", "popularity", "co-occurrence"]

Holders = Callable[[int], int]
"""``holders(block)``: the recent requests holding the block, as a bit set (an int, bit ``i``
for the ``i``-th request; :attr:`.popularity.CooccurrenceMemory.held_by`)."""

CONDITIONAL_STEPS = 3
"""Blocks placed by co-occurrence before the rest goes by popularity: deeper shared prefixes are
rare, and each step costs a set intersection per remaining block."""


def align(
    blocks: Sequence[int],
    prefix: Sequence[int],
    *,
    rest_order: RestOrder = "retriever",
    popularity: Callable[[int], float] | None = None,
    holders: Holders | None = None,
) -> list[int]:
    """Return the request's block ids in prompt order.

    Args:
        blocks: the request's block ids in retriever order (no repeats).
        prefix: the matched shared prefix (every id must be in ``blocks``).
        rest_order: ``"retriever"``, ``"popularity"`` (needs ``popularity``) or
            ``"co-occurrence"`` (needs ``popularity`` and ``holders``).
        popularity: block id -> popularity score (higher first).
        holders: block id -> the recent requests holding it, as a bit set (:data:`Holders`).

    Returns:
        A permutation of ``blocks`` that starts with ``prefix``.

    Raises:
        ValueError: a prefix block not in ``blocks``, or an unknown ``rest_order``.
    """
    in_prefix = set(prefix)
    missing = in_prefix.difference(blocks)
    if missing:
        raise ValueError(f"prefix blocks {sorted(missing)!r:.200} are not in the request")
    rest = [b for b in blocks if b not in in_prefix]
    if rest_order == "retriever":
        return [*prefix, *rest]
    if rest_order not in ("popularity", "co-occurrence"):
        raise ValueError(
            f"rest_order must be 'retriever', 'popularity' or 'co-occurrence', got {rest_order!r}"
        )
    if popularity is None:
        raise ValueError(f"rest_order={rest_order!r} needs a popularity function")
    rest.sort(key=popularity, reverse=True)  # a stable sort: ties keep retriever order
    if rest_order == "popularity":
        return [*prefix, *rest]
    if holders is None:
        raise ValueError("rest_order='co-occurrence' needs a holders function")
    return [*prefix, *_by_cooccurrence(prefix, rest, holders)]


def _by_cooccurrence(prefix: Sequence[int], rest: list[int], holders: Holders) -> list[int]:
    """``rest`` (already in popularity order) with up to :data:`CONDITIONAL_STEPS` blocks
    chosen first, each the one most recent requests holding everything placed so far hold."""
    together: int | None = None  # recent requests holding all placed, as a bit set
    for block in prefix:
        held = holders(block)
        together = held if together is None else together & held
        if not together:
            return rest
    placed: list[int] = []
    rest_holders = list(map(holders, rest))  # read once, kept beside ``rest``
    for _ in range(min(CONDITIONAL_STEPS, len(rest))):
        if together is None:  # nothing placed yet: the most popular block leads
            best = 0
        else:
            counts = list(map(int.bit_count, map(together.__and__, rest_holders)))
            top = max(counts)
            if top == 0:
                break
            best = counts.index(top)  # ties: the more popular (rest is in that order)
        placed.append(rest.pop(best))
        held = rest_holders.pop(best)
        together = held if together is None else together & held
        if not together:
            break
    return [*placed, *rest]
