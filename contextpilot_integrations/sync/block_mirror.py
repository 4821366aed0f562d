"""The blocks an engine's KV prefix cache holds, per data-parallel rank, rebuilt from its events.

Per rank (each data-parallel rank has its own cache) the mirror holds every block the engine
reported stored (``BlockStored``) and not yet removed from every medium (``BlockRemoved``), as
``hash -> Block(parent hash, page token ids, session id, media)``, and an index
``(parent hash, page token ids) -> hash`` of the present blocks whose tokens are known, which
token matching walks (:mod:`~contextpilot_integrations.sync.request_attribution`). Hashes are
the engine's own (``BlockStored.block_hashes``), never recomputed (DESIGN.md invariant 4).

A block counts as present while it is held in any medium (GPU, host memory, disk): a GPU
eviction that keeps a host copy removes nothing.

The mirror knows nothing of requests: :class:`~contextpilot_integrations.sync.cache_mirror.
CacheMirror` applies each event here, then tells the attribution what changed (the pages
stored, the blocks whose removal breaks a cached prefix). Not thread-safe by itself: the
``CacheMirror`` lock is held around every call.

Public API: :class:`BlockMirror`, :class:`Block`, :data:`StoredPage`, :data:`PageKey`.
"""

from __future__ import annotations

import logging
from typing import Any

from contextpilot_integrations.sync.kv_events import MEDIUM_GPU, BlockHash, BlockStored

__all__ = ["Block", "BlockMirror", "PageKey", "StoredPage"]

logger = logging.getLogger(__name__)

PageKey = tuple[Any, ...]
"""The token ids of one page, as a tuple (a token id is an int, or an EAGLE ``(id, next)``)."""


