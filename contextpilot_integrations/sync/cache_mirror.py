"""A mirror of an engine's KV prefix cache, built from its KV-cache events: the public entry
point that applies events and reports the requests whose cached prefix the engine dropped.

:class:`CacheMirror` joins :mod:`~contextpilot_integrations.sync.block_mirror` (the blocks each
data-parallel rank holds) and :mod:`~contextpilot_integrations.sync.request_attribution` (which
of our requests each cached block belongs to, and the eviction rule). For each event the blocks
change first, then the attribution is told what changed; every rid it evicts is passed to
``on_evict`` once, and each ``session_id`` a store echoes to ``on_session`` (once per batch: the
request reached this engine). ``AllBlocksCleared`` (and :meth:`CacheMirror.resync`) evicts every
request attached on that rank. Blocks are kept per namespace
(:mod:`~contextpilot_integrations.sync.block_namespaces`), so salted tenants and adapters never
count as sharing a cache.

Errors: each event is checked before it changes anything; one that fails (a hash that is
neither a 64-bit int nor bytes, a store naming one of its own blocks as parent, a field of the
wrong type, an item that is no KV event) is counted in ``malformed_events``, logged (the first
10 at warning level) and skipped, its batch-mates applied. Hashes are kept in canonical form
(:func:`~contextpilot_integrations.sync.kv_events.canonical_block_hash`); the readers take
either form and return the canonical one. The block bound (``max_blocks`` per rank) is enforced
after every store, each dropped block treated as a removal. Every walk is bounded by the rank's
block count.

Thread-safety: all public methods take one lock, per event (so it is held for one event at
most); ``on_evict`` runs after the lock is released, on the calling thread (the subscriber's
thread for events).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from contextpilot_integrations.sync.block_mirror import DEFAULT_MAX_BLOCKS, BlockMirror
from contextpilot_integrations.sync.block_namespaces import BlockKey, block_key, namespace_of
from contextpilot_integrations.sync.cache_state_source import (
    EvictCallback,
    SessionCallback,
    notify_evicted,
)
from contextpilot_integrations.sync.kv_events import (
    MAX_HASHES_PER_EVENT,
    MAX_STRING_LENGTH,
    MAX_TOKENS_PER_EVENT,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    canonical_block_hash,
)
from contextpilot_integrations.sync.page_tokens import page_tokens
from contextpilot_integrations.sync.request_attribution import RequestAttribution

__all__ = ["CacheMirror"]

logger = logging.getLogger(__name__)


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
            (counted as ``forgotten_requests``).
        max_blocks: bound on mirrored blocks per rank (default
            :data:`~contextpilot_integrations.sync.block_mirror.DEFAULT_MAX_BLOCKS`); beyond it
            the least recently stored leaf is dropped and the requests attached there are
            evicted (``bound_evictions``). The mirror's memory is bounded by this many blocks
            per rank plus ``max_requests`` requests.
        on_session: called with each ``session_id`` echoed by a ``BlockStored`` (once per
            batch, after the batch is applied, on the same thread as ``on_evict``); an
            exception is logged and counted (``session_callback_errors``).

    Raises:
        ValueError: ``page_size``, ``max_requests`` or ``max_blocks`` is not positive.
    """

    def __init__(
        self,
        on_evict: EvictCallback | None = None,
        *,
        page_size: int | None = None,
        max_requests: int = 100_000,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        on_session: SessionCallback | None = None,
    ) -> None:
        if page_size is not None and page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size!r}")
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests!r}")
        self._on_evict = on_evict
        self._on_session = on_session
        self._lock = threading.Lock()
        self._blocks = BlockMirror(page_size, max_blocks)
        self._attribution = RequestAttribution(self._blocks, max_requests)
        self._counters = {
            "clears": 0,
            "resyncs": 0,
            "evicted_requests": 0,
            "evict_callback_errors": 0,
            "session_callback_errors": 0,
            "malformed_events": 0,
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

        A bad event (see the module docstring) is counted in ``malformed_events`` and skipped;
        the others are applied.
        """
        return self.apply_events(rank, batch.events)

    def apply_events(self, rank: int, events: Iterable[KVEvent]) -> list[str]:
        """Apply events of ``rank`` in order; returns the rids evicted (see :meth:`apply_batch`)."""
        evicted: list[str] = []
        sessions: dict[str, None] = {}
        try:
            for index, event in enumerate(events):
                # One event at a time under the lock: readers and request registration wait
                # for one event at most (bounded by the decoder's limits), never for a batch.
                with self._lock:
                    self._add_rank(rank)
                    try:
                        self._apply(rank, _checked(event), evicted, sessions)
                    except (TypeError, ValueError) as exc:
                        self._skip(rank, index, event, exc)
        finally:
            self._notify(evicted)
            self._notify_sessions(sessions)
        return evicted

    def register_request(
        self,
        rid: str,
        token_ids: Sequence[Any],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Attribute blocks to ``rid`` by matching its prompt tokens (for engines that do not
        echo ``session_id``, or in addition to it).

        Args:
            rid: the request id the plan issued.
            token_ids: the prompt's token ids (or only its shared part: see
                :mod:`~contextpilot_integrations.sync.request_attribution`); whole pages count,
                a trailing partial page is never cached.
            cache_salt, lora_name: the request's tenant salt and LoRA adapter: it matches only
                blocks stored in that namespace.

        Returns:
            the number of pages of ``token_ids`` already cached (deepest match over ranks).

        Raises:
            TypeError: ``rid`` is not a str, or a token id is neither an int nor a tuple of ints.
            ValueError: ``rid`` is empty.
        """
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a str, got {type(rid).__name__}")
        if not rid:
            raise ValueError("rid must be a non-empty string, got ''")
        with self._lock:
            return self._attribution.register(rid, token_ids, namespace_of(cache_salt, lora_name))

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
        """The hashes of the blocks present on ``rank`` (a copy, canonical form)."""
        with self._lock:
            return self._blocks.hashes(rank)

    def block(
        self,
        block_hash: BlockHash,
        rank: int = 0,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any] | None:
        """``{"parent", "token_ids", "session_id", "media"}`` of a present block
        (``block_hash`` in either form) in the namespace of ``cache_salt`` and ``lora_name``
        (``parent``: its key, :func:`~contextpilot_integrations.sync.block_namespaces.block_key`),
        else None."""
        try:
            block_hash = canonical_block_hash(block_hash)
        except ValueError:
            return None
        key = block_key(namespace_of(cache_salt, lora_name), block_hash)
        with self._lock:
            block = self._blocks.block(rank, key)
            if block is None:
                return None
            return {
                "parent": block.parent,
                "token_ids": page_tokens(block.tokens) if block.tokens is not None else None,
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

    def request_blocks(self, rid: str) -> dict[int, set[BlockKey]]:
        """rank -> the deepest attributed block keys of ``rid`` (empty if none)."""
        with self._lock:
            return self._attribution.request_blocks(rid)

    def stats(self) -> dict[str, int]:
        """Counters and sizes: ``stored_blocks``, ``removed_blocks``, ``unknown_removals``,
        ``token_mismatch_events``, ``bound_evictions``, ``cycles_refused``,
        ``malformed_events``, ``clears``, ``resyncs``, ``evicted_requests``,
        ``forgotten_requests``, ``evict_callback_errors``, ``session_callback_errors``;
        ``blocks`` present, ``ranks``,
        ``tracked_requests``, ``attributed_requests``."""
        with self._lock:
            return {**self._blocks.stats(), **self._counters, **self._attribution.stats()}

    # ----------------------------------------------------------------------------------------
    # Events: the block mirror first, then the attribution
    # ----------------------------------------------------------------------------------------

    def _add_rank(self, rank: int) -> None:
        if self._blocks.add_rank(rank):
            self._attribution.start_rank(rank)

    def _apply(
        self, rank: int, event: KVEvent, evicted: list[str], sessions: dict[str, None]
    ) -> None:
        if isinstance(event, BlockStored):
            self._store(rank, event, evicted, sessions)
        elif isinstance(event, BlockRemoved):
            self._remove(rank, event, evicted)
        else:
            self._counters["clears"] += 1
            self._clear(rank, evicted)

    def _skip(self, rank: int, index: int, event: object, exc: Exception) -> None:
        self._counters["malformed_events"] += 1
        count = self._counters["malformed_events"]
        logger.log(
            logging.WARNING if count <= 10 else logging.DEBUG,
            "KV events rank %d: skipping malformed event %d (%s): %s",
            rank,
            index,
            type(event).__name__,
            exc,
        )

    def _store(
        self, rank: int, event: BlockStored, evicted: list[str], sessions: dict[str, None]
    ) -> None:
        learnt = self._blocks.learn_page_size(rank, event)
        try:
            chain = self._blocks.chain(rank, event)
            pages = self._blocks.store(rank, event)
        except (TypeError, ValueError):
            if learnt:  # the page size stays learnt; the requests still start matching
                self._attribution.start_rank(rank)
            raise
        if learnt:
            self._attribution.start_rank(rank)
        self._attribution.pages_stored(rank, pages)
        if event.session_id and chain.deepest is not None:
            self._attribution.session_stored(rank, event.session_id, chain.parent, chain.deepest)
            sessions[event.session_id] = None
        while self._blocks.over_bound(rank):
            self._broken(rank, self._blocks.evict_lru(rank), evicted)

    def _remove(self, rank: int, event: BlockRemoved, evicted: list[str]) -> None:
        walked: set[BlockKey] = set()  # each block walked once per event
        for block_hash in event.block_hashes:
            broken = self._blocks.remove(rank, block_hash, event.medium, walked)
            self._broken(rank, broken, evicted)

    def _broken(self, rank: int, broken: list[BlockKey], evicted: list[str]) -> None:
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

    def _notify_sessions(self, sessions: dict[str, None]) -> None:
        if self._on_session is None or not sessions:
            return
        errors = notify_evicted(self._on_session, sessions, "on_session")
        if errors:
            with self._lock:
                self._counters["session_callback_errors"] += errors


def _checked(event: object) -> KVEvent:
    """``event`` with its hashes in canonical form, once it passed the checks of the module
    docstring (the decoder's limits again, for events that did not come through it).

    Raises:
        TypeError: not a KV event.
        ValueError: a field breaks a check (nothing of the event is applied).
    """
    if isinstance(event, BlockStored):
        hashes = _canonical_hashes(event.block_hashes)
        parent = event.parent_block_hash
        if parent is not None:
            parent = canonical_block_hash(parent)
        if not isinstance(event.token_ids, list) or len(event.token_ids) > MAX_TOKENS_PER_EVENT:
            raise ValueError(f"token_ids must be a list of at most {MAX_TOKENS_PER_EVENT} ids")
        if type(event.block_size) is not int or event.block_size < 0:
            raise ValueError(f"block_size must be an int >= 0, got {event.block_size!r}")
        for name in ("medium", "session_id", "cache_salt", "lora_name"):
            _check_text(name, getattr(event, name))
        if event.extra_keys is not None and not isinstance(event.extra_keys, list):
            raise ValueError("extra_keys must be None or a list")
        if hashes is event.block_hashes and parent is event.parent_block_hash:
            return event
        return msgspec.structs.replace(event, block_hashes=hashes, parent_block_hash=parent)
    if isinstance(event, BlockRemoved):
        _check_text("medium", event.medium)
        hashes = _canonical_hashes(event.block_hashes)
        return event if hashes is event.block_hashes else BlockRemoved(hashes, event.medium)
    if isinstance(event, AllBlocksCleared):
        return event
    raise TypeError(f"event must be a KV event, got {type(event).__name__}")


def _canonical_hashes(hashes: object) -> list[BlockHash]:
    """``hashes`` itself when every hash is canonical already (the common case), else a copy in
    canonical form."""
    if not isinstance(hashes, list) or len(hashes) > MAX_HASHES_PER_EVENT:
        raise ValueError(f"block_hashes must be a list of at most {MAX_HASHES_PER_EVENT} hashes")
    for index, block_hash in enumerate(hashes):
        if canonical_block_hash(block_hash) is not block_hash:
            return hashes[:index] + [canonical_block_hash(h) for h in hashes[index:]]
    return hashes


def _check_text(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_STRING_LENGTH):
        raise ValueError(f"{name} must be None or a str of at most {MAX_STRING_LENGTH} characters")
