"""The blocks an engine's KV prefix cache holds, per data-parallel rank, rebuilt from its events.

Per rank (each data-parallel rank has its own cache) the mirror holds every block the engine
reported stored (``BlockStored``) and not yet removed from every medium (``BlockRemoved``), as
``hash -> Block(parent hash, page tokens, session id, media, present children)``, and a token
index ``(parent hash, page tokens) -> hash`` of the present blocks whose tokens are known, which
token matching walks (:mod:`~contextpilot_integrations.sync.request_attribution`). Hashes are
the engine's own (``BlockStored.block_hashes``), never recomputed (DESIGN.md invariant 4); the
caller passes them in canonical form
(:func:`~contextpilot_integrations.sync.kv_events.canonical_block_hash`).

Namespaces (tenants and adapters, DESIGN.md invariant 8): an engine keeps the prefixes of
requests with different ``cache_salt`` or LoRA adapter apart, so the mirror does too. A block
is keyed by ``(namespace, hash)`` (:func:`block_key`; the plain hash in the default namespace,
no salt and no adapter), the token index by ``(namespace's root or parent, page tokens)``, so a
request registered in one namespace never matches a chain stored in another
(:mod:`~contextpilot_integrations.sync.request_attribution`), even where the engine publishes
the same hash for both (SGLang's hashes need not include the salt). A ``BlockStored`` names its
namespace by ``cache_salt`` (SGLang 0.5.18+), ``lora_name`` (or an old vLLM's ``lora_id``) and
vLLM's ``extra_keys`` (:func:`event_namespace`); a store that names none continues its parent's
(vLLM puts the salt on a request's first block only). ``BlockRemoved`` carries no namespace: it
removes the hash from every namespace holding it (exact where the engine's hashes are already
namespaced, conservative where they are not).

A block counts as present while it is held in any medium (GPU, host memory, disk): a GPU
eviction that keeps a host copy removes nothing.

Every present block is linked to its present parent (a block whose parent is not present, for
instance removed while its children stay, is an *orphan*, adopted again if the parent is stored
again), whether or not its tokens are known, so that removing a block finds all its present
descendants: every block that names it as parent, and theirs. The links never form a cycle (an
event naming one of its own blocks as parent is refused; a child whose link would close a cycle
is kept waiting beside its parent instead: not a child for the LRU, still broken when the parent
goes), and walks keep a visited set all the same: a walk visits each block at most once, so it
is bounded by the rank's block count.

Bound (DESIGN.md invariant 6): at most ``max_blocks`` blocks per rank. Beyond it the least
recently stored *leaf* goes first (a block none of whose children is present; storing a block
again, e.g. in another medium, counts as a use), as the engines' own LRU evicts leaves first:
the caller treats it as a removal, so requests attached there are evicted (conservative: less
believed reuse, never wrong reuse). Engines emit nothing on a cache hit, so the order is that
of stores; the bound is meant to sit above the engine's real cache and to act only when
removals were lost or the input is hostile.

Memory: page tokens are kept as packed 8-byte ints (``bytes``) rather than tuples of Python
ints, a chain's links need no container, and media sets are shared: 728 MiB of RSS for 1M
blocks of 16 tokens with 100,000 attributed requests (1,228 MiB before), and flat at about
200 MiB under a 100,000-block bound while 1M stores go in
(``benchmarks/bench_mirror_memory.py``).

The mirror knows nothing of requests: :class:`~contextpilot_integrations.sync.cache_mirror.
CacheMirror` applies each event here, then tells the attribution what changed (the pages
stored, the blocks whose removal breaks a cached prefix). Not thread-safe by itself: the
``CacheMirror`` lock is held around every call.

Public API: :class:`BlockMirror`, :class:`Block`, :class:`Chain`, :class:`Namespace`,
:data:`BlockKey`, :data:`StoredPage`, :data:`PageKey`, :func:`block_key`, :func:`root_key`,
:func:`namespace_of`, :func:`event_namespace`, :func:`pack_tokens`, :func:`packed_page`,
:func:`packed_length`, :func:`page_tokens`, :data:`DEFAULT_MAX_BLOCKS`.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from contextpilot_integrations.sync.kv_events import MEDIUM_GPU, BlockHash, BlockStored

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "Block",
    "BlockKey",
    "BlockMirror",
    "Chain",
    "Namespace",
    "PackedTokens",
    "PageKey",
    "StoredPage",
    "block_key",
    "event_namespace",
    "namespace_of",
    "pack_tokens",
    "packed_length",
    "packed_page",
    "page_tokens",
    "root_key",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000
"""Blocks kept per rank by default. A GPU's cache holds far fewer pages of 16 tokens (an 80 GB
card serving an 8B model: about 30,000; a 1B model: about 120,000); SGLang at page size 1 counts
one block per token (about 2M tokens for a 1B model on an 80 GB card: raise the bound there).
About 0.7 GB of RSS at the bound with pages of 16 tokens."""

PageKey = bytes | tuple[Any, ...]
"""The token ids of one page as a lookup key: packed as 8-byte signed ints (:func:`pack_tokens`)
when every id is an int that fits, else a tuple (SGLang's EAGLE pages publish ``(id, next)``
pairs). The same ids always give the same key."""

PackedTokens = bytes | tuple[Any, ...]
"""A request's or an event's token ids, packed as :func:`pack_tokens` does."""

_INT_WIDTH = array("q").itemsize


def pack_tokens(token_ids: Sequence[Any]) -> PackedTokens:
    """``token_ids`` as 8-byte ints (``bytes``), or as a tuple when one is not an int that fits
    (EAGLE pairs stay tuples, other ids become ints).

    Raises:
        TypeError, ValueError: an id that is neither an int-like nor a tuple of int-likes.
    """
    try:
        return array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        return tuple(
            tuple(int(i) for i in t) if isinstance(t, tuple) else int(t) for t in token_ids
        )


def packed_length(packed: PackedTokens) -> int:
    """The number of token ids in ``packed``."""
    return len(packed) // _INT_WIDTH if isinstance(packed, bytes) else len(packed)


def packed_page(packed: PackedTokens, size: int, index: int) -> PageKey:
    """The key of page ``index`` (``size`` tokens each) of ``packed``."""
    if isinstance(packed, bytes):
        width = size * _INT_WIDTH
        return packed[index * width : (index + 1) * width]
    page = packed[index * size : (index + 1) * size]
    try:
        return array("q", page).tobytes()  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        return page


def page_tokens(key: PageKey) -> list[Any]:
    """The token ids of a page key, as a list."""
    if isinstance(key, bytes):
        return array("q", key).tolist()
    return list(key)


class Namespace(NamedTuple):
    """Where cached blocks may be shared: requests share a cached prefix only within one
    namespace (the engines key their prefix caches the same way).

    Attributes:
        cache_salt: the tenant's ``cache_salt``, or None.
        adapter: the LoRA adapter's name (an event with only ``lora_id`` gives
            ``"lora-id:<id>"``, which no named request matches), or None.
        opaque: the chain's hash depends on more than tokens, salt and adapter (vLLM extra keys
            of images or prompt embeddings): no registered request's tokens match it.
    """

    cache_salt: str | None
    adapter: str | None
    opaque: bool = False


BlockKey = BlockHash | tuple[Namespace, BlockHash]
"""A block in the mirror: its hash in the default namespace, ``(namespace, hash)`` in another."""

TokenParent = BlockKey | tuple[Namespace, None] | None
"""What the token index keys a page under: its parent block, or its namespace's root."""

