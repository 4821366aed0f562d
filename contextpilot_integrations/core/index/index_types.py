"""What the context index answers: a search's match, and the index's counters."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IndexStats", "SearchResult"]


@dataclass(frozen=True)
class SearchResult:
    """Where a request's blocks meet the index.

    Attributes:
        prefix: block ids of the matched prefix, in index order (all are request blocks).
        prefix_tokens: tokens of ``prefix`` (by the request's own token counts).
        path: node ids from the root's child down to the last node the match entered.
        node_id: the node where the match ended (0 = root: nothing matched).
        partial: True when the match ended inside that node's edge.
    """

    prefix: tuple[int, ...]
    prefix_tokens: int
    path: tuple[int, ...]
    node_id: int
    partial: bool


@dataclass(frozen=True)
class IndexStats:
    """Counters of a :class:`ContextIndex` (plain numbers; see :meth:`ContextIndex.stats`)."""

    requests: int
    nodes: int
    tokens: int
    height: int
    inserts: int
    evictions: int
    lru_evictions: int
    searches: int
    searched_tokens: int
    matched_tokens: int
