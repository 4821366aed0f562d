"""The blocks an engine's KV prefix cache holds, per data-parallel rank, rebuilt from its events.

Per rank the mirror holds every block reported stored (``BlockStored``) and not yet removed from
every medium (``BlockRemoved``), as ``hash -> Block(parent hash, page tokens, session id, media,
present children)``, and a token index ``(parent hash, page tokens) -> hash`` of the present
blocks whose tokens are known, which token matching walks
(:mod:`~contextpilot_integrations.sync.request_attribution`). Hashes are the engine's own, never
recomputed (docs/DESIGN.md, "Engine hashes are read"), passed in canonical form
(:func:`~contextpilot_integrations.sync.kv_events.canonical_block_hash`).

- Namespaces (tenants and adapters, docs/DESIGN.md, "Tenants from credentials"): blocks are
  keyed by namespace and hash, pages by namespace root or parent
  (:mod:`~contextpilot_integrations.sync.block_namespaces`), so a request registered in one
  namespace never matches a chain stored in another; a removal names no namespace and removes
  the hash from every namespace holding it.
- A block is present while it is held in any medium (GPU, host memory, disk). The present
  blocks of a rank form a tree (:mod:`~contextpilot_integrations.sync.block_tree`).
- Bounded (docs/DESIGN.md, "Bounded"): at most ``max_blocks`` blocks per rank; beyond it the
  least recently stored *leaf* goes first, as the engines' own LRU does, and the caller treats
  it as a removal (less believed reuse, never wrong reuse).
- Page tokens are packed 8-byte ints (``bytes``, :mod:`~contextpilot_integrations.sync.
  page_tokens`) and media sets are shared, to keep a million blocks small.

The mirror knows nothing of requests: :class:`~contextpilot_integrations.sync.cache_mirror.
CacheMirror` applies each event here, then tells the attribution what changed. Not thread-safe
by itself: the ``CacheMirror`` lock is held around every call.

Public API: :class:`BlockMirror`, :class:`Chain`, :data:`StoredPage`, :data:`DEFAULT_MAX_BLOCKS`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from contextpilot_integrations.sync.block_namespaces import (
    AMBIGUOUS_NAMESPACE,
    BlockKey,
    Namespace,
    TokenParent,
    block_key,
    event_namespace,
    inherit_namespace,
    root_key,
)
from contextpilot_integrations.sync.block_tree import Block, RankBlocks
from contextpilot_integrations.sync.kv_events import MEDIUM_GPU, BlockHash, BlockStored
from contextpilot_integrations.sync.page_tokens import (
    PageKey,
    pack_tokens,
    packed_page,
)

__all__ = ["DEFAULT_MAX_BLOCKS", "BlockMirror", "Chain", "StoredPage"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000
"""Blocks kept per rank by default. A GPU's cache holds far fewer pages of 16 tokens (an 80 GB
card serving an 8B model: about 30,000; a 1B model: about 120,000); SGLang at page size 1 counts
one block per token (about 2M tokens for a 1B model on an 80 GB card: raise the bound there)."""


class Chain(NamedTuple):
    """Where a ``BlockStored`` goes: its namespace, its first page's parent key (None: the
    root) and its deepest page's key (None: no pages)."""

    namespace: Namespace | None
    parent: BlockKey | None
    deepest: BlockKey | None


StoredPage = tuple[TokenParent, BlockKey, PageKey]
"""A page of a ``BlockStored`` with known tokens: ``(parent it was stored under, or its
namespace's root; its key; its page key)`` (a plain tuple: one is made per stored page, on the
event path)."""


