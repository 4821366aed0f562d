"""BlockMirror on its own: what a removal breaks, media, the token index, page sizes."""

from __future__ import annotations

from contextpilot_integrations.sync.block_mirror import BlockMirror
from contextpilot_integrations.sync.kv_events import BlockStored


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
    assert mirror.store(0, event) == [(None, 1, (5, 6)), (1, 2, (7, 8))]
    assert mirror.page_size(0) == 2 and mirror.child(0, 1, (7, 8)) == 2
    # Token ids that do not split into the pages: stored, without tokens, and counted.
    assert mirror.store(0, BlockStored([3], 2, [1, 2, 3], block_size=2)) == []
    assert mirror.hashes(0) == {1, 2, 3} and mirror.child(0, 2, (1, 2)) is None
    assert mirror.stats()["token_mismatch_events"] == 1


def test_a_removal_breaks_the_block_and_its_present_descendants() -> None:
    mirror = mirror_with(
        BlockStored([1, 2, 3], None, [1, 1, 2, 2, 3, 3], block_size=2),
        BlockStored([4], 1, [4, 4], block_size=2),
    )
    assert mirror.remove(0, 3, None) == [3]  # a leaf: only itself
    assert sorted(mirror.remove(0, 1, None)) == [1, 2, 4]  # an inner block: the subtree
    assert mirror.hashes(0) == {2, 4}  # the descendants stay present
    assert mirror.child(0, None, (1, 1)) is None and mirror.child(0, 1, (2, 2)) == 2
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
