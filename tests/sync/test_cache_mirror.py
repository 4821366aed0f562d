"""CacheMirror: blocks follow the events; attribution by session id and by token matching;
the eviction rule; wiring to the lead's ContextIndex; a hypothesis model test."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


def stored(hashes, parent=None, tokens=None, size=2, session=None, medium=None) -> BlockStored:
    if tokens is None:
        tokens = [t for h in hashes for t in (h, h + 1000)][: size * len(hashes)]
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=size,
        session_id=session,
        medium=medium,
    )


class Recorder:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def __call__(self, rid: str) -> None:
        self.evicted.append(rid)


def test_store_and_remove_follow_the_chain() -> None:
    mirror = CacheMirror()
    mirror.apply_events(0, [stored([1, 2, 3]), stored([4], parent=2)])
    assert mirror.block_hashes(0) == {1, 2, 3, 4}
    assert mirror.block(3) == {
        "parent": 2,
        "token_ids": [3, 1003],
        "session_id": None,
        "media": ["GPU"],
    }
    mirror.apply_batch(0, KVEventBatch(ts=0.0, events=[BlockRemoved([3, 4]), BlockRemoved([99])]))
    assert mirror.block_hashes(0) == {1, 2}
    assert mirror.stats()["unknown_removals"] == 1


def test_session_attribution_evicts_when_the_deepest_block_goes() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    # Shared prefix 1-2 stored by request a; b extends it with 3-4 (only its new pages carry b).
    mirror.apply_events(0, [stored([1, 2], session="a"), stored([3, 4], parent=2, session="b")])
    assert mirror.request_blocks("a") == {0: {2}} and mirror.request_blocks("b") == {0: {4}}
    assert mirror.cached_requests() == {"a", "b"}
    mirror.apply_events(0, [BlockRemoved([4, 3])])  # LRU: b's leaf first
    assert recorder.evicted == ["b"]
    mirror.apply_events(0, [BlockRemoved([2])])
    assert recorder.evicted == ["b", "a"]
    assert mirror.cached_requests() == set()


def test_a_request_that_extends_its_own_chain_moves_its_attachment() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    # Chunked prefill: two stores of the same session, the second continuing the first.
    mirror.apply_events(0, [stored([1, 2], session="r"), stored([3], parent=2, session="r")])
    assert mirror.request_blocks("r") == {0: {3}}
    mirror.apply_events(0, [BlockRemoved([3])])
    assert recorder.evicted == ["r"]


def test_removing_an_inner_block_evicts_requests_below_it() -> None:
    # vLLM can free an inner block while its children stay: the prefix match breaks there.
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    mirror.apply_events(0, [stored([1, 2, 3], session="deep"), stored([9], parent=1, session="x")])
    mirror.apply_events(0, [BlockRemoved([2])])
    assert recorder.evicted == ["deep"]
    assert mirror.block_hashes(0) == {1, 3, 9}


def test_a_host_copy_keeps_the_block_cached() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    mirror.apply_events(0, [stored([1], session="r"), stored([1], medium="CPU_PINNED")])
    mirror.apply_events(0, [BlockRemoved([1], medium="GPU")])
    assert recorder.evicted == [] and mirror.block(1)["media"] == ["CPU_PINNED"]
    mirror.apply_events(0, [BlockRemoved([1], medium="CPU_PINNED")])
    assert recorder.evicted == ["r"]


def test_token_matching_when_registered_before_the_engine_stores() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder, page_size=2)
    assert mirror.register_request("r", [10, 11, 12, 13, 14]) == 0  # 2 whole pages
    mirror.apply_events(0, [stored([1], tokens=[10, 11]), stored([2, 3], 1, [12, 13, 99, 98])])
    assert mirror.request_blocks("r") == {0: {2}}  # page 3 is another request's
    mirror.apply_events(0, [BlockRemoved([3])])
    assert recorder.evicted == []
    mirror.apply_events(0, [BlockRemoved([2])])
    assert recorder.evicted == ["r"]


def test_token_matching_when_registered_after_the_store_and_page_size_learnt() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder)  # page size learnt from block_size
    mirror.apply_events(0, [stored([1, 2], tokens=[5, 6, 7, 8])])
    assert mirror.register_request("hit", [5, 6, 7, 8, 9]) == 2  # the partial page never counts
    assert mirror.register_request("miss", [5, 6, 0, 0]) == 1
    assert mirror.register_request("cold", [1, 1]) == 0
    assert mirror.cached_requests() == {"hit"}  # "miss" is only partly cached: matching
    mirror.apply_events(0, [stored([3], parent=1, tokens=[0, 0])])  # "miss" now fully cached
    assert mirror.request_blocks("miss") == {0: {3}}
    mirror.apply_events(0, [AllBlocksCleared()])
    assert sorted(recorder.evicted) == ["hit", "miss"]
    # "cold" was never cached: it stays registered and matches once its tokens are stored.
    mirror.apply_events(0, [stored([7], tokens=[1, 1])])
    assert mirror.request_blocks("cold") == {0: {7}}


def test_a_partial_match_on_other_blocks_is_not_evicted_when_they_go() -> None:
    # Registered before it is served, the request matches the shared prefix another request
    # stored; that prefix is evicted before our request runs: no eviction, matching restarts.
    recorder = Recorder()
    mirror = CacheMirror(recorder, page_size=2)
    mirror.apply_events(0, [stored([1, 2], tokens=[1, 1, 2, 2])])
    assert mirror.register_request("r", [1, 1, 2, 2, 3, 3]) == 2
    assert mirror.cached_requests() == set()
    mirror.apply_events(0, [BlockRemoved([2, 1])])
    assert recorder.evicted == []
    # Now the request is served: the engine stores its whole prompt again.
    mirror.apply_events(0, [stored([11, 12, 13], tokens=[1, 1, 2, 2, 3, 3])])
    assert mirror.request_blocks("r") == {0: {13}}
    mirror.apply_events(0, [BlockRemoved([13])])
    assert recorder.evicted == ["r"]


def test_token_matching_before_page_size_is_known() -> None:
    mirror = CacheMirror()
    mirror.register_request("r", [1, 2, 3, 4])
    mirror.apply_events(0, [stored([100, 101], tokens=[1, 2, 3, 4])])
    assert mirror.request_blocks("r") == {0: {101}}


def test_resync_forgets_one_rank_and_evicts_its_requests() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    mirror.apply_events(0, [stored([1], session="zero")])
    mirror.apply_events(1, [stored([1], session="one")])
    assert mirror.resync(1) == ["one"]
    assert mirror.block_hashes(0) == {1} and mirror.block_hashes(1) == set()
    assert mirror.stats()["resyncs"] == 1 and recorder.evicted == ["one"]


def test_bounded_tracking_forgets_the_oldest_without_a_callback() -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder, max_requests=2)
    mirror.apply_events(0, [stored([1], session="a"), stored([2], session="b")])
    mirror.apply_events(0, [stored([3], session="c")])
    assert mirror.cached_requests() == {"b", "c"}
    mirror.apply_events(0, [BlockRemoved([1])])
    assert recorder.evicted == [] and mirror.stats()["forgotten_requests"] == 1


def test_callback_errors_are_counted_not_raised() -> None:
    def failing(rid: str) -> None:
        raise RuntimeError("index down")

    mirror = CacheMirror(failing)
    mirror.apply_events(0, [stored([1], session="a")])
    assert mirror.apply_events(0, [BlockRemoved([1])]) == ["a"]
    assert mirror.stats()["evict_callback_errors"] == 1


def test_the_context_index_drops_exactly_the_evicted_requests() -> None:
    index = ContextIndex(max_requests=None)
    mirror = CacheMirror(index.evict)
    index.insert("a", [101, 102])
    index.insert("b", [101, 103])
    index.insert("c", [104])
    mirror.apply_events(
        0,
        [
            stored([1], session="a"),
            stored([2], parent=1, session="b"),
            stored([3], session="c"),
        ],
    )
    mirror.apply_events(0, [BlockRemoved([2])])
    assert sorted(index.rids()) == ["a", "c"]
    mirror.apply_events(0, [AllBlocksCleared()])
    assert index.rids() == []


# ---------------------------------------------------------------------------------------------
# Model test: random store / remove / clear sequences against a plain reference.
# ---------------------------------------------------------------------------------------------

operation = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1_000), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 1_000), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("register"), st.integers(0, 1_000), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("clear"), st.just(0), st.just(0), st.just(False)),
)


class Reference:
    """The engine's cache as a dict; the attribution rules restated plainly: a session store
    attaches its rid at once; a registered request is attached once every page of its tokens
    is present as a chain from the root (checked after every event); an attached request is
    evicted when a block on the present chain above its attachment is removed."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.attached: dict[str, int] = {}  # rid -> deepest block
        self.registered: dict[str, list[tuple[int, ...]]] = {}  # rid -> pages, not yet cached
        self.evicted: list[str] = []

    def store(self, parent: int | None, hashes: list[int], session: str | None) -> None:
        previous = parent
        for h in hashes:
            self.blocks[h] = (previous, (h, -h))
            previous = h
        if session is not None:
            self.attached[session] = hashes[-1]
        self.arm()

    def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            if h not in self.blocks:
                continue
            attached = self.attached.items()
            broken = sorted(rid for rid, deepest in attached if self._above(h, deepest))
            del self.blocks[h]
            for rid in broken:
                del self.attached[rid]
            self.evicted.extend(broken)

    def register(self, rid: str, pages: list[tuple[int, ...]]) -> None:
        self.registered[rid] = pages
        self.arm()

    def arm(self) -> None:
        by_tokens = {(parent, tokens): h for h, (parent, tokens) in self.blocks.items()}
        for rid, pages in list(self.registered.items()):
            node = None
            for page in pages:
                node = by_tokens.get((node, page))
                if node is None:
                    break
            if node is not None:
                self.attached[rid] = node
                del self.registered[rid]

    def _above(self, removed: int, deepest: int) -> bool:
        node: int | None = deepest
        while node is not None and node in self.blocks:
            if node == removed:
                return True
            node = self.blocks[node][0]
        return False

    def chain(self, block: int) -> list[tuple[int, ...]]:
        pages = []
        node: int | None = block
        while node is not None and node in self.blocks:
            pages.append(self.blocks[node][1])
            node = self.blocks[node][0]
        return pages[::-1] if node is None else []

    def clear(self) -> None:
        self.evicted.extend(sorted(self.attached))
        self.attached.clear()
        self.blocks.clear()


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60), st.integers(1, 5))
def test_mirror_equals_reference(ops: list[tuple[str, int, int, bool]], batch_size: int) -> None:
    recorder = Recorder()
    mirror = CacheMirror(recorder, page_size=2)
    reference = Reference()
    next_hash = 1
    pending: list = []

    def flush() -> None:
        # Events reach the mirror in batches; the reference sees them one by one.
        mirror.apply_batch(0, KVEventBatch(ts=0.0, events=list(pending)))
        pending.clear()

    for step, (kind, pick, count, flag) in enumerate(ops):
        present = sorted(reference.blocks)
        if kind == "store":
            parent = present[pick % len(present)] if present and pick % 3 else None
            hashes = list(range(next_hash, next_hash + count))
            next_hash += count
            session = f"s{step}" if flag else None
            tokens = [t for h in hashes for t in (h, -h)]
            reference.store(parent, hashes, session)
            pending.append(BlockStored(hashes, parent, tokens, block_size=2, session_id=session))
        elif kind == "remove":
            if flag or not present:
                victims = [next_hash + 10_000]  # unknown to the engine's cache
            else:
                start = pick % len(present)
                victims = present[start : start + count]
            reference.remove(victims)
            pending.append(BlockRemoved(victims))
        elif kind == "register":
            flush()
            pages = reference.chain(present[pick % len(present)]) if present else []
            # Pages still to come: the hashes the next stores will create.
            pages += [(next_hash + k, -(next_hash + k)) for k in range(count)]
            tokens = [t for page in pages for t in page] + ([7] if flag else [])
            reference.register(f"t{step}", pages)
            mirror.register_request(f"t{step}", tokens)
        else:
            reference.clear()
            pending.append(AllBlocksCleared())
        if len(pending) >= batch_size:
            flush()
    flush()
    assert mirror.block_hashes(0) == set(reference.blocks)
    for h, (parent, tokens) in reference.blocks.items():
        block = mirror.block(h)
        assert block is not None and block["parent"] == parent
        assert tuple(block["token_ids"]) == tokens
    assert recorder.evicted == reference.evicted
    assert mirror.cached_requests() == set(reference.attached)
    for rid, deepest in reference.attached.items():
        assert mirror.request_blocks(rid) == {0: {deepest}}