_AMBIGUOUS = Namespace(None, None, opaque=True)


def namespace_of(cache_salt: str | None = None, adapter: str | None = None) -> Namespace | None:
    """The namespace of a request with this salt and LoRA adapter name; None: the default."""
    if cache_salt is None and adapter is None:
        return None
    return Namespace(cache_salt, adapter)


def block_key(namespace: Namespace | None, block_hash: BlockHash) -> BlockKey:
    """How the mirror keys ``block_hash`` (canonical form) in ``namespace``."""
    return block_hash if namespace is None else (namespace, block_hash)


def root_key(namespace: Namespace | None) -> TokenParent:
    """What the token index keys a namespace's first pages under (None: the default's)."""
    return None if namespace is None else (namespace, None)


def event_namespace(event: BlockStored) -> Namespace | None:
    """The namespace a ``BlockStored`` names, or None when it names none (what it does not
    name continues its parent's: :meth:`BlockMirror.chain`).

    ``cache_salt`` is SGLang's field; vLLM puts the salt among the first block's
    ``extra_keys``, after the LoRA name: a lone string there is taken as the salt; any other
    extra key (an image's ``(identifier, offset)``, a digest) makes the namespace opaque.
    """
    name = event.lora_name
    adapter = name
    if adapter is None and event.lora_id is not None:
        adapter = f"lora-id:{event.lora_id}"
    salt = event.cache_salt
    opaque = False
    for extras in event.extra_keys or ():
        rest = list(extras or ())
        if name is not None and rest and rest[0] == name:
            rest = rest[1:]
        if not rest:
            continue
        if len(rest) == 1 and isinstance(rest[0], str) and salt in (None, rest[0]):
            salt = rest[0]
        else:
            opaque = True
    if salt is None and adapter is None and not opaque:
        return None
    return Namespace(salt, adapter, opaque)


