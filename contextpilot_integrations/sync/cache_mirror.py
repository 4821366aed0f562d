"""A mirror of an engine's KV prefix cache, built from its KV-cache events, and the attribution
of cached blocks to our requests.

What the mirror holds (per data-parallel rank, since each rank has its own cache): every block
the engine reported stored and not yet removed, as ``hash -> (parent hash, page token ids,
session id, media)``. Hashes are the engine's own (``BlockStored.block_hashes``), never
recomputed (DESIGN.md invariant 4).

Attribution of blocks to requests (no engine event carries the request id):

1. ``session_id`` echoed on ``BlockStored`` (SGLang's ``UnifiedRadixCache`` in 0.5.20+, recent
   vLLM): the plan's rid is sent as ``session_id``, so the stored chain belongs to that rid.
2. token matching: :meth:`CacheMirror.register_request` takes the request's prompt token ids;
   each stored page whose ``(parent hash, page tokens)`` continues a registered request's
   matched chain extends that request's cached prefix (also when the blocks were already cached
   by another request at registration time). Matching looks up ``(parent, tokens)`` pairs;
   it is O(1) per stored page whatever the number of registered requests.

A request is *cached* once its whole chain is present: for a session-echoed store, when the
store arrives; for token matching, when every whole page of the registered tokens is matched
(until then it is *matching*: a partial match on blocks of other requests, which may come and
go before the request itself is served without evicting it). A cached request is *attached*
to the deepest block of its chain.

Eviction rule: a cached request is evicted (``on_evict(rid)``, once) as soon as any block of
its chain leaves the cache, i.e. when its attached block or an ancestor of it is removed.
Engines evict least-recently-used *leaves* first (SGLang's radix cache; vLLM frees a chain
tail-first), so in practice the first block of a request to go is its deepest, and the rule
reads "evict when the deepest cached block is removed". Taking any block, not only the deepest,
covers the cases where an inner block goes first (vLLM can free an inner block whose children
stay): the engine's prefix match stops at the first missing block, so the request's prefix is
no longer fully cached either way. A block counts as present while it is held in any medium
(GPU, host memory, disk): a GPU eviction that keeps a host copy evicts nobody.
``AllBlocksCleared`` (and :meth:`CacheMirror.resync`) evicts every request attached on that
rank. Note that a request's tail (question, output tokens) is its deepest part: pass only the
tokens of the shared part (system prompt and context blocks) to ``register_request`` if the
tail should not count; session-echoed chains include whatever the engine stored.

Data-parallel ranks keep separate mirrors; a registered request matches on every rank (it is
not known which rank serves it), so a cached request is evicted when its chain breaks on any
rank that holds it: conservative (less believed reuse), never wrong reuse.

Thread-safety: all public methods take one lock; ``on_evict`` runs after the lock is released,
on the calling thread (the subscriber's thread for events).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from contextpilot_integrations.sync.cache_state import EvictCallback, notify_evicted
from contextpilot_integrations.sync.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

PageKey = tuple[Any, ...]
"""The token ids of one page, as a tuple."""


class _Block:
    __slots__ = ("parent", "tokens", "session_id", "media", "rids", "matching")

    def __init__(
        self, parent: BlockHash | None, tokens: PageKey | None, session_id: str | None, medium: str
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.session_id = session_id
        self.media = {medium}
        self.rids: set[str] | None = None  # cached requests attached here
        self.matching: set[str] | None = None  # requests whose partial token match ends here


class _Rank:
    """The mirrored cache of one data-parallel rank."""

    __slots__ = ("blocks", "children", "pending", "page_size")

    def __init__(self, page_size: int | None) -> None:
        self.blocks: dict[BlockHash, _Block] = {}
        # parent hash (None: root) -> page tokens -> child hash, for present blocks with tokens.
        self.children: dict[BlockHash | None, dict[PageKey, BlockHash]] = {}
        # (deepest matched hash, next page tokens) -> rids whose matching waits on that page.
        self.pending: dict[tuple[BlockHash | None, PageKey], set[str]] = {}
        self.page_size = page_size


class _Request:
    __slots__ = ("rid", "token_ids", "attached", "progress")

    def __init__(self, rid: str, token_ids: tuple[Any, ...] | None) -> None:
        self.rid = rid
        self.token_ids = token_ids
        # rank -> deepest attributed block hashes (one per chain the request stored).
        self.attached: dict[int, set[BlockHash]] = {}
        # rank -> (deepest matched hash or None, number of pages matched) for token matching.
        self.progress: dict[int, tuple[BlockHash | None, int]] = {}


class CacheMirror:
    """The engine's prefix cache as seen through its KV events, with request attribution.

    Args:
        on_evict: called with a rid once that request's cached chain is broken (see the module
            docstring); e.g. ``ContextIndex.evict``. Its return value is ignored; an exception
            is logged and counted, never raised to the event stream.
        page_size: tokens per engine page for token matching; None learns it from the first
            ``BlockStored.block_size`` of each rank.
        max_requests: bound on tracked requests (registered or attributed); beyond it the
            least recently registered or attributed request is forgotten without a callback
            (counted as ``forgotten``), so the mirror's memory stays bounded by the engine's
            cache plus this many requests.

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
        self._page_size = page_size
        self._max_requests = max_requests
        self._lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._counters = {
            "stored_blocks": 0,
            "removed_blocks": 0,
            "unknown_removals": 0,
            "clears": 0,
            "resyncs": 0,
            "evicted_requests": 0,
            "forgotten_requests": 0,
            "evict_callback_errors": 0,
            "token_mismatch_events": 0,
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
        """
        return self.apply_events(rank, batch.events)

    def apply_events(self, rank: int, events: Iterable[KVEvent]) -> list[str]:
        """Apply events of ``rank`` in order; returns the rids evicted (see :meth:`apply_batch`)."""
        evicted: list[str] = []
        with self._lock:
            state = self._rank(rank)
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(rank, state, event)
                elif isinstance(event, BlockRemoved):
                    self._remove(rank, state, event, evicted)
                elif isinstance(event, AllBlocksCleared):
                    self._counters["clears"] += 1
                    self._clear(rank, state, evicted)
                else:
                    raise TypeError(f"event must be a KV event, got {type(event).__name__}")
            self._counters["evicted_requests"] += len(evicted)
        self._notify(evicted)
        return evicted

    def register_request(self, rid: str, token_ids: Sequence[Any]) -> int:
        """Attribute blocks to ``rid`` by matching its prompt tokens (for engines that do not
        echo ``session_id``, or in addition to it).

        Args:
            rid: the request id the plan issued.
            token_ids: the prompt's token ids (or only its shared part: see the module
                docstring); whole pages count, a trailing partial page is never cached.

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
        tokens = tuple(int(t) if not isinstance(t, tuple) else t for t in token_ids)
        with self._lock:
            request = self._requests.get(rid)
            if request is not None:
                self._drop_request(request)
            request = _Request(rid, tokens)
            self._track(request)
            matched = 0
            for rank, state in self._ranks.items():
                matched = max(matched, self._start_matching(rank, state, request))
        return matched

    def forget_request(self, rid: str) -> bool:
        """Stop tracking ``rid`` without calling ``on_evict``; False if it was not tracked."""
        with self._lock:
            request = self._requests.get(rid)
            if request is None:
                return False
            self._drop_request(request)
            return True

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
            ranks = list(self._ranks) if rank is None else [rank]
            for each in ranks:
                self._clear(each, self._rank(each), evicted)
            self._counters["evicted_requests"] += len(evicted)
        self._notify(evicted)
        return evicted

    def block_hashes(self, rank: int = 0) -> set[BlockHash]:
        """The hashes of the blocks present on ``rank`` (a copy)."""
        with self._lock:
            state = self._ranks.get(rank)
            return set(state.blocks) if state else set()

    def block(self, block_hash: BlockHash, rank: int = 0) -> dict[str, Any] | None:
        """``{"parent", "token_ids", "session_id", "media"}`` of a present block, else None."""
        with self._lock:
            state = self._ranks.get(rank)
            block = state.blocks.get(block_hash) if state else None
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
            request = self._requests.get(rid)
            return request is not None and bool(request.attached)

    def cached_requests(self) -> set[str]:
        """The rids with at least one attributed block present."""
        with self._lock:
            return {rid for rid, req in self._requests.items() if req.attached}

    def request_blocks(self, rid: str) -> dict[int, set[BlockHash]]:
        """rank -> the deepest attributed block hashes of ``rid`` (empty if none)."""
        with self._lock:
            request = self._requests.get(rid)
            if request is None:
                return {}
            return {rank: set(hashes) for rank, hashes in request.attached.items()}

    def stats(self) -> dict[str, int]:
        """Counters and sizes: blocks, tracked and attributed requests, events applied."""
        with self._lock:
            out = dict(self._counters)
            out["blocks"] = sum(len(state.blocks) for state in self._ranks.values())
            out["ranks"] = len(self._ranks)
            out["tracked_requests"] = len(self._requests)
            out["attributed_requests"] = sum(1 for r in self._requests.values() if r.attached)
            return out

    # ----------------------------------------------------------------------------------------
    # Events
    # ----------------------------------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank(self._page_size)
            if state.page_size is not None:
                for request in self._requests.values():
                    self._start_matching(rank, state, request)
        return state

    def _store(self, rank: int, state: _Rank, event: BlockStored) -> None:
        hashes = event.block_hashes
        pages = self._split_pages(event)
        if state.page_size is None and pages is not None and event.block_size > 0:
            state.page_size = event.block_size
            for request in self._requests.values():
                self._start_matching(rank, state, request)
        medium = event.medium or MEDIUM_GPU
        parent = event.parent_block_hash
        for index, block_hash in enumerate(hashes):
            tokens = pages[index] if pages is not None else None
            block = state.blocks.get(block_hash)
            if block is None:
                state.blocks[block_hash] = _Block(parent, tokens, event.session_id, medium)
                self._counters["stored_blocks"] += 1
                if tokens is not None:
                    state.children.setdefault(parent, {})[tokens] = block_hash
            else:
                block.media.add(medium)
                if block.tokens is None and tokens is not None:
                    block.tokens = tokens
                    state.children.setdefault(block.parent, {})[tokens] = block_hash
            if tokens is not None and state.pending:
                waiting = state.pending.pop((parent, tokens), None)
                if waiting:
                    for rid in waiting:
                        self._advance(rank, state, self._requests[rid], parent, block_hash)
            parent = block_hash
        if event.session_id and hashes:
            self._attach_session(rank, state, event.session_id, event.parent_block_hash, parent)

    def _split_pages(self, event: BlockStored) -> list[PageKey] | None:
        count = len(event.block_hashes)
        size = event.block_size
        tokens = event.token_ids
        if count == 0 or size <= 0 or len(tokens) != size * count:
            if count and tokens:
                self._counters["token_mismatch_events"] += 1
                logger.debug(
                    "BlockStored with %d token ids for %d blocks of %d: no token matching",
                    len(tokens),
                    count,
                    size,
                )
            return None
        return [tuple(tokens[i : i + size]) for i in range(0, size * count, size)]

    def _remove(self, rank: int, state: _Rank, event: BlockRemoved, evicted: list[str]) -> None:
        medium = event.medium or MEDIUM_GPU
        for block_hash in event.block_hashes:
            block = state.blocks.get(block_hash)
            if block is None:
                self._counters["unknown_removals"] += 1
                continue
            block.media.discard(medium)
            if block.media:
                continue
            self._counters["removed_blocks"] += 1
            broken, unmatched = self._dependents(state, block_hash)
            for rid in unmatched:
                self._stop_matching(rank, state, self._requests[rid])
            del state.blocks[block_hash]
            if block.tokens is not None:
                siblings = state.children.get(block.parent)
                if siblings is not None and siblings.get(block.tokens) == block_hash:
                    del siblings[block.tokens]
                    if not siblings:
                        del state.children[block.parent]
            for rid in broken:
                request = self._requests.get(rid)
                if request is not None:
                    self._drop_request(request)
                    evicted.append(rid)
            for rid in unmatched:  # match again from the blocks still present
                request = self._requests.get(rid)
                if request is not None:
                    self._start_matching(rank, state, request)

    def _dependents(self, state: _Rank, root: BlockHash) -> tuple[list[str], list[str]]:
        """(cached rids attached, matching rids whose partial match ends) at ``root`` or at a
        present descendant of it (usually none: LRU removes leaves first); sorted, so that
        the eviction order is deterministic."""
        block = state.blocks[root]
        if root not in state.children:  # a leaf: the common case, no walk
            attached_here = sorted(block.rids) if block.rids else []
            if not block.matching:
                return attached_here, []
            return attached_here, sorted(block.matching - set(attached_here))
        attached: set[str] = set()
        matching: set[str] = set()
        stack = [root]
        while stack:
            block_hash = stack.pop()
            block = state.blocks.get(block_hash)
            if block is not None:
                if block.rids:
                    attached.update(block.rids)
                if block.matching:
                    matching.update(block.matching)
            children = state.children.get(block_hash)
            if children:
                stack.extend(children.values())
        return sorted(attached), sorted(matching - attached)

    def _clear(self, rank: int, state: _Rank, evicted: list[str]) -> None:
        attached = sorted(
            (r for r in self._requests.values() if r.attached.get(rank)), key=lambda r: r.rid
        )
        for request in attached:
            self._drop_request(request)
            evicted.append(request.rid)
        state.blocks.clear()
        state.children.clear()
        state.pending.clear()
        for request in self._requests.values():
            request.progress.pop(rank, None)
            self._start_matching(rank, state, request)

    # ----------------------------------------------------------------------------------------
    # Attribution
    # ----------------------------------------------------------------------------------------

    def _track(self, request: _Request) -> None:
        self._requests[request.rid] = request
        self._requests.move_to_end(request.rid)
        while len(self._requests) > self._max_requests:
            _, oldest = next(iter(self._requests.items()))
            self._drop_request(oldest)
            self._counters["forgotten_requests"] += 1

    def _attach(self, rank: int, state: _Rank, request: _Request, block_hash: BlockHash) -> None:
        block = state.blocks[block_hash]
        if block.rids is None:
            block.rids = set()
        block.rids.add(request.rid)
        request.attached.setdefault(rank, set()).add(block_hash)

    def _detach(self, rank: int, state: _Rank, request: _Request, block_hash: BlockHash) -> None:
        hashes = request.attached.get(rank)
        if hashes is None or block_hash not in hashes:
            return
        hashes.discard(block_hash)
        if not hashes:
            del request.attached[rank]
        block = state.blocks.get(block_hash)
        if block is not None and block.rids is not None:
            block.rids.discard(request.rid)
            if not block.rids:
                block.rids = None

    def _attach_session(
        self,
        rank: int,
        state: _Rank,
        rid: str,
        first_parent: BlockHash | None,
        deepest: BlockHash,
    ) -> None:
        request = self._requests.get(rid)
        if request is None:
            request = _Request(rid, None)
            self._track(request)
        else:
            self._requests.move_to_end(rid)
        if first_parent is not None:
            self._detach(rank, state, request, first_parent)
        self._attach(rank, state, request, deepest)

    def _pages(self, request: _Request, page_size: int) -> int:
        assert request.token_ids is not None
        return len(request.token_ids) // page_size

    def _page(self, request: _Request, page_size: int, index: int) -> PageKey:
        assert request.token_ids is not None
        return request.token_ids[index * page_size : (index + 1) * page_size]

    def _start_matching(self, rank: int, state: _Rank, request: _Request) -> int:
        """Walk the present blocks along the request's pages: attach at the deepest page when
        all match, else wait on the next page. Returns the number of pages matched."""
        size = state.page_size
        if request.token_ids is None or size is None or rank in request.progress:
            return 0
        total = self._pages(request, size)
        deepest: BlockHash | None = None
        matched = 0
        while matched < total:
            following = state.children.get(deepest)
            child = following.get(self._page(request, size, matched)) if following else None
            if child is None:
                break
            deepest = child
            matched += 1
        self._set_progress(rank, state, request, deepest, matched, total)
        return matched

    def _advance(
        self,
        rank: int,
        state: _Rank,
        request: _Request,
        parent: BlockHash | None,
        block_hash: BlockHash,
    ) -> None:
        size = state.page_size
        assert size is not None
        _, matched = request.progress[rank]
        if parent is not None:
            matching = state.blocks[parent].matching
            if matching is not None:
                matching.discard(request.rid)
        total = self._pages(request, size)
        self._set_progress(rank, state, request, block_hash, matched + 1, total)

    def _set_progress(
        self,
        rank: int,
        state: _Rank,
        request: _Request,
        deepest: BlockHash | None,
        matched: int,
        total: int,
    ) -> None:
        request.progress[rank] = (deepest, matched)
        if matched == total:
            if deepest is not None:
                self._attach(rank, state, request, deepest)
            return
        if deepest is not None:
            block = state.blocks[deepest]
            if block.matching is None:
                block.matching = set()
            block.matching.add(request.rid)
        key = (deepest, self._page(request, self._page_size_of(state), matched))
        state.pending.setdefault(key, set()).add(request.rid)

    def _page_size_of(self, state: _Rank) -> int:
        assert state.page_size is not None
        return state.page_size

    def _stop_matching(self, rank: int, state: _Rank, request: _Request) -> None:
        """Forget the request's token-match progress on ``rank`` (pending key, marks)."""
        progress = request.progress.pop(rank, None)
        if progress is None or state.page_size is None:
            return
        deepest, matched = progress
        if matched >= self._pages(request, state.page_size):
            return
        if deepest is not None:
            block = state.blocks.get(deepest)
            if block is not None and block.matching is not None:
                block.matching.discard(request.rid)
                if not block.matching:
                    block.matching = None
        key = (deepest, self._page(request, state.page_size, matched))
        waiting = state.pending.get(key)
        if waiting is not None:
            waiting.discard(request.rid)
            if not waiting:
                del state.pending[key]

    def _drop_request(self, request: _Request) -> None:
        """Remove every trace of ``request`` (attachments, pending matches, the record)."""
        for rank, hashes in list(request.attached.items()):
            state = self._ranks[rank]
            for block_hash in list(hashes):
                self._detach(rank, state, request, block_hash)
        for rank in list(request.progress):
            self._stop_matching(rank, self._ranks[rank], request)
        self._requests.pop(request.rid, None)

    def _notify(self, evicted: list[str]) -> None:
        errors = notify_evicted(self._on_evict, evicted)
        if errors:
            with self._lock:
                self._counters["evict_callback_errors"] += errors
