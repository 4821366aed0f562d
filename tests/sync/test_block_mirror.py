"""BlockMirror on its own: what a removal breaks, media, the token index, page sizes; cycles,
descendants without tokens, the block bound."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.sync.block_mirror import BlockMirror
from contextpilot_integrations.sync.kv_events import BlockStored
from contextpilot_integrations.sync.page_tokens import pack_tokens, packed_page, page_tokens


def key(*tokens: object) -> bytes | tuple:
    """The page key of ``tokens``, as the mirror and the attribution build it."""
    return packed_page(pack_tokens(tokens), len(tokens), 0)


def mirror_with(*events: BlockStored, page_size: int | None = None) -> BlockMirror:
    mirror = BlockMirror(page_size)
    mirror.add_rank(0)
    for event in events:
        mirror.learn_page_size(0, event)
        mirror.store(0, event)
    return mirror


def test_store_returns_the_pages_with_tokens_in_chain_order() -> None:
    mirror = BlockMirror()
    assert mirror.add_rank(0) and not mirror.add_rank(0)
    event = BlockStored([1, 2], None, [5, 6, 7, 8], block_size=2)
    assert mirror.page_size(0) is None and mirror.learn_page_size(0, event)
    assert not mirror.learn_page_size(0, event)  # learnt once
    assert mirror.store(0, event) == [(None, 1, key(5, 6)), (1, 2, key(7, 8))]
    assert mirror.page_size(0) == 2 and mirror.child(0, 1, key(7, 8)) == 2
    # Token ids that do not split into the pages: stored, without tokens, and counted.
    assert mirror.store(0, BlockStored([3], 2, [1, 2, 3], block_size=2)) == []
    assert mirror.hashes(0) == {1, 2, 3} and mirror.child(0, 2, key(1, 2)) is None
    assert mirror.stats()["token_mismatch_events"] == 1


def test_a_removal_breaks_the_block_and_its_present_descendants() -> None:
    mirror = mirror_with(
        BlockStored([1, 2, 3], None, [1, 1, 2, 2, 3, 3], block_size=2),
        BlockStored([4], 1, [4, 4], block_size=2),
    )
    assert mirror.remove(0, 3, None) == [3]  # a leaf: only itself
    assert sorted(mirror.remove(0, 1, None)) == [1, 2, 4]  # an inner block: the subtree
    assert mirror.hashes(0) == {2, 4}  # the descendants stay present
    assert mirror.child(0, None, key(1, 1)) is None and mirror.child(0, 1, key(2, 2)) == 2
    assert mirror.remove(0, 99, None) == []
    stats = mirror.stats()
    assert stats["removed_blocks"] == 2 and stats["unknown_removals"] == 1


def test_a_block_stays_while_any_medium_holds_it() -> None:
    mirror = mirror_with(
        BlockStored([1], None, [1, 1], block_size=2),
        BlockStored([1], None, [1, 1], block_size=2, medium="CPU"),
    )
    block = mirror.block(0, 1)
    assert block is not None and block.media == {"GPU", "CPU"}
    assert mirror.remove(0, 1, "GPU") == [] and mirror.hashes(0) == {1}
    assert mirror.remove(0, 1, "CPU") == [1] and mirror.hashes(0) == set()
    mirror.clear(0)
    assert mirror.page_size(0) == 2  # a clear keeps the page size


def test_page_keys_pack_ints_and_keep_eagle_pairs() -> None:
    assert key(5, 6) == pack_tokens([5, 6]) and len(key(5, 6)) == 16
    assert page_tokens(key(5, 2**40)) == [5, 2**40]
    assert key((1, 2), (3, 4)) == ((1, 2), (3, 4))  # EAGLE bigram pages stay tuples
    assert key(2**63) == (2**63,) and page_tokens(key(2**63)) == [2**63]
    mirror = mirror_with(BlockStored([1, 2], None, [(1, 2), (3, 4)], block_size=1))
    assert mirror.child(0, None, key((1, 2))) == 1 and mirror.child(0, 1, key((3, 4))) == 2


def run_with_timeout(call, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    """``call()`` on a thread; fail (instead of hanging the suite) when it does not return."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} did not return within {timeout_s} s: a loop?"
    return result[0]