def test_a_store_of_no_blocks_attaches_nothing() -> None:
    mirror = CacheMirror()
    assert mirror.apply_events(0, [BlockStored([], session_id="r")]) == []
    assert mirror.cached_requests() == set() and mirror.stats()["tracked_requests"] == 0


def test_a_bad_item_is_skipped_and_the_rest_of_its_batch_applied() -> None:
    # One bad event must not drop its batch-mates (a valid removal among them).
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    mirror.apply_events(0, [stored([1], session="a"), stored([2], session="b")])
    bad_items = [
        "not an event",
        BlockStored(["x"], None, [], 0),  # type: ignore[list-item]
        BlockStored([3], 2**70, [], 0),  # a parent that fits no 64 bits
        BlockRemoved([True]),  # a bool is no hash
        BlockStored([4], session_id=7),  # type: ignore[arg-type]
    ]
    evicted = mirror.apply_events(
        0,
        [BlockRemoved([1]), *bad_items, BlockRemoved([2])],  # type: ignore[list-item]
    )
    assert evicted == ["a", "b"] and recorder.evicted == ["a", "b"]
    assert mirror.block_hashes(0) == set()
    stats = mirror.stats()
    assert stats["malformed_events"] == len(bad_items) and stats["evicted_requests"] == 2


def run_with_timeout(call, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    """``call()`` on a thread; fail (instead of hanging the suite) when it does not return."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"did not return within {timeout_s} s: a loop?"
    return result[0]


@pytest.mark.parametrize("length", [1, 2, 3, 100])
def test_cyclic_parents_then_a_removal_return_at_once(length: int) -> None:
    # A block whose parent is itself (length 1), or blocks naming each other as parents, then
    # a BlockRemoved: a walk of dependents that followed the cycle would loop forever holding
    # the mirror's lock (/v1/stats would hang, the server would need SIGKILL).
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    cycle = [stored([h], parent=h % length + 1, session=f"s{h}") for h in range(1, length + 1)]
    run_with_timeout(lambda: mirror.apply_events(0, cycle))
    for h in range(1, length + 1):
        run_with_timeout(lambda h=h: mirror.apply_events(0, [BlockRemoved([h])]))
        run_with_timeout(mirror.stats)  # the lock is free again
    assert mirror.block_hashes(0) == set()
    assert len(recorder.evicted) == len(set(recorder.evicted))  # each rid once
    if length == 1:  # refused as malformed: a block cannot continue itself
        assert mirror.stats()["malformed_events"] == 1 and recorder.evicted == []
    else:
        assert sorted(recorder.evicted) == sorted(f"s{h}" for h in range(1, length + 1))


def test_unsigned_and_signed_forms_of_a_hash_are_one_block() -> None:
    # Engines send a 64-bit hash signed or unsigned: a block stored as an unsigned int must be
    # removed by its signed twin.
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    unsigned, signed = 2**64 - 5, -5
    mirror.apply_events(0, [stored([unsigned], session="u")])
    mirror.apply_events(0, [stored([2**63 + 1], parent=signed, session="child")])
    assert mirror.block_hashes(0) == {signed, -(2**63) + 1}  # one canonical form inside
    assert mirror.block(unsigned) == mirror.block(signed) is not None
    assert mirror.block(-(2**63) + 1)["parent"] == signed  # type: ignore[index]
    assert mirror.request_blocks("u") == {0: {signed}}
    mirror.apply_events(0, [BlockRemoved([signed])])
    assert sorted(recorder.evicted) == ["child", "u"]
    # ... and the other way round; bytes hashes stay bytes, never equal to an int.
    mirror.apply_events(0, [stored([-7], session="s"), stored([b"\xff" * 8], None, [1, 2])])
    mirror.apply_events(0, [BlockRemoved([2**64 - 7, 2**64 - 1])])
    assert b"\xff" * 8 in mirror.block_hashes(0) and -7 not in mirror.block_hashes(0)
    assert recorder.evicted[-1] == "s"


def test_a_session_block_without_tokens_is_evicted_with_its_ancestor() -> None:
    # A removed block's descendants are walked by parent links, not the token index alone: a
    # block stored without usable token ids is reached too.
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    mirror.apply_events(0, [stored([1, 2], session="prefix")])
    mirror.apply_events(0, [stored([3], parent=2, tokens=[9], session="no-tokens")])
    assert mirror.block(3)["token_ids"] is None  # type: ignore[index]
    mirror.apply_events(0, [BlockRemoved([1])])  # vLLM can free an inner block first
    assert sorted(recorder.evicted) == ["no-tokens", "prefix"]


def test_the_block_bound_evicts_the_requests_of_dropped_blocks() -> None:
    # The mirror has a bound of its own (docs/DESIGN.md, "Bounded"): beyond max_blocks the
    # least recently stored leaf goes, as a removal would.
    recorder = Recorder()
    mirror = CacheMirror(recorder, max_blocks=4)
    mirror.apply_events(0, [stored([1], session="root")])  # a shared prefix
    mirror.apply_events(0, [stored([10 + k], parent=1, session=f"r{k}") for k in range(3)])
    assert recorder.evicted == [] and len(mirror.block_hashes(0)) == 4
    mirror.apply_events(0, [stored([20], parent=1, session="new")])
    assert recorder.evicted == ["r0"]  # the oldest leaf, not the old (but shared) root
    assert mirror.block_hashes(0) == {1, 11, 12, 20}
    mirror.apply_events(0, [stored([30, 31, 32], parent=12, session="long")])
    # 7 blocks: the three oldest leaves go (11, 20, then 32: 30 and 31 have children).
    assert recorder.evicted == ["r0", "r1", "new", "long"]
    assert mirror.block_hashes(0) == {1, 12, 30, 31}
    assert mirror.stats()["bound_evictions"] == 4 and mirror.cached_requests() == {"root", "r2"}
    with pytest.raises(ValueError, match="max_blocks"):
        CacheMirror(max_blocks=0)


def test_an_event_removing_a_long_chain_root_first_walks_it_once() -> None:
    # Each removal of an inner block walks its descendants; an event that removes a long chain
    # root first must not walk the rest of the chain again for every block (quadratic: about
    # a minute for these 20,000 blocks before).
    recorder = Recorder()
    mirror = CacheMirror(recorder)
    chain = list(range(1, 20_001))
    mirror.apply_events(0, [BlockStored(chain, None, chain, block_size=1)])
    for depth in (5, 500, 19_999):
        mirror.apply_events(0, [stored([100_000 + depth], parent=depth, session=f"at{depth}")])
    evicted = run_with_timeout(lambda: mirror.apply_events(0, [BlockRemoved(chain)]), 5.0)
    assert evicted == ["at19999", "at5", "at500"] and recorder.evicted == evicted
    assert mirror.block_hashes(0) == {100_005, 100_500, 119_999}
