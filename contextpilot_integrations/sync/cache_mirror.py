"""A mirror of an engine's KV prefix cache, built from its KV-cache events: the public entry
point that applies events and reports the requests whose cached prefix the engine dropped.

:class:`CacheMirror` joins two parts, each in its own module:

- :mod:`~contextpilot_integrations.sync.block_mirror`: the blocks each data-parallel rank
  holds, as the events say (hashes, parents, page tokens, media);
- :mod:`~contextpilot_integrations.sync.request_attribution`: which of our requests each
  cached block belongs to (the echoed ``session_id``, or matching the request's prompt tokens)
  and the eviction rule: a cached request is evicted as soon as any block of its chain leaves
  the cache; ``AllBlocksCleared`` (and :meth:`CacheMirror.resync`) evicts every request
  attached on that rank.

For each event the mirror of blocks is changed first, then the attribution is told what
changed; every rid it evicts is passed to ``on_evict`` once.

Thread-safety: all public methods take one lock; ``on_evict`` runs after the lock is released,
on the calling thread (the subscriber's thread for events).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from contextpilot_integrations.sync.block_mirror import BlockMirror
from contextpilot_integrations.sync.cache_state_source import EvictCallback, notify_evicted
from contextpilot_integrations.sync.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from contextpilot_integrations.sync.request_attribution import RequestAttribution

__all__ = ["CacheMirror"]


class CacheMirror:
    """The engine's prefix cache as seen through its KV events, with request attribution.

    Args:
        on_evict: called with a rid once that request's cached chain is broken (see
            :mod:`~contextpilot_integrations.sync.request_attribution`); e.g.
            ``ContextIndex.evict``. Its return value is ignored; an exception is logged and
            counted, never raised to the event stream.
        page_size: tokens per engine page for token matching; None learns it from the first
            ``BlockStored.block_size`` of each rank.
        max_requests: bound on tracked requests (registered or attributed); beyond it the
            least recently registered or attributed request is forgotten without a callback
            (counted as ``forgotten_requests``), so the mirror's memory stays bounded by the
            engine's cache plus this many requests.

    Raises:
        ValueError: ``page_size`` or ``max_requests`` is not positive.
    """

    def __init__(
        self,
        on_evict: EvictCallback | None = None,
        *,
        page_size: int | None = None,
        max_requests: int = 100_000,
    ) -> None:
        if page_size is not None and page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size!r}")
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests!r}")
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._blocks = BlockMirror(page_size)
        self._attribution = RequestAttribution(self._blocks, max_requests)
        self._counters = {
            "clears": 0,
            "resyncs": 0,
            "evicted_requests": 0,
            "evict_callback_errors": 0,
        }

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    def apply_batch(self, rank: int, batch: KVEventBatch) -> list[str]:
        """Apply one batch's events in order (the subscriber's ``on_batch`` handler).

        Mutates the mirror of ``rank`` and the attribution; calls ``on_evict`` for each request
        evicted by the batch.

        Returns:
            the rids evicted by this batch, in eviction order.

        Raises:
            TypeError: an item of the batch is not a KV event (nothing after it is applied).
        """
        return self.apply_events(rank, batch.events)

    def apply_events(self, rank: int, events: Iterable[KVEvent]) -> list[str]:
        """Apply events of ``rank`` in order; returns the rids evicted (see :meth:`apply_batch`)."""
        evicted: list[str] = []
        try:
            with self._lock:
                self._add_rank(rank)
                for event in events:
                    if isinstance(event, BlockStored):
                        self._store(rank, event)
                    elif isinstance(event, BlockRemoved):
                        self._remove(rank, event, evicted)
                    elif isinstance(event, AllBlocksCleared):
                        self._counters["clears"] += 1
                        self._clear(rank, evicted)
                    else:
                        raise TypeError(f"event must be a KV event, got {type(event).__name__}")
        finally:
            # What the events before a bad one evicted is gone from the cache all the same.
            self._notify(evicted)
        return evicted

    def register_request(self, rid: str, token_ids: Sequence[Any]) -> int:
        """Attribute blocks to ``rid`` by matching its prompt tokens (for engines that do not
        echo ``session_id``, or in addition to it).

        Args:
            rid: the request id the plan issued.
            token_ids: the prompt's token ids (or only its shared part: see
                :mod:`~contextpilot_integrations.sync.request_attribution`); whole pages count,
                a trailing partial page is never cached.

        Returns:
            the number of pages of ``token_ids`` already cached (deepest match over ranks).

        Raises:
            TypeError: ``rid`` is not a str.
            ValueError: ``rid`` is empty.
        """
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a str, got {type(rid).__name__}")
        if not rid:
            raise ValueError("rid must be a non-empty string, got ''")
        with self._lock:
            return self._attribution.register(rid, token_ids)

    def forget_request(self, rid: str) -> bool:
        """Stop tracking ``rid`` without calling ``on_evict``; False if it was not tracked."""
        with self._lock:
            return self._attribution.forget(rid)

    def resync(self, rank: int | None = None) -> list[str]:
        """Forget what the mirror believes cached on ``rank`` (all ranks when None) and evict
        every request attached there; used when the event stream lost continuity and could
        not be repaired. Registered requests start matching again from the root.

        Returns:
            the rids evicted.
        """
        evicted: list[str] = []
        with self._lock:
            self._counters["resyncs"] += 1
            if rank is not None:
                self._add_rank(rank)
            for each in self._blocks.ranks() if rank is None else [rank]:
                self._clear(each, evicted)
        self._notify(evicted)
        return evicted

    def block_hashes(self, rank: int = 0) -> set[BlockHash]:
        """The hashes of the blocks present on ``rank`` (a copy)."""
        with self._lock:
            return self._blocks.hashes(rank)

    def block(self, block_hash: BlockHash, rank: int = 0) -> dict[str, Any] | None:
        """``{"parent", "token_ids", "session_id", "media"}`` of a present block, else None."""
        with self._lock:
            block = self._blocks.block(rank, block_hash)
            if block is None:
                return None
            return {
                "parent": block.parent,
                "token_ids": list(block.tokens) if block.tokens is not None else None,
                "session_id": block.session_id,
                "media": sorted(block.media),
            }

    def is_cached(self, rid: str) -> bool:
        """Whether ``rid`` has an attributed block present (O(1))."""
        with self._lock:
            return self._attribution.is_cached(rid)

    def cached_requests(self) -> set[str]:
        """The rids with at least one attributed block present."""
        with self._lock:
            return self._attribution.cached_requests()

    def request_blocks(self, rid: str) -> dict[int, set[BlockHash]]:
        """rank -> the deepest attributed block hashes of ``rid`` (empty if none)."""
        with self._lock:
            return self._attribution.request_blocks(rid)

    def stats(self) -> dict[str, int]:
        """Counters and sizes: ``stored_blocks``, ``removed_blocks``, ``unknown_removals``,
        ``token_mismatch_events``, ``clears``, ``resyncs``, ``evicted_requests``,
        ``forgotten_requests``, ``evict_callback_errors``; ``blocks`` present, ``ranks``,
        ``tracked_requests``, ``attributed_requests``."""
        with self._lock:
            return {**self._blocks.stats(), **self._counters, **self._attribution.stats()}

    # ----------------------------------------------------------------------------------------
    # Events: the block mirror first, then the attribution
    # ----------------------------------------------------------------------------------------

    def _add_rank(self, rank: int) -> None:
        if self._blocks.add_rank(rank):
            self._attribution.start_rank(rank)

    def _store(self, rank: int, event: BlockStored) -> None:
        if self._blocks.learn_page_size(rank, event):
            self._attribution.start_rank(rank)
        self._attribution.pages_stored(rank, self._blocks.store(rank, event))
        if event.session_id and event.block_hashes:
            self._attribution.session_stored(
                rank, event.session_id, event.parent_block_hash, event.block_hashes[-1]
            )

    def _remove(self, rank: int, event: BlockRemoved, evicted: list[str]) -> None:
        for block_hash in event.block_hashes:
            broken = self._blocks.remove(rank, block_hash, event.medium)
            if broken:
                rids = self._attribution.blocks_removed(rank, broken)
                evicted.extend(rids)
                self._counters["evicted_requests"] += len(rids)

    def _clear(self, rank: int, evicted: list[str]) -> None:
        rids = self._attribution.clear_rank(rank)
        self._blocks.clear(rank)
        self._attribution.start_rank(rank)
        evicted.extend(rids)
        self._counters["evicted_requests"] += len(rids)

    def _notify(self, evicted: list[str]) -> None:
        errors = notify_evicted(self._on_evict, evicted)
        if errors:
            with self._lock:
                self._counters["evict_callback_errors"] += errors