def test_a_block_naming_itself_as_parent_is_refused() -> None:
    # The removal's walk of descendants would loop forever on this store: it is refused.
    mirror = mirror_with(BlockStored([1], None, [1, 1], block_size=2))
    with pytest.raises(ValueError, match="own block"):
        mirror.store(0, BlockStored([7], 7, [7, 7], block_size=2))
    with pytest.raises(ValueError, match="own block"):
        mirror.store(0, BlockStored([8, 9], 9, [8, 8, 9, 9], block_size=2))
    assert mirror.hashes(0) == {1}  # nothing of a refused event is applied
    assert run_with_timeout(lambda: mirror.remove(0, 7, None)) == []


@pytest.mark.parametrize("length", [2, 3, 50])
def test_blocks_naming_each_other_as_parents_do_not_loop(length: int) -> None:
    # A cycle of ``length`` blocks, each stored under the next (absent when it is stored), the
    # last under the first; then each removal must return, each block once at most.
    mirror = mirror_with(
        *(BlockStored([h], h % length + 1, [h, h], block_size=2) for h in range(1, length + 1))
    )
    assert mirror.hashes(0) == set(range(1, length + 1))
    assert mirror.stats()["cycles_refused"] == 1  # the link that would close it
    broken = run_with_timeout(lambda: mirror.remove(0, 1, None))
    assert broken[0] == 1 and len(broken) == len(set(broken)) <= length
    for h in range(2, length + 1):
        run_with_timeout(lambda h=h: mirror.remove(0, h, None))
    assert mirror.hashes(0) == set()


def test_the_walk_is_cycle_safe_even_on_links_made_behind_its_back() -> None:
    # The links never form a cycle; should one exist all the same, the walk still ends.
    mirror = mirror_with(
        BlockStored([1, 2], None, [1, 1, 2, 2], block_size=2),
        BlockStored([3], 2, [3, 3], block_size=2),
    )
    block = mirror.block(0, 3)
    assert block is not None
    block.children = 1  # 3 -> 1: a cycle 1 -> 2 -> 3 -> 1
    assert sorted(run_with_timeout(lambda: mirror.remove(0, 1, None))) == [1, 2, 3]


def test_descendants_without_tokens_are_found_by_a_removal() -> None:
    # A block stored without usable token ids is reached by the walk all the same.
    mirror = mirror_with(
        BlockStored([1, 2], None, [1, 1, 2, 2], block_size=2),
        BlockStored([3], 2, [3], block_size=2),  # token ids that do not split: no tokens
        BlockStored([4], 3, [], block_size=2),
    )
    assert mirror.block(0, 3).tokens is None  # type: ignore[union-attr]
    assert sorted(mirror.remove(0, 2, None)) == [2, 3, 4]


def test_orphans_are_adopted_when_their_parent_is_stored_again() -> None:
    mirror = mirror_with(
        BlockStored([1, 2], None, [1, 1, 2, 2], block_size=2),
        BlockStored([3], 2, [3, 3], block_size=2),
    )
    assert mirror.remove(0, 2, None) == [2, 3]  # 3 stays present, an orphan
    mirror.store(0, BlockStored([2], 1, [2, 2], block_size=2))  # vLLM recomputes block 2
    assert mirror.remove(0, 1, None) == [1, 2, 3]
    # Stored before its parent (a late join): found once the parent arrives.
    mirror.store(0, BlockStored([6], 5, [6, 6], block_size=2))
    mirror.store(0, BlockStored([5], None, [5, 5], block_size=2))
    assert mirror.remove(0, 5, None) == [5, 6]


def test_the_bound_drops_the_least_recently_stored_leaf() -> None:
    mirror = BlockMirror(max_blocks=3)
    mirror.add_rank(0)
    mirror.store(0, BlockStored([1], None, [1, 1], block_size=2))  # the shared root
    mirror.store(0, BlockStored([2], 1, [2, 2], block_size=2))
    mirror.store(0, BlockStored([3], 1, [3, 3], block_size=2))
    assert not mirror.over_bound(0)
    mirror.store(0, BlockStored([2], 1, [2, 2], block_size=2, medium="CPU"))  # 2 used again
    mirror.store(0, BlockStored([4], 1, [4, 4], block_size=2))
    assert mirror.over_bound(0)
    assert mirror.evict_lru(0) == [3]  # a leaf, the least recently stored: not the root
    assert not mirror.over_bound(0) and mirror.hashes(0) == {1, 2, 4}
    assert mirror.evict_lru(0) == [2] and mirror.evict_lru(0) == [4]
    assert mirror.evict_lru(0) == [1]  # a leaf again once its children went
    assert mirror.evict_lru(0) == [] and mirror.stats()["bound_evictions"] == 4
    with pytest.raises(ValueError, match="max_blocks"):
        BlockMirror(max_blocks=0)