class Block:
    """One present block: its parent (None: the root), its page's token ids (None when the
    event did not carry them page by page), the session id it was stored with, and the media
    holding it."""

    __slots__ = ("parent", "tokens", "session_id", "media")

    def __init__(
        self, parent: BlockHash | None, tokens: PageKey | None, session_id: str | None, medium: str
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.session_id = session_id
        self.media = {medium}


StoredPage = tuple[BlockHash | None, BlockHash, PageKey]
"""A page of a ``BlockStored`` with known tokens: ``(parent it was stored under, its hash, its
token ids)`` (a plain tuple: one is made per stored page, on the event path)."""


class _Rank:
    """The mirrored cache of one data-parallel rank."""

    __slots__ = ("blocks", "children", "page_size")

    def __init__(self, page_size: int | None) -> None:
        self.blocks: dict[BlockHash, Block] = {}
        # parent hash (None: root) -> page tokens -> child hash, for present blocks with tokens.
        # A removed block keeps its entry here while children of it remain present.
        self.children: dict[BlockHash | None, dict[PageKey, BlockHash]] = {}
        self.page_size = page_size


class BlockMirror:
    """The present blocks of each rank.

    Args:
        page_size: tokens per engine page, for every rank; None learns it per rank from the
            first ``BlockStored`` whose ``token_ids`` hold ``block_size`` ids per block.

    Counters (:meth:`stats`): ``stored_blocks``, ``removed_blocks`` (gone from every medium),
    ``unknown_removals`` (a removal of a block not present), ``token_mismatch_events`` (a
    store whose token ids do not split into its pages: stored without tokens).
    """

    def __init__(self, page_size: int | None = None) -> None:
        self._page_size = page_size
        self._ranks: dict[int, _Rank] = {}
        self._counters = {
            "stored_blocks": 0,
            "removed_blocks": 0,
            "unknown_removals": 0,
            "token_mismatch_events": 0,
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

    def child(self, rank: int, parent: BlockHash | None, tokens: PageKey) -> BlockHash | None:
        """The hash of the present block with page ``tokens`` under ``parent`` (None: the
        root), or None."""
        state = self._ranks.get(rank)
        following = state.children.get(parent) if state is not None else None
        return following.get(tokens) if following else None

    def block(self, rank: int, block_hash: BlockHash) -> Block | None:
        """The present block ``block_hash`` of ``rank`` (the live object: do not change it)."""
        state = self._ranks.get(rank)
        return state.blocks.get(block_hash) if state is not None else None

    def hashes(self, rank: int) -> set[BlockHash]:
        """The hashes of the blocks present on ``rank`` (a copy)."""
        state = self._ranks.get(rank)
        return set(state.blocks) if state is not None else set()

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
        self._ranks[rank] = _Rank(self._page_size)
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
        """Apply a ``BlockStored``: its pages become present blocks (a block already present
        gains the event's medium, and its tokens when it had none).

        Returns:
            the event's pages with known tokens, in chain order (none when its token ids do
            not split into ``block_size`` ids per block).
        """
        state = self._ranks[rank]
        pages = self._split_pages(event)
        medium = event.medium or MEDIUM_GPU
        parent = event.parent_block_hash
        stored: list[StoredPage] = []
        for index, block_hash in enumerate(event.block_hashes):
            tokens = pages[index] if pages is not None else None
            block = state.blocks.get(block_hash)
            if block is None:
                state.blocks[block_hash] = Block(parent, tokens, event.session_id, medium)
                self._counters["stored_blocks"] += 1
                if tokens is not None:
                    state.children.setdefault(parent, {})[tokens] = block_hash
            else:
                block.media.add(medium)
                if block.tokens is None and tokens is not None:
                    block.tokens = tokens
                    state.children.setdefault(block.parent, {})[tokens] = block_hash
            if tokens is not None:
                stored.append((parent, block_hash, tokens))
            parent = block_hash
        return stored

    def remove(self, rank: int, block_hash: BlockHash, medium: str | None) -> list[BlockHash]:
        """Apply the removal of one block from ``medium`` (None: GPU).

        Returns:
            empty when the block is not present (counted) or still held in another medium;
            otherwise the block is gone and the result is the hashes whose cached prefix the
            removal breaks: ``block_hash`` first, then its present descendants (usually none:
            engines evict leaves first).
        """
        state = self._ranks[rank]
        block = state.blocks.get(block_hash)
        if block is None:
            self._counters["unknown_removals"] += 1
            return []
        block.media.discard(medium or MEDIUM_GPU)
        if block.media:
            return []
        self._counters["removed_blocks"] += 1
        broken = self._subtree(state, block_hash)
        del state.blocks[block_hash]
        if block.tokens is not None:
            siblings = state.children.get(block.parent)
            if siblings is not None and siblings.get(block.tokens) == block_hash:
                del siblings[block.tokens]
                if not siblings:
                    del state.children[block.parent]
        return broken

    def clear(self, rank: int) -> None:
        """Forget every block of ``rank`` (``AllBlocksCleared``, or a resync); the page size
        stays known."""
        state = self._ranks[rank]
        state.blocks.clear()
        state.children.clear()

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

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
        size, tokens = event.block_size, event.token_ids
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens), size)]

    @staticmethod
    def _subtree(state: _Rank, root: BlockHash) -> list[BlockHash]:
        """``root`` and its present descendants, through the token index (a descendant whose
        tokens are unknown is not indexed, and not found: it matches no request either)."""
        if root not in state.children:  # a leaf: the common case, no walk
            return [root]
        found = [root]
        stack = list(state.children[root].values())
        while stack:
            block_hash = stack.pop()
            if block_hash in state.blocks:
                found.append(block_hash)
            children = state.children.get(block_hash)
            if children:
                stack.extend(children.values())
        return found


def _splits_into_pages(event: BlockStored) -> bool:
    """Whether ``event.token_ids`` hold exactly ``block_size`` ids per block."""
    count = len(event.block_hashes)
    return count > 0 and event.block_size > 0 and len(event.token_ids) == event.block_size * count
