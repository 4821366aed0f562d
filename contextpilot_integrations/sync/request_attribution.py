"""Which of our requests the engine's cached blocks belong to, and when a request's prefix breaks.

No engine event carries the request id (docs/DESIGN.md, "SGLang KV events"), so blocks are
attributed two ways:

1. ``session_id`` echoed on ``BlockStored`` (SGLang 0.5.20+, recent vLLM): the plan's rid is
   sent as ``session_id``, so the stored chain belongs to that rid
   (:meth:`RequestAttribution.session_stored`).
2. token matching: :meth:`RequestAttribution.register` takes the request's prompt token ids;
   each stored page whose ``(parent hash, page tokens)`` continues a registered request's
   matched chain extends its cached prefix (also when another request cached the blocks
   first). O(1) per stored page, whatever the number of registered requests.

A request is *cached* once its whole chain is present (until then, by token matching, it is
*matching*), and *attached* to the deepest block of its chain. Eviction rule
(:meth:`RequestAttribution.blocks_removed`): a cached request is evicted as soon as any block of
its chain leaves the cache (the engine's prefix match stops at the first missing block); a
cleared rank evicts every request attached there. A request's tail (question, output tokens) is
its deepest part: register only the shared part's tokens if the tail should not count.

A request is registered in its namespace (its ``cache_salt`` and LoRA name,
:class:`~contextpilot_integrations.sync.block_namespaces.Namespace`) and matches only pages
stored there. Data-parallel ranks are attributed separately and a request matches on every rank,
so it is evicted when its chain breaks on any rank that holds it. The evicted rids are returned,
never passed to ``on_evict`` here; tracked requests are bounded (an LRU). Not thread-safe by
itself: the ``CacheMirror`` lock is held around every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.sync.block_mirror import BlockMirror, StoredPage
from contextpilot_integrations.sync.block_namespaces import (
    BlockKey,
    Namespace,
    TokenParent,
    root_key,
)
from contextpilot_integrations.sync.page_tokens import (
    PackedTokens,
    PageKey,
    pack_tokens,
    packed_length,
    packed_page,
)

__all__ = ["RequestAttribution"]


class _Request:
    __slots__ = ("rid", "token_ids", "length", "attached", "progress", "root")

    def __init__(
        self, rid: str, token_ids: PackedTokens | None, namespace: Namespace | None = None
    ) -> None:
        self.rid = rid
        self.token_ids = token_ids  # packed (block_mirror.pack_tokens): 8 bytes per id
        self.length = 0 if token_ids is None else packed_length(token_ids)  # token ids
        # rank -> deepest attributed block keys (one per chain the request stored).
        self.attached: dict[int, set[BlockKey]] = {}
        # rank -> (deepest matched key or None, number of pages matched) for token matching.
        self.progress: dict[int, tuple[BlockKey | None, int]] = {}
        self.root = root_key(namespace)  # where its token matching starts

    def after(self, deepest: BlockKey | None) -> TokenParent:
        """What the page after ``deepest`` (None: nothing matched) is keyed under."""
        return deepest if deepest is not None else self.root


class _RankMarks:
    """Where the requests stand on one rank's blocks."""

    __slots__ = ("attached", "matching", "pending")

    def __init__(self) -> None:
        # block key -> cached requests attached there.
        self.attached: dict[BlockKey, set[str]] = {}
        # block key -> requests whose partial token match ends there.
        self.matching: dict[BlockKey, set[str]] = {}
        # (deepest matched key or root, next page tokens) -> rids whose matching waits on it.
        self.pending: dict[tuple[TokenParent, PageKey], set[str]] = {}