# ---------------------------------------------------------------------------------------------
# Property test: the links stay consistent and acyclic whatever the events (parents absent,
# out of order, cyclic, self-referencing), and the bound holds.
# ---------------------------------------------------------------------------------------------

mirror_operation = st.one_of(
    st.tuples(
        st.just("store"),
        st.lists(st.integers(0, 12), min_size=1, max_size=3),
        st.one_of(st.none(), st.integers(0, 12)),
        st.booleans(),
    ),
    st.tuples(
        st.just("remove"), st.lists(st.integers(0, 12), max_size=2), st.none(), st.booleans()
    ),
    st.tuples(st.just("evict"), st.just([]), st.none(), st.booleans()),
)


def check_structure(mirror: BlockMirror) -> None:
    state = mirror._ranks[0]
    blocks = state.blocks

    def children(h: object) -> set:
        kids = blocks[h].children
        return set(kids) if isinstance(kids, set) else set() if kids is None else {kids}

    def waiting(parent: object) -> set:
        kids = state.orphans.get(parent)
        return set(kids) if isinstance(kids, set) else set() if kids is None else {kids}

    assert set(state.leaves) == {h for h in blocks if blocks[h].children is None}
    for h in blocks:
        for child in children(h):
            assert child in blocks and blocks[child].parent == h
        parent = blocks[h].parent
        if parent is not None:  # linked to its parent, else waiting for (or beside) it
            assert (parent in blocks and h in children(parent)) ^ (h in waiting(parent))
    for parent in state.orphans:
        for h in waiting(parent):
            assert h in blocks and blocks[h].parent == parent
    for (parent, tokens), h in state.tokens.items():
        assert h in blocks and blocks[h].parent == parent and blocks[h].tokens == tokens
    # Acyclic: a depth-first walk from every block never comes back to a block on its path.
    done: set = set()
    for start in blocks:
        path, stack = set(), [(start, iter(children(start)))]
        path.add(start)
        while stack:
            node, kids = stack[-1]
            child = next(kids, None)
            if child is None:
                stack.pop()
                path.discard(node)
                done.add(node)
            elif child not in done:
                assert child not in path, "a cycle in the links"
                path.add(child)
                stack.append((child, iter(children(child))))


def descendants(mirror: BlockMirror, root: object) -> set:
    """``root`` and every present block reached backwards along parent pointers (naively)."""
    blocks = mirror._ranks[0].blocks
    if root not in blocks:
        return set()
    found, grew = {root}, True
    while grew:
        below = {h for h, block in blocks.items() if block.parent in found} - found
        found |= below
        grew = bool(below)
    return found


@settings(max_examples=400, deadline=None)
@given(st.lists(mirror_operation, max_size=40), st.integers(1, 8))
def test_links_stay_consistent_and_acyclic(ops, bound) -> None:  # type: ignore[no-untyped-def]
    mirror = BlockMirror(page_size=1, max_blocks=bound)
    mirror.add_rank(0)
    for kind, hashes, parent, flag in ops:
        if kind == "store":
            event = BlockStored(hashes, parent, hashes if flag else [], block_size=1)
            try:
                mirror.store(0, event)
            except ValueError:
                assert parent in hashes
            while mirror.over_bound(0):
                broken = mirror.evict_lru(0)
                assert len(broken) == len(set(broken)) >= 1
        elif kind == "remove":
            for h in hashes:
                expected = descendants(mirror, h)
                broken = mirror.remove(0, h, None)
                assert len(broken) == len(set(broken)) and set(broken) == expected
                assert not broken or broken[0] == h
        elif mirror.hashes(0):
            assert len(mirror.evict_lru(0)) >= 1
        check_structure(mirror)
        assert len(mirror.hashes(0)) <= bound