class BlockMirror:
    """The present blocks of each rank.

    Args:
        page_size: tokens per engine page, for every rank; None learns it per rank from the
            first ``BlockStored`` whose ``token_ids`` hold ``block_size`` ids per block.
        max_blocks: blocks kept per rank (see the module docstring); :meth:`over_bound` and
            :meth:`evict_lru` let the caller enforce it.

    Raises:
        ValueError: ``max_blocks`` is not a positive int.

    Counters (:meth:`stats`): ``stored_blocks``, ``removed_blocks`` (gone from every medium),
    ``unknown_removals`` (a removal of a block not present), ``token_mismatch_events`` (a
    store whose token ids do not split into its pages: stored without tokens),
    ``bound_evictions`` (blocks dropped for the bound), ``cycles_refused`` (a link that
    would have closed a cycle, not made).
    """

    def __init__(self, page_size: int | None = None, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be a positive int, got {max_blocks!r}")
        self._page_size = page_size
        self.max_blocks = max_blocks
        self._ranks: dict[int, RankBlocks] = {}
        self._media: dict[frozenset[str], frozenset[str]] = {}
        self._counters = {
            "stored_blocks": 0,
            "removed_blocks": 0,
            "unknown_removals": 0,
            "token_mismatch_events": 0,
            "bound_evictions": 0,
            "cycles_refused": 0,
        }

    # ----------------------------------------------------------------------------------------
    # Public API: reading
    # ----------------------------------------------------------------------------------------

    def ranks(self) -> list[int]:
        """The ranks seen so far, in the order first seen."""
        return list(self._ranks)

    def page_size(self, rank: int) -> int | None:
        """Tokens per page on ``rank`` (None: not known yet, or the rank is unseen)."""
        state = self._ranks.get(rank)
        return state.page_size if state is not None else None

    def child(self, rank: int, parent: TokenParent, tokens: PageKey) -> BlockKey | None:
        """The key of the present block with page key ``tokens`` under ``parent`` (a block's
        key, or a namespace's :func:`root_key`; None: the default root), or None."""
        state = self._ranks.get(rank)
        return state.tokens.get((parent, tokens)) if state is not None else None

    def block(self, rank: int, key: BlockKey) -> Block | None:
        """The present block ``key`` (:func:`block_key`) of ``rank`` (the live object: do not
        change it)."""
        state = self._ranks.get(rank)
        return state.blocks.get(key) if state is not None else None

    def hashes(self, rank: int) -> set[BlockHash]:
        """The hashes of the blocks present on ``rank``, every namespace (a copy)."""
        state = self._ranks.get(rank)
        if state is None:
            return set()
        return {key[1] if isinstance(key, tuple) else key for key in state.blocks}

    def chain(self, rank: int, event: BlockStored) -> Chain:
        """Where :meth:`store` puts ``event`` (hashes in canonical form) on ``rank``, read
        before it: its namespace (:func:`event_namespace`, each part it does not name taken
        from its present parent's namespace: vLLM names the salt on a request's first block
        only) and the keys of its first page's parent and of its deepest page."""
        state = self._ranks[rank]
        parent = event.parent_block_hash
        own = event_namespace(event)
        namespace = inherit_namespace(own, self._parent_namespace(state, parent, own))
        hashes = event.block_hashes
        return Chain(
            namespace,
            block_key(namespace, parent) if parent is not None else None,
            block_key(namespace, hashes[-1]) if hashes else None,
        )

    @staticmethod
    def _parent_namespace(
        state: RankBlocks, parent: BlockHash | None, own: Namespace | None
    ) -> Namespace | None:
        """The namespace of the present block ``parent``: the event's own where it holds the
        parent, else the default's, else the one namespace holding it (opaque when several
        do; the default when none: an orphan)."""
        if parent is None:
            return None
        if own is not None and block_key(own, parent) in state.blocks:
            return own
        if parent in state.blocks:
            return None
        keys = state.namespaced.get(parent)
        if not keys:
            return None
        if len(keys) > 1:
            return AMBIGUOUS_NAMESPACE
        only = next(iter(keys))
        return only[0] if isinstance(only, tuple) else None

    def stats(self) -> dict[str, int]:
        """The counters (see the class docstring), ``blocks`` present and ``ranks`` seen."""
        out = dict(self._counters)
        out["blocks"] = sum(len(state.blocks) for state in self._ranks.values())
        out["ranks"] = len(self._ranks)
        return out

    # ----------------------------------------------------------------------------------------
    # Public API: events (each mutates the mirror of one rank)
    # ----------------------------------------------------------------------------------------

    def add_rank(self, rank: int) -> bool:
        """Start mirroring ``rank`` (empty); False when it is already mirrored."""
        if rank in self._ranks:
            return False
        self._ranks[rank] = RankBlocks(self._page_size)
        return True

    def learn_page_size(self, rank: int, event: BlockStored) -> bool:
        """Take ``rank``'s page size from ``event`` when it is not known yet and the event's
        token ids split into its pages; True when it was learnt from this event."""
        state = self._ranks[rank]
        if state.page_size is not None or not _splits_into_pages(event):
            return False
        state.page_size = event.block_size
        return True

    def store(self, rank: int, event: BlockStored) -> list[StoredPage]:
        """Apply a ``BlockStored`` (hashes in canonical form): its pages become present blocks
        (a block already present gains the event's medium, and its tokens when it had none,
        and counts as just used). May leave the rank above the bound: see :meth:`evict_lru`.

        Returns:
            the event's pages with known tokens, in chain order (none when its token ids do
            not split into ``block_size`` ids per block).

        Raises:
            ValueError: the event names one of its own blocks as parent (nothing is changed).
        """
        if event.parent_block_hash is not None and event.parent_block_hash in event.block_hashes:
            raise ValueError(
                f"BlockStored names its own block {event.parent_block_hash!r} as parent"
            )
        state = self._ranks[rank]
        namespace, parent, _ = self.chain(rank, event)
        root = root_key(namespace)
        pages = self._split_pages(event)
        medium = event.medium or MEDIUM_GPU
        media = self._media_of(frozenset((medium,)))
        stored: list[StoredPage] = []
        for index, block_hash in enumerate(event.block_hashes):
            tokens = pages[index] if pages is not None else None
            key = block_key(namespace, block_hash)
            block = state.blocks.get(key)
            if block is None:
                block = Block(parent, tokens, event.session_id, media, namespace)
                state.blocks[key] = block
                if namespace is not None:
                    state.namespaced.setdefault(block_hash, {})[key] = None
                self._counters["stored_blocks"] += 1
                if tokens is not None:
                    state.tokens[(block.token_parent, tokens)] = key
                self._counters["cycles_refused"] += state.link(key, block)
            else:
                if medium not in block.media:
                    block.media = self._media_of(block.media | {medium})
                if block.tokens is None and tokens is not None:
                    block.tokens = tokens
                    state.tokens[(block.token_parent, tokens)] = key
                if key in state.leaves:
                    state.leaves.move_to_end(key)
            if tokens is not None:
                stored.append((parent if parent is not None else root, key, tokens))
            parent = key
        return stored

    def remove(
        self,
        rank: int,
        block_hash: BlockHash,
        medium: str | None,
        walked: set[BlockKey] | None = None,
    ) -> list[BlockKey]:
        """Apply the removal of one block hash from ``medium`` (None: GPU), in every namespace
        that holds it (a removal names no namespace).

        Args:
            walked: blocks already reported broken by an earlier removal of the same event
                (updated here): their descendants are not walked again, so that an event
                removing a long chain root first costs one walk, not one per block.

        Returns:
            empty when the hash is not present (counted) or still held in another medium;
            otherwise the block is gone and the result is the keys whose cached prefix the
            removal breaks: the block's first, then its present descendants not in
            ``walked`` (usually none: engines evict leaves first), each once.
        """
        state = self._ranks[rank]
        keys: list[BlockKey] = [block_hash] if block_hash in state.blocks else []
        keys.extend(state.namespaced.get(block_hash, ()))
        if not keys:
            self._counters["unknown_removals"] += 1
            return []
        medium = medium or MEDIUM_GPU
        broken: list[BlockKey] = []
        for key in keys:
            block = state.blocks[key]
            if medium in block.media:
                block.media = self._media_of(block.media - {medium})
            if not block.media:
                self._counters["removed_blocks"] += 1
                broken.extend(state.drop(key, block, walked))
        return broken

    def over_bound(self, rank: int) -> bool:
        """Whether ``rank`` holds more than ``max_blocks`` blocks."""
        return len(self._ranks[rank].blocks) > self.max_blocks

    def evict_lru(self, rank: int) -> list[BlockKey]:
        """Drop ``rank``'s least recently stored leaf (counted in ``bound_evictions``); returns
        what it breaks, as :meth:`remove` does (a leaf: itself, and a block waiting beside it
        if a cycle was refused there), empty when the rank is empty."""
        state = self._ranks[rank]
        if state.leaves:
            victim = next(iter(state.leaves))
        elif state.blocks:  # unreachable while the links stay acyclic; never loop on it
            victim = next(iter(state.blocks))
        else:
            return []
        self._counters["bound_evictions"] += 1
        return state.drop(victim, state.blocks[victim])

    def clear(self, rank: int) -> None:
        """Forget every block of ``rank`` (``AllBlocksCleared``, or a resync); the page size
        stays known."""
        self._ranks[rank].clear()

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _media_of(self, media: frozenset[str]) -> frozenset[str]:
        """One shared object per set of media (a handful exist; a hostile stream naming many
        is not interned past 64)."""
        shared = self._media.get(media)
        if shared is not None:
            return shared
        if len(self._media) < 64:
            self._media[media] = media
        return media

    def _split_pages(self, event: BlockStored) -> list[PageKey] | None:
        if not _splits_into_pages(event):
            if event.block_hashes and event.token_ids:
                self._counters["token_mismatch_events"] += 1
                logger.debug(
                    "BlockStored with %d token ids for %d blocks of %d: no token matching",
                    len(event.token_ids),
                    len(event.block_hashes),
                    event.block_size,
                )
            return None
        packed = pack_tokens(event.token_ids)
        size = event.block_size
        return [packed_page(packed, size, index) for index in range(len(event.block_hashes))]


def _splits_into_pages(event: BlockStored) -> bool:
    """Whether ``event.token_ids`` hold exactly ``block_size`` ids per block."""
    count = len(event.block_hashes)
    return count > 0 and event.block_size > 0 and len(event.token_ids) == event.block_size * count
