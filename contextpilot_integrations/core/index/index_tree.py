"""The radix tree under the context index: its nodes, the surgery that keeps it compressed, and
the read-only walks over it.

A node holds a run of block ids (its edge) and the tokens of each; the path from the root to a
node is a prefix every context below it starts with; a node records the request ids (``rid``)
whose context ends there. The tree is kept compressed: a node with no blocks never exists, and
a node with one child and no request of its own is merged into that child (:meth:`IndexTree.
prune`). Node ids start at 1 and are never reused, not even after :meth:`IndexTree.clear`.

:class:`~contextpilot_integrations.core.index.context_index.ContextIndex` owns one tree and keys
requests to its nodes; it holds its lock around every call here (nothing here is thread-safe
by itself).

Public API: :class:`IndexNode`, :class:`IndexTree`, :func:`path_of`, :func:`common_prefix`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["IndexNode", "IndexTree", "common_prefix", "path_of"]


class IndexNode:
    """One node: its id, edge blocks and their tokens, parent (None: the root), children by
    first block, the rids ending here, and its access count and last access time."""

    __slots__ = (
        "access_count",
        "blocks",
        "children",
        "last_access",
        "node_id",
        "parent",
        "rids",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        blocks: tuple[int, ...],
        tokens: tuple[int, ...],
        parent: IndexNode | None,
    ) -> None:
        self.node_id = node_id
        self.blocks = blocks
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, IndexNode] = {}
        self.rids: set[str] = set()
        self.access_count = 0
        self.last_access = 0.0


class IndexTree:
    """The nodes of one index: ``root`` (id 0, no blocks), ``nodes`` by id (root included) and
    ``tokens``, the edge tokens of every node (what the prefix cache would hold)."""

    __slots__ = ("_node_ids", "nodes", "root", "tokens")

    def __init__(self) -> None:
        self._node_ids = itertools.count(1)
        self.root = IndexNode(0, (), (), None)
        self.nodes: dict[int, IndexNode] = {0: self.root}
        self.tokens = 0

    # ------------------------------------------------------------------ Public API: surgery
    def clear(self) -> None:
        """Drop every node but a new root; later node ids go on from the last one."""
        self.root = IndexNode(0, (), (), None)
        self.nodes = {0: self.root}
        self.tokens = 0

    def add_leaf(
        self, blocks: tuple[int, ...], tokens: tuple[int, ...], parent: IndexNode
    ) -> IndexNode:
        """A new node with edge ``blocks`` under ``parent`` (whose children must not already
        start with ``blocks[0]``)."""
        node = IndexNode(next(self._node_ids), blocks, tokens, parent)
        parent.children[blocks[0]] = node
        self.nodes[node.node_id] = node
        self.tokens += sum(tokens)
        return node

    def split(self, child: IndexNode, at: int) -> IndexNode:
        """Give ``child.blocks[:at]`` its own node between ``child`` and its parent; returns
        that node (it inherits ``child``'s access count and time)."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.blocks)
        head = IndexNode(next(self._node_ids), child.blocks[:at], child.tokens[:at], parent)
        head.access_count = child.access_count
        head.last_access = child.last_access
        parent.children[head.blocks[0]] = head
        self.nodes[head.node_id] = head
        child.blocks = child.blocks[at:]
        child.tokens = child.tokens[at:]
        child.parent = head
        head.children[child.blocks[0]] = child
        return head

    def prune(self, node: IndexNode) -> IndexNode | None:
        """Remove ``node`` and then its ancestors while they hold no request and no child;
        merge the first one kept into its only child when it holds no request (``O(height)``).

        Returns:
            The node the merge kept, which now ends the merged child's rids (the caller
            repoints them), or None when nothing was merged.
        """
        while node is not self.root and not node.rids and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.blocks[0]]
            del self.nodes[node.node_id]
            self.tokens -= sum(node.tokens)
            node = parent
        if node is not self.root and not node.rids and len(node.children) == 1:
            self._merge_with_child(node)
            return node
        return None

    # ------------------------------------------------------------------ Public API: walks
    def best_prefix(
        self, weight: Mapping[int, int], budget: int
    ) -> tuple[int, tuple[int, ...], tuple[int, ...], bool]:
        """The search of :meth:`ContextIndex.search
        <contextpilot_integrations.core.index.context_index.ContextIndex.search>` (at most
        ``budget`` nodes expanded; ``weight``: block -> tokens of the request's blocks, in the
        request's order).

        Returns:
            ``(tokens matched, prefix block ids, path of node ids, whether the match ends
            inside an edge)``. Read-only.
        """
        # A walk that expands every node it reaches finds the same best match whatever order it
        # takes the children in (the key orders matches totally); only a walk the budget cuts
        # short depends on that order. So the walk takes them as the set intersection gives
        # them, and again in the budget's order only when the budget ran out first (rare: a
        # request reaching more nodes than the budget; docs/DESIGN.md, "Hot path").
        found = self._best_match(weight, budget, ordered=False)
        if found is None:
            found = self._best_match(weight, budget, ordered=True)
            assert found is not None  # the walk in the budget's order always answers
        matched, best_node, best_length = found
        if best_node is None:
            return 0, (), (), False
        # The nodes from the root's child down to the best one, by parent links.
        chain: list[IndexNode] = []
        current: IndexNode = best_node
        while current.parent is not None:
            chain.append(current)
            current = current.parent
        chain.reverse()
        prefix: list[int] = []
        for above in chain[:-1]:
            prefix += above.blocks
        prefix += best_node.blocks[:best_length]
        return (
            matched,
            tuple(prefix),
            tuple([n.node_id for n in chain]),
            best_length < len(best_node.blocks),
        )

    def prefix_in_order(self, blocks: Sequence[int], tokens: Sequence[int]) -> tuple[int, int]:
        """``(blocks, tokens)`` of the longest prefix of ``blocks``, in exactly this order, that
        the tree holds (``tokens``: per block, same length). ``O(len(blocks))``, read-only."""
        node, gained, i = self.root, 0, 0
        while i < len(blocks):
            child = node.children.get(blocks[i])
            if child is None:
                break
            for edge_block in child.blocks:
                if i >= len(blocks) or blocks[i] != edge_block:
                    return i, gained
                gained += tokens[i]
                i += 1
            node = child
        return i, gained

    @staticmethod
    def shared_prefix(node: IndexNode) -> tuple[int, int]:
        """``(blocks, tokens)`` of the longest prefix of the context ending at ``node`` that
        another context also starts with.

        In the compressed tree the node is shared when another request ends there or goes on
        below it; otherwise its parent is the deepest shared node (a node with fewer than two
        branches and no request of its own does not exist). ``O(height)``.
        """
        current: IndexNode | None = node
        if current is not None and len(current.rids) < 2 and not current.children:
            current = current.parent
        blocks = tokens = 0
        while current is not None and current.parent is not None:
            blocks += len(current.blocks)
            tokens += sum(current.tokens)
            current = current.parent
        return blocks, tokens

    # ------------------------------------------------------------------ internals
    def _best_match(
        self, weight: Mapping[int, int], budget: int, *, ordered: bool
    ) -> tuple[int, IndexNode | None, int] | None:
        """The best match of :meth:`best_prefix`: ``(tokens, the node it ends in, how far into
        that node's edge)``. ``ordered``: the children of a node are taken in the budget's
        order (below); otherwise in any order, and ``None`` when the budget ran out before the
        walk did."""
        # The best match so far: its key, the node it ends in and how far into that node's edge.
        best_key: tuple[int, bool, float, int] = (0, False, 0.0, 0)
        best_node: IndexNode | None = None
        best_length = 0
        get, requested, size = weight.get, weight.keys(), len(weight)
        # Every path holds a block at most once (a context repeats none), so a child never
        # starts with, nor an edge holds, a block of the prefix above it: only ``weight`` is
        # read. Only a child whose first block (its key) the request holds matches anything,
        # found in one set intersection when its parent is reached. Each node expanded costs
        # one unit of the budget: a walk in any order counts a node when it reaches it and
        # expands only those with such children; the ordered walk counts it when it expands
        # it. Stack entries: a node's children, the keys the request holds among them, and the
        # blocks and tokens of the node's prefix.
        children = self.root.children
        stack = [(children, children.keys() & requested, 0, 0)]
        if not ordered:
            budget -= 1  # the root
        while stack:
            children, entered, depth, gained = stack.pop()
            candidates: Iterable[int] = entered
            if ordered:
                if budget == 0:
                    break
                budget -= 1
                # The budget's order: the children's own, or the request's when it has fewer
                # blocks left.
                if len(entered) < 2:
                    pass
                elif len(children) <= size - depth:
                    candidates = [first for first in children if first in entered]
                else:
                    candidates = [first for first in weight if first in entered]
            for first in candidates:
                child = children[first]
                edge = child.blocks
                length = 0
                gain = gained
                for edge_block in edge:
                    w = get(edge_block)
                    if w is None:
                        break
                    length += 1
                    gain += w
                full = length == len(edge)
                if gain >= best_key[0]:
                    key = (gain, full, child.last_access, -child.node_id)
                    if key > best_key:
                        best_key, best_node, best_length = key, child, length
                if full and child.children:
                    below = child.children
                    inner = below.keys() & requested
                    if ordered:
                        stack.append((below, inner, depth + length, gain))
                        continue
                    budget -= 1
                    if budget < 0:
                        return None
                    if inner:
                        stack.append((below, inner, depth + length, gain))
        return best_key[0], best_node, best_length

    def _merge_with_child(self, node: IndexNode) -> None:
        """Fold ``node``'s only child into it, keeping the compressed-tree invariant."""
        (child,) = node.children.values()
        node.blocks += child.blocks
        node.tokens += child.tokens
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        node.rids = child.rids
        node.access_count = max(node.access_count, child.access_count)
        node.last_access = max(node.last_access, child.last_access)
        del self.nodes[child.node_id]


def common_prefix(edge: tuple[int, ...], seq: tuple[int, ...], start: int) -> int:
    """How many leading blocks of ``edge`` equal ``seq[start:]``'s."""
    limit = min(len(edge), len(seq) - start)
    n = 0
    while n < limit and edge[n] == seq[start + n]:
        n += 1
    return n


def path_of(node: IndexNode) -> tuple[int, ...]:
    """Node ids from the root's child down to ``node``."""
    path: list[int] = []
    current: IndexNode | None = node
    while current is not None and current.parent is not None:
        path.append(current.node_id)
        current = current.parent
    return tuple(reversed(path))
