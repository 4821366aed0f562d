"""The present blocks of one rank's cache as a tree: parent links, orphans, leaves, walks.

Every present block is linked to its present parent (a block whose parent is not present, for
instance removed while its children stay, is an *orphan*, adopted again if the parent is stored
again), whether or not its tokens are known, so that removing a block finds all its present
descendants: every block that names it as parent, and theirs. The links never form a cycle (the
mirror refuses an event naming one of its own blocks as parent; a child whose link would close
a cycle is kept waiting beside its parent instead: not a child for the LRU, still broken when
the parent goes), and walks keep a visited set all the same: a walk visits each block at most
once, so it is bounded by the rank's block count. The leaves (blocks without present children)
are kept least recently stored first, for the mirror's bound.

:class:`~contextpilot_integrations.sync.block_mirror.BlockMirror` holds one
:class:`RankBlocks` per rank and applies events to it; nothing here is thread-safe by itself.

Public API: :class:`Block`, :class:`RankBlocks`, :data:`Children`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator

from contextpilot_integrations.sync.block_namespaces import (
    BlockKey,
    Namespace,
    TokenParent,
    root_key,
)
from contextpilot_integrations.sync.kv_events import BlockHash
from contextpilot_integrations.sync.page_tokens import PageKey

__all__ = ["Block", "Children", "RankBlocks"]

logger = logging.getLogger(__name__)

Children = BlockKey | set[BlockKey] | None
"""The present children of a block: None, the one child's hash (most blocks continue a single
chain: no container at all), or a set of two or more."""


def _with_child(children: Children, child: BlockKey) -> Children:
    if children is None or children == child:
        return child
    if isinstance(children, set):
        children.add(child)
        return children
    return {children, child}


def _without_child(children: Children, child: BlockKey) -> Children:
    if isinstance(children, set):
        children.discard(child)
        if len(children) == 1:
            return next(iter(children))
        return children or None
    return None if children == child else children


def _has_child(children: Children, child: BlockKey) -> bool:
    if isinstance(children, set):
        return child in children
    return children is not None and children == child


def _each_child(children: Children) -> Iterator[BlockKey]:
    if isinstance(children, set):
        yield from children
    elif children is not None:
        yield children


class Block:
    """One present block: its parent's key (None: the root), its page's token ids (None when
    the event did not carry them page by page), the session id it was stored with, the media
    holding it, its present children (:data:`Children`) and its namespace (None: default)."""

    __slots__ = ("parent", "tokens", "session_id", "media", "children", "namespace")

    def __init__(
        self,
        parent: BlockKey | None,
        tokens: PageKey | None,
        session_id: str | None,
        media: frozenset[str],
        namespace: Namespace | None = None,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.session_id = session_id
        self.media = media
        self.children: Children = None
        self.namespace = namespace

    @property
    def token_parent(self) -> TokenParent:
        """What the token index keys this block's page under."""
        return self.parent if self.parent is not None else root_key(self.namespace)