def _inherit(own: Namespace | None, parent: Namespace | None) -> Namespace | None:
    """``own`` with the parts it does not name taken from ``parent`` (opacity is kept)."""
    if parent is None:
        return own
    if own is None:
        return parent
    return Namespace(
        own.cache_salt if own.cache_salt is not None else parent.cache_salt,
        own.adapter if own.adapter is not None else parent.adapter,
        own.opaque or parent.opaque,
    )


class Chain(NamedTuple):
    """Where a ``BlockStored`` goes: its namespace, its first page's parent key (None: the
    root) and its deepest page's key (None: no pages)."""

    namespace: Namespace | None
    parent: BlockKey | None
    deepest: BlockKey | None


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


StoredPage = tuple[TokenParent, BlockKey, PageKey]
"""A page of a ``BlockStored`` with known tokens: ``(parent it was stored under, or its
namespace's root; its key; its page key)`` (a plain tuple: one is made per stored page, on the
event path)."""


class _Rank:
    """The mirrored cache of one data-parallel rank."""

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
        self._ranks: dict[int, _Rank] = {}
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
        namespace = _inherit(own, self._parent_namespace(state, parent, own))
        hashes = event.block_hashes
        return Chain(
            namespace,
            block_key(namespace, parent) if parent is not None else None,
            block_key(namespace, hashes[-1]) if hashes else None,
        )

    @staticmethod
    def _parent_namespace(
        state: _Rank, parent: BlockHash | None, own: Namespace | None
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
            return _AMBIGUOUS
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
                self._link(state, key, block)
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
                broken.extend(self._drop(state, key, block, walked))
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
        return self._drop(state, victim, state.blocks[victim])

    def clear(self, rank: int) -> None:
        """Forget every block of ``rank`` (``AllBlocksCleared``, or a resync); the page size
        stays known."""
        state = self._ranks[rank]
        state.blocks.clear()
        state.tokens.clear()
        state.orphans.clear()
        state.leaves.clear()
        state.namespaced.clear()

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

    def _link(self, state: _Rank, block_hash: BlockKey, block: Block) -> None:
        """Link a new block to its parent (or as an orphan of an absent one) and adopt the
        orphans waiting for it; it is a leaf unless it adopted a child."""
        parent = block.parent
        if parent is not None:
            parent_block = state.blocks.get(parent)
            if parent_block is not None:
                parent_block.children = _with_child(parent_block.children, block_hash)
                state.leaves.pop(parent, None)
            else:
                state.orphans[parent] = _with_child(state.orphans.get(parent), block_hash)
        waiting = state.orphans.pop(block_hash, None)
        if waiting is not None:
            ancestors = self._ancestors(state, block)
            refused: Children = None
            for child in list(_each_child(waiting)):
                if child in ancestors or child == block_hash:
                    # Linking it would close a cycle: it waits here instead (not a child for
                    # the LRU, still broken when this block goes).
                    refused = _with_child(refused, child)
                    self._counters["cycles_refused"] += 1
                    logger.debug("not linking block %r under %r: a cycle", child, block_hash)
                else:
                    block.children = _with_child(block.children, child)
            if refused is not None:
                state.orphans[block_hash] = refused
        if block.children is None:
            state.leaves[block_hash] = None

    @staticmethod
    def _ancestors(state: _Rank, block: Block) -> set[BlockKey]:
        """The present ancestors of ``block`` (bounded by the rank's blocks, cycle-safe)."""
        found: set[BlockKey] = set()
        parent = block.parent
        while parent is not None and parent not in found:
            above = state.blocks.get(parent)
            if above is None:
                break
            found.add(parent)
            parent = above.parent
        return found

    def _drop(
        self,
        state: _Rank,
        block_hash: BlockKey,
        block: Block,
        walked: set[BlockKey] | None = None,
    ) -> list[BlockKey]:
        """Remove a present block; its children become orphans. Returns it and its present
        descendants (those not in ``walked``)."""
        broken = self._subtree(state, block_hash, block, set() if walked is None else walked)
        del state.blocks[block_hash]
        state.leaves.pop(block_hash, None)
        if isinstance(block_hash, tuple):
            raw = block_hash[1]
            others = state.namespaced.get(raw)
            if others is not None:
                others.pop(block_hash, None)
                if not others:
                    del state.namespaced[raw]
        if block.tokens is not None:
            key = (block.token_parent, block.tokens)
            if state.tokens.get(key) == block_hash:
                del state.tokens[key]
        parent = block.parent
        if parent is not None:
            parent_block = state.blocks.get(parent)
            if parent_block is not None and _has_child(parent_block.children, block_hash):
                parent_block.children = _without_child(parent_block.children, block_hash)
                if parent_block.children is None:
                    state.leaves[parent] = None  # a leaf again, as if just used
            else:
                siblings = _without_child(state.orphans.get(parent), block_hash)
                if siblings is None:
                    state.orphans.pop(parent, None)
                else:
                    state.orphans[parent] = siblings
        orphans = block.children
        for waiting in _each_child(state.orphans.get(block_hash)):
            orphans = _with_child(orphans, waiting)
        if orphans is not None:
            state.orphans[block_hash] = orphans
        return broken

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

    @staticmethod
    def _subtree(state: _Rank, root: BlockKey, block: Block, seen: set[BlockKey]) -> list[BlockKey]:
        """``root`` and its present descendants (the blocks that name it as parent, theirs,
        ..., tokens known or not) not in ``seen``, each once; adds them to ``seen``."""
        seen.add(root)
        waiting = state.orphans  # refused links wait here, keyed by their present parent
        if block.children is None and root not in waiting:  # a leaf: the common case
            return [root]
        found = [root]
        stack = [*_each_child(block.children), *_each_child(waiting.get(root))]
        while stack:
            block_hash = stack.pop()
            if block_hash in seen:
                continue
            seen.add(block_hash)
            below = state.blocks.get(block_hash)
            if below is None:
                continue
            found.append(block_hash)
            stack.extend(_each_child(below.children))
            stack.extend(_each_child(waiting.get(block_hash)))
        return found


def _splits_into_pages(event: BlockStored) -> bool:
    """Whether ``event.token_ids`` hold exactly ``block_size`` ids per block."""
    count = len(event.block_hashes)
    return count > 0 and event.block_size > 0 and len(event.token_ids) == event.block_size * count
