"""Batch scheduling: run requests that share a prefix back to back.

Both schedulers read only the requests' search paths in the context index (node ids from the
root's child down to the node where the request's context ends), so they cost
``O(B * h log B)`` for ``B`` requests of height ``h`` and never walk the rest of the index.

* :func:`schedule_by_first_step` -- the paper's Algorithm 5 (ContextPilot, section 4.3):
  group requests by the first node of their search path, sort each group by path length
  (longest first), groups by size (largest first), concatenate. Ties keep input order.
* :func:`schedule_by_prefix_tree` -- a depth-first walk of the batch's own prefix tree:
  requests are grouped by every level of their path, not only the first, so requests sharing
  a deeper prefix are adjacent too (at every node, the child with more requests of the batch
  goes first; a request ending at a node runs before its descendants, whose prompts extend
  it). ``benchmarks/bench_ordering.py`` measures both; this one is the default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

__all__ = ["ScheduleMethod", "schedule", "schedule_by_first_step", "schedule_by_prefix_tree"]

ScheduleMethod = Literal["prefix-tree", "first-step"]


def schedule_by_first_step(paths: Sequence[Sequence[int]]) -> list[int]:
    """Paper Algorithm 5. Returns indices into ``paths`` in execution order."""
    groups: dict[int | None, list[int]] = {}
    for i, path in enumerate(paths):
        groups.setdefault(path[0] if path else None, []).append(i)
    ordered = sorted(groups.values(), key=len, reverse=True)  # stable: first seen wins ties
    out: list[int] = []
    for members in ordered:
        out.extend(sorted(members, key=lambda i: len(paths[i]), reverse=True))
    return out


def schedule_by_prefix_tree(paths: Sequence[Sequence[int]]) -> list[int]:
    """Depth-first order of the batch's prefix tree. Returns indices into ``paths``."""
    below: Counter[tuple[int, ...]] = Counter()
    for path in paths:
        for depth in range(1, len(path) + 1):
            below[tuple(path[:depth])] += 1

    def key(i: int) -> tuple[tuple[int, int], ...]:
        path = paths[i]
        # Each level: bigger subtree first, then node id for determinism. A request that ends
        # at a node sorts before the requests that continue below it (shorter tuple first).
        return tuple((-below[tuple(path[: d + 1])], path[d]) for d in range(len(path)))

    return sorted(range(len(paths)), key=key)


def schedule(paths: Sequence[Sequence[int]], method: ScheduleMethod = "prefix-tree") -> list[int]:
    """Dispatch to a scheduler by name.

    Raises:
        ValueError: an unknown ``method``.
    """
    if method == "prefix-tree":
        return schedule_by_prefix_tree(paths)
    if method == "first-step":
        return schedule_by_first_step(paths)
    raise ValueError(f"schedule method must be 'prefix-tree' or 'first-step', got {method!r}")