class RequestAttribution:
    """Requests attributed to the blocks of a :class:`BlockMirror`.

    Args:
        blocks: the mirror whose blocks are attributed (read only here).
        max_requests: bound on tracked requests (registered or attributed); beyond it the
            least recently registered or attributed request is forgotten without an eviction
            (counted as ``forgotten_requests``).

    Raises:
        ValueError: ``max_requests`` is not a positive int.
    """

    def __init__(self, blocks: BlockMirror, max_requests: int) -> None:
        self._blocks = blocks
        self._requests: LRU[str, _Request] = LRU(max_requests)
        self._marks: dict[int, _RankMarks] = {}
        self.forgotten_requests = 0

    # ----------------------------------------------------------------------------------------
    # Public API: requests
    # ----------------------------------------------------------------------------------------

    def register(
        self, rid: str, token_ids: Sequence[Any], namespace: Namespace | None = None
    ) -> int:
        """Track ``rid`` by its prompt tokens in ``namespace`` (None: the default; replacing
        what was tracked of it) and match it on every rank; returns the number of whole pages
        already cached (deepest over ranks)."""
        tokens = pack_tokens(token_ids)
        request = self._requests.peek(rid)
        if request is not None:
            self._drop(request)
        request = _Request(rid, tokens, namespace)
        self._track(request)
        matched = 0
        for rank in self._blocks.ranks():
            matched = max(matched, self._start_matching(rank, request))
        return matched

    def forget(self, rid: str) -> bool:
        """Stop tracking ``rid`` (no eviction); False if it was not tracked."""
        request = self._requests.peek(rid)
        if request is None:
            return False
        self._drop(request)
        return True

    def is_cached(self, rid: str) -> bool:
        """Whether ``rid`` has an attributed block present."""
        request = self._requests.peek(rid)
        return request is not None and bool(request.attached)

    def cached_requests(self) -> set[str]:
        """The rids with at least one attributed block present."""
        return {rid for rid, request in self._requests.items() if request.attached}

    def request_blocks(self, rid: str) -> dict[int, set[BlockKey]]:
        """rank -> the deepest attributed block keys of ``rid`` (a copy; empty if none)."""
        request = self._requests.peek(rid)
        if request is None:
            return {}
        return {rank: set(hashes) for rank, hashes in request.attached.items()}

    def stats(self) -> dict[str, int]:
        """``tracked_requests``, ``attributed_requests``, ``forgotten_requests``."""
        return {
            "forgotten_requests": self.forgotten_requests,
            "tracked_requests": len(self._requests),
            "attributed_requests": sum(1 for r in self._requests.values() if r.attached),
        }

    # ----------------------------------------------------------------------------------------
    # Public API: what an event changed in the block mirror (called right after it)
    # ----------------------------------------------------------------------------------------

    def start_rank(self, rank: int) -> None:
        """``rank`` is new or its page size was just learnt: match every registered request
        there (nothing happens while its page size is unknown)."""
        for request in self._requests.values():
            self._start_matching(rank, request)

    def pages_stored(self, rank: int, pages: Sequence[StoredPage]) -> None:
        """Pages were stored (in chain order): advance the requests whose match waits on them."""
        marks = self._marks.get(rank)
        if marks is None or not marks.pending:
            return
        for parent, block_hash, tokens in pages:
            waiting = marks.pending.pop((parent, tokens), None)
            if waiting:
                for rid in waiting:
                    self._advance(rank, marks, self._tracked(rid), block_hash)

    def session_stored(
        self, rank: int, rid: str, first_parent: BlockKey | None, deepest: BlockKey
    ) -> None:
        """A chain from ``first_parent`` to ``deepest`` was stored with ``session_id=rid``:
        attach ``rid`` there (tracking it if needed); a chain that continues one ``rid``
        stored before moves its attachment down."""
        request = self._requests.peek(rid)
        if request is None:
            request = _Request(rid, None)
            self._track(request)
        else:
            self._requests.touch(rid)
        if first_parent is not None:
            self._detach(rank, request, first_parent)
        self._attach(rank, request, deepest)

    def blocks_removed(self, rank: int, broken: Sequence[BlockKey]) -> list[str]:
        """A block left the cache; ``broken`` is it and its present descendants (as
        :meth:`BlockMirror.remove` returns them, the block already gone).

        Evicts (stops tracking) the cached requests attached at any of them; the requests
        whose partial match ended there match again from the blocks still present.

        Returns:
            the evicted rids, sorted.
        """
        evicted, unmatched = self._dependents(rank, broken)
        for rid in unmatched:
            self._stop_matching(rank, self._tracked(rid))
        for rid in evicted:
            self._drop(self._tracked(rid))
        for rid in unmatched:
            self._start_matching(rank, self._tracked(rid))
        return evicted

    def clear_rank(self, rank: int) -> list[str]:
        """Every block of ``rank`` is about to go (``AllBlocksCleared``, a resync): evict the
        requests attached there and drop the rank's match progress. Call :meth:`start_rank`
        once the blocks are cleared.

        Returns:
            the evicted rids, sorted.
        """
        attached = sorted(rid for rid, r in self._requests.items() if r.attached.get(rank))
        for rid in attached:
            self._drop(self._tracked(rid))
        self._marks.pop(rank, None)
        for request in self._requests.values():
            request.progress.pop(rank, None)
        return attached

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _tracked(self, rid: str) -> _Request:
        request = self._requests.peek(rid)
        assert request is not None, "a marked rid is tracked"
        return request

    def _marks_of(self, rank: int) -> _RankMarks:
        marks = self._marks.get(rank)
        if marks is None:
            marks = self._marks[rank] = _RankMarks()
        return marks

    def _track(self, request: _Request) -> None:
        for _, oldest in self._requests.put(request.rid, request):
            self._drop(oldest)
            self.forgotten_requests += 1

    def _dependents(self, rank: int, broken: Sequence[BlockKey]) -> tuple[list[str], list[str]]:
        """(cached rids attached, matching rids whose partial match ends) at the ``broken``
        blocks; sorted, so that the eviction order is deterministic."""
        marks = self._marks.get(rank)
        if marks is None:
            return [], []
        if len(broken) == 1:  # a leaf: the common case
            here = marks.attached.get(broken[0])
            ending = marks.matching.get(broken[0])
            attached_here = sorted(here) if here else []
            return attached_here, sorted(ending.difference(attached_here)) if ending else []
        attached: set[str] = set()
        matching: set[str] = set()
        for block_hash in broken:
            here = marks.attached.get(block_hash)
            if here:
                attached.update(here)
            ending = marks.matching.get(block_hash)
            if ending:
                matching.update(ending)
        return sorted(attached), sorted(matching - attached)

    def _attach(self, rank: int, request: _Request, block_hash: BlockKey) -> None:
        self._marks_of(rank).attached.setdefault(block_hash, set()).add(request.rid)
        request.attached.setdefault(rank, set()).add(block_hash)

    def _detach(self, rank: int, request: _Request, block_hash: BlockKey) -> None:
        hashes = request.attached.get(rank)
        if hashes is None or block_hash not in hashes:
            return
        hashes.discard(block_hash)
        if not hashes:
            del request.attached[rank]
        marks = self._marks.get(rank)
        if marks is not None:
            _discard(marks.attached, block_hash, request.rid)

    def _start_matching(self, rank: int, request: _Request) -> int:
        """Walk the present blocks along the request's pages: attach at the deepest page when
        all match, else wait on the next page. Returns the number of pages matched."""
        size = self._blocks.page_size(rank)
        if request.token_ids is None or size is None or rank in request.progress:
            return 0
        total = request.length // size
        deepest: BlockKey | None = None
        matched = 0
        while matched < total:
            child = self._blocks.child(rank, request.after(deepest), _page(request, size, matched))
            if child is None:
                break
            deepest = child
            matched += 1
        self._set_progress(rank, request, size, deepest, matched)
        return matched

    def _advance(
        self,
        rank: int,
        marks: _RankMarks,
        request: _Request,
        block_hash: BlockKey,
    ) -> None:
        deepest, matched = request.progress[rank]
        if deepest is not None:
            _discard(marks.matching, deepest, request.rid)
        size = self._blocks.page_size(rank)
        assert size is not None, "a request matches only where the page size is known"
        self._set_progress(rank, request, size, block_hash, matched + 1)

    def _set_progress(
        self, rank: int, request: _Request, size: int, deepest: BlockKey | None, matched: int
    ) -> None:
        assert request.token_ids is not None
        request.progress[rank] = (deepest, matched)
        if matched == request.length // size:
            if deepest is not None:
                self._attach(rank, request, deepest)
            return
        marks = self._marks_of(rank)
        if deepest is not None:
            marks.matching.setdefault(deepest, set()).add(request.rid)
        key = (request.after(deepest), _page(request, size, matched))
        marks.pending.setdefault(key, set()).add(request.rid)

    def _stop_matching(self, rank: int, request: _Request) -> None:
        """Forget the request's token-match progress on ``rank`` (pending key, marks)."""
        progress = request.progress.pop(rank, None)
        size = self._blocks.page_size(rank)
        if progress is None or size is None or request.token_ids is None:
            return
        deepest, matched = progress
        if matched >= request.length // size:
            return
        marks = self._marks.get(rank)
        if marks is None:
            return
        if deepest is not None:
            _discard(marks.matching, deepest, request.rid)
        waiting = (request.after(deepest), _page(request, size, matched))
        _discard(marks.pending, waiting, request.rid)

    def _drop(self, request: _Request) -> None:
        """Remove every trace of ``request`` (attachments, pending matches, the record)."""
        for rank, hashes in list(request.attached.items()):
            for block_hash in list(hashes):
                self._detach(rank, request, block_hash)
        for rank in list(request.progress):
            self._stop_matching(rank, request)
        self._requests.pop(request.rid)


def _page(request: _Request, size: int, index: int) -> PageKey:
    assert request.token_ids is not None
    return packed_page(request.token_ids, size, index)


def _discard(table: dict[Any, set[str]], key: Any, rid: str) -> None:
    """Remove ``rid`` from ``table[key]``, and the key once its set is empty."""
    rids = table.get(key)
    if rids is not None:
        rids.discard(rid)
        if not rids:
            del table[key]
