"""Batch scheduling: run requests that share a prefix back to back.

Both schedulers read only the requests' search paths in the context index (node ids from the
root's child down to the node where the request's context ends), so they cost
``O(B * h log B)`` for ``B`` requests of height ``h`` and never walk the rest of the index.

* :func:`schedule_by_first_step` -- the paper's Algorithm 5 (ContextPilot, section 4.3):
  group requests by the first node of their search path, sort each group by path length
  (longest first), groups by size (largest first), concatenate. Ties keep input order.
* :func:`schedule_by_prefix_tree` -- a depth-first walk of the batch's own prefix tree:
  requests are grouped by every level of their path, not only the first, so requests sharing
  a deeper prefix are adjacent too (at every node, the child holding the longest prefix the
  index held before the batch goes first, then the child with more requests of the batch; a
  request ending at a node runs before its descendants, whose prompts extend it). With a cache
  that holds a few prompts, a request hits a prefix cached before its batch only if it runs
  before the batch's own prompts push that prefix out. Given each request's expected reuse
  by later requests, the request expected to be reused most, among those hitting no cached
  prefix, runs last (its branch after its siblings at every level): its prompt is what the
  cache holds when the next batch arrives (docs/DESIGN.md, "Ordering").
  ``benchmarks/micro/bench_ordering.py`` measures both; this one is the default.
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


def schedule_by_prefix_tree(
    paths: Sequence[Sequence[int]],
    cached: Sequence[int] | None = None,
    reuse: Sequence[float] | None = None,
) -> list[int]:
    """Depth-first order of the batch's prefix tree. Returns indices into ``paths``.

    ``cached``: per request, the tokens of its prefix the index held before the batch (what
    the engine's cache holds now); at every node the subtree with the most goes first, so
    those requests run before the batch's own prompts push that prefix out of the cache.
    ``reuse``: per request, the tokens of its prompt later requests are expected to reuse; the
    request with the most (and above 0), among those whose first-level subtree holds no cached
    prefix, runs last, its branch after its siblings at every level.

    Raises:
        ValueError: ``cached`` or ``reuse`` of another length than ``paths``.
    """
    if cached is not None and len(cached) != len(paths):
        raise ValueError(f"cached has {len(cached)} entries for {len(paths)} paths")
    if reuse is not None and len(reuse) != len(paths):
        raise ValueError(f"reuse has {len(reuse)} entries for {len(paths)} paths")
    below: Counter[tuple[int, ...]] = Counter()
    held: dict[tuple[int, ...], int] = {}
    for i, path in enumerate(paths):
        hit = cached[i] if cached is not None else 0
        for depth in range(1, len(path) + 1):
            node = tuple(path[:depth])
            below[node] += 1
            held[node] = max(held.get(node, 0), hit)
    # The request whose prompt later requests are expected to reuse most, among those holding
    # no cached prefix, runs last (its branch last at every level): its prompt is what the
    # cache holds for the next batch.
    tail: tuple[int, ...] = ()
    if reuse is not None:
        candidates = [i for i, path in enumerate(paths) if path and held[(path[0],)] == 0]
        best = max(candidates, key=lambda i: (reuse[i], -i), default=None)
        if best is not None and reuse[best] > 0:
            tail = tuple(paths[best])

    def key(i: int) -> tuple[tuple[int, int, int, int], ...]:
        path = paths[i]
        # Each level: the subtree holding the longest cached prefix first, then the bigger
        # one, then node id for determinism; the tail's branch after its siblings. A request
        # that ends at a node sorts before the requests that continue below it (shorter tuple
        # first).
        return tuple(
            (
                -held[tuple(path[: d + 1])],
                int(tuple(path[: d + 1]) == tail[: d + 1]),
                -below[tuple(path[: d + 1])],
                path[d],
            )
            for d in range(len(path))
        )

    return sorted(range(len(paths)), key=key)


def schedule(
    paths: Sequence[Sequence[int]],
    method: ScheduleMethod = "prefix-tree",
    cached: Sequence[int] | None = None,
    reuse: Sequence[float] | None = None,
) -> list[int]:
    """Dispatch to a scheduler by name (``cached``, ``reuse``: see
    :func:`schedule_by_prefix_tree`; the paper's Algorithm 5 reads neither).

    Raises:
        ValueError: an unknown ``method``, or ``cached`` or ``reuse`` of another length than
            ``paths``.
    """
    if method == "prefix-tree":
        return schedule_by_prefix_tree(paths, cached, reuse)
    if method == "first-step":
        return schedule_by_first_step(paths)
    raise ValueError(f"schedule method must be 'prefix-tree' or 'first-step', got {method!r}")