class RankBlocks:
    """The mirrored cache of one data-parallel rank: its present blocks, their token index,
    orphans, leaves and the namespaced keys of each hash (the mirror reads and fills these
    fields; :meth:`link` and :meth:`drop` keep the links, orphans and leaves consistent)."""

    __slots__ = ("blocks", "tokens", "orphans", "leaves", "page_size", "namespaced")

    def __init__(self, page_size: int | None) -> None:
        self.blocks: dict[BlockKey, Block] = {}
        # (parent key or namespace root, page key) -> key, for present blocks with known tokens.
        self.tokens: dict[tuple[TokenParent, PageKey], BlockKey] = {}
        # absent parent key -> its present children (linked if the parent is stored again);
        # also present parent -> children whose link would have closed a cycle.
        self.orphans: dict[BlockKey, Children] = {}
        # present blocks without present children, least recently stored first.
        self.leaves: OrderedDict[BlockKey, None] = OrderedDict()
        self.page_size = page_size
        # hash -> its keys in namespaces other than the default (removals name hashes only).
        self.namespaced: dict[BlockHash, dict[BlockKey, None]] = {}

    def link(self, block_hash: BlockKey, block: Block) -> int:
        """Link a new block (already in :attr:`blocks`) to its parent (or as an orphan of an
        absent one) and adopt the orphans waiting for it; it is a leaf unless it adopted a
        child. Returns how many links were refused because they would have closed a cycle."""
        parent = block.parent
        if parent is not None:
            parent_block = self.blocks.get(parent)
            if parent_block is not None:
                parent_block.children = _with_child(parent_block.children, block_hash)
                self.leaves.pop(parent, None)
            else:
                self.orphans[parent] = _with_child(self.orphans.get(parent), block_hash)
        cycles_refused = 0
        waiting = self.orphans.pop(block_hash, None)
        if waiting is not None:
            ancestors = self.ancestors(block)
            refused: Children = None
            for child in list(_each_child(waiting)):
                if child in ancestors or child == block_hash:
                    # Linking it would close a cycle: it waits here instead (not a child for
                    # the LRU, still broken when this block goes).
                    refused = _with_child(refused, child)
                    cycles_refused += 1
                    logger.debug("not linking block %r under %r: a cycle", child, block_hash)
                else:
                    block.children = _with_child(block.children, child)
            if refused is not None:
                self.orphans[block_hash] = refused
        if block.children is None:
            self.leaves[block_hash] = None
        return cycles_refused

    def ancestors(self, block: Block) -> set[BlockKey]:
        """The present ancestors of ``block`` (bounded by the rank's blocks, cycle-safe)."""
        found: set[BlockKey] = set()
        parent = block.parent
        while parent is not None and parent not in found:
            above = self.blocks.get(parent)
            if above is None:
                break
            found.add(parent)
            parent = above.parent
        return found

    def drop(
        self, block_hash: BlockKey, block: Block, walked: set[BlockKey] | None = None
    ) -> list[BlockKey]:
        """Remove a present block; its children become orphans. Returns it and its present
        descendants (those not in ``walked``, which is updated)."""
        broken = self.subtree(block_hash, block, set() if walked is None else walked)
        del self.blocks[block_hash]
        self.leaves.pop(block_hash, None)
        if isinstance(block_hash, tuple):
            raw = block_hash[1]
            others = self.namespaced.get(raw)
            if others is not None:
                others.pop(block_hash, None)
                if not others:
                    del self.namespaced[raw]
        if block.tokens is not None:
            key = (block.token_parent, block.tokens)
            if self.tokens.get(key) == block_hash:
                del self.tokens[key]
        parent = block.parent
        if parent is not None:
            parent_block = self.blocks.get(parent)
            if parent_block is not None and _has_child(parent_block.children, block_hash):
                parent_block.children = _without_child(parent_block.children, block_hash)
                if parent_block.children is None:
                    self.leaves[parent] = None  # a leaf again, as if just used
            else:
                siblings = _without_child(self.orphans.get(parent), block_hash)
                if siblings is None:
                    self.orphans.pop(parent, None)
                else:
                    self.orphans[parent] = siblings
        orphans = block.children
        for waiting in _each_child(self.orphans.get(block_hash)):
            orphans = _with_child(orphans, waiting)
        if orphans is not None:
            self.orphans[block_hash] = orphans
        return broken

    def subtree(self, root: BlockKey, block: Block, seen: set[BlockKey]) -> list[BlockKey]:
        """``root`` and its present descendants (the blocks that name it as parent, theirs,
        ..., tokens known or not) not in ``seen``, each once; adds them to ``seen``."""
        seen.add(root)
        waiting = self.orphans  # refused links wait here, keyed by their present parent
        if block.children is None and root not in waiting:  # a leaf: the common case
            return [root]
        found = [root]
        stack = [*_each_child(block.children), *_each_child(waiting.get(root))]
        while stack:
            block_hash = stack.pop()
            if block_hash in seen:
                continue
            seen.add(block_hash)
            below = self.blocks.get(block_hash)
            if below is None:
                continue
            found.append(block_hash)
            stack.extend(_each_child(below.children))
            stack.extend(_each_child(waiting.get(block_hash)))
        return found

    def clear(self) -> None:
        """Forget every block; the page size stays known."""
        self.blocks.clear()
        self.tokens.clear()
        self.orphans.clear()
        self.leaves.clear()
        self.namespaced.clear()
