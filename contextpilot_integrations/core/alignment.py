"""Alignment: put a request's shared prefix first so the engine's prefix cache can hit.

ContextPilot paper, section 4.2 (context ordering): the blocks of the prefix the context index
matched come first, in the index's order; the remaining blocks follow. The paper keeps the
remaining blocks in retriever order (``"retriever"``). ``"popularity"`` orders them by a
popularity score (most first, ties in retriever order; the facade's score is the number of
indexed requests holding the block plus a recency-weighted count of earlier requests), so that
a block likely to be retrieved again sits early and later requests can share a longer prefix;
``benchmarks/bench_ordering.py`` measures both in the online mode. Either way the original
relevance order survives in the order annotation (see :mod:`.rendering`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["RestOrder", "align"]

RestOrder = Literal["retriever", "popularity"]


def align(
    blocks: Sequence[int],
    prefix: Sequence[int],
    *,
    rest_order: RestOrder = "retriever",
    popularity: Callable[[int], float] | None = None,
) -> list[int]:
    """Return the request's block ids in prompt order.

    Args:
        blocks: the request's block ids in retriever order (no repeats).
        prefix: the matched shared prefix (every id must be in ``blocks``).
        rest_order: ``"retriever"`` or ``"popularity"`` (needs ``popularity``).
        popularity: block id -> popularity score (higher first).

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
    if rest_order == "popularity":
        if popularity is None:
            raise ValueError("rest_order='popularity' needs a popularity function")
        rank = {b: r for r, b in enumerate(rest)}
        rest.sort(key=lambda b: (-popularity(b), rank[b]))
    elif rest_order != "retriever":
        raise ValueError(f"rest_order must be 'retriever' or 'popularity', got {rest_order!r}")
    return [*prefix, *rest]
