"""Tenant- and adapter-aware block keys: blocks stored under another ``cache_salt`` or LoRA
adapter never count as a request's cache, whatever tokens (or hashes) they share."""

from __future__ import annotations

import time

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.sync.block_namespaces import Namespace, event_namespace
from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.engine_link import EngineLink
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecoder,
    encode_mapped,
)


def store(hashes, tokens, parent=None, **fields) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size=2, **fields)


def test_a_salted_chain_is_no_cache_for_another_salt_even_with_the_same_hashes() -> None:
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    # SGLang's hashes need not include the salt: tenant t1 and the default share hashes 1, 2.
    mirror.apply_events(0, [store([1, 2], [5, 6, 7, 8], cache_salt="t1")])
    assert mirror.register_request("plain", [5, 6, 7, 8]) == 0
    assert mirror.register_request("other", [5, 6, 7, 8], cache_salt="t2") == 0
    assert mirror.register_request("mine", [5, 6, 7, 8], cache_salt="t1") == 2
    assert mirror.cached_requests() == {"mine"}
    mirror.apply_events(0, [store([1, 2], [5, 6, 7, 8])])  # the same pages, unsalted
    assert mirror.cached_requests() == {"mine", "plain"}
    assert mirror.block_hashes(0) == {1, 2} and mirror.stats()["blocks"] == 4
    assert mirror.block(2, cache_salt="t1")["parent"] == (Namespace("t1", None), 1)  # type: ignore[index]
    assert mirror.block(2)["parent"] == 1  # type: ignore[index]
    # A removal names no namespace: the hash leaves both (conservative, never wrong reuse).
    mirror.apply_events(0, [BlockRemoved([2])])
    assert sorted(evicted) == ["mine", "plain"] and mirror.stats()["blocks"] == 2


def test_an_adapters_chain_is_no_cache_for_the_base_model_or_another_adapter() -> None:
    mirror = CacheMirror()
    mirror.apply_events(0, [store([1], [5, 6], lora_name="sql", lora_id=3)])
    mirror.apply_events(0, [store([9], [5, 6], lora_id=4)])  # an old vLLM: the id only
    assert mirror.register_request("base", [5, 6]) == 0
    assert mirror.register_request("chat", [5, 6], lora_name="chat") == 0
    assert mirror.register_request("sql", [5, 6], lora_name="sql") == 1
    assert mirror.cached_requests() == {"sql"}


def test_vllm_salts_come_with_the_first_block_and_continuations_inherit_them() -> None:
    mirror = CacheMirror()
    # vLLM: the salt is an extra key of the request's first block only, after the LoRA name.
    first = store([1, 2], [1, 1, 2, 2], extra_keys=[["ad", "s1"], ["ad"]], lora_name="ad")
    assert event_namespace(first) == Namespace("s1", "ad")
    mirror.apply_events(0, [first, store([3], [3, 3], parent=2, lora_name="ad")])
    mirror.apply_events(0, [store([4], [4, 4], parent=3)])  # no field at all: the parent's
    tokens = [1, 1, 2, 2, 3, 3, 4, 4]
    assert mirror.register_request("r", tokens, cache_salt="s1", lora_name="ad") == 4
    assert mirror.register_request("no-salt", tokens, lora_name="ad") == 0
    assert mirror.register_request("no-adapter", tokens, cache_salt="s1") == 0
    # An image's extra keys make a chain opaque: no registered tokens match it.
    mirror.apply_events(0, [store([7], [9, 9], extra_keys=[[["img-1", 0]]])])
    assert mirror.register_request("text", [9, 9]) == 0
    assert mirror.cached_requests() == {"r"}


def test_session_echoed_chains_are_attributed_and_evicted_in_their_namespace() -> None:
    evicted: list[str] = []
    mirror = CacheMirror(evicted.append)
    mirror.apply_events(0, [store([1], [1, 1], cache_salt="t", session_id="a")])
    mirror.apply_events(0, [store([2], [2, 2], parent=1, cache_salt="t", session_id="a")])
    mirror.apply_events(0, [store([1], [1, 1], session_id="b")])
    assert mirror.cached_requests() == {"a", "b"}
    assert mirror.request_blocks("a") == {0: {(Namespace("t", None), 2)}}
    mirror.apply_events(0, [BlockRemoved([2])])
    assert evicted == ["a"] and mirror.cached_requests() == {"b"}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([None, "t1", "t2"]), st.sampled_from([None, "x"])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([None, "t1", "t2"]),
    st.sampled_from([None, "x"]),
)
def test_a_request_is_cached_only_by_a_chain_of_its_own_namespace(stores, salt, adapter) -> None:
    mirror = CacheMirror()
    for i, (stored_salt, stored_adapter) in enumerate(stores):  # same tokens, same hash
        event = store([100], [5, 6], cache_salt=stored_salt, lora_name=stored_adapter)
        mirror.apply_events(0, [event])
        assert mirror.stats()["blocks"] == len(set(stores[: i + 1]))
    matched = mirror.register_request("r", [5, 6], cache_salt=salt, lora_name=adapter)
    assert matched == (1 if (salt, adapter) in stores else 0)


def test_extra_keys_decode_and_reach_the_mirror_over_zmq(tmp_path) -> None:
    event = store([1], [5, 6], extra_keys=[["s9"]], session_id="r")
    decoded = KVEventDecoder().decode(encode_mapped(KVEventBatch(0.0, [event])))
    assert decoded.events[0].extra_keys == [["s9"]]  # type: ignore[union-attr]
    assert msgspec.structs.asdict(decoded.events[0])["lora_name"] is None

    endpoint = f"ipc://{tmp_path}/events.ipc"
    link = EngineLink({"kind": "kv-events", "endpoint": endpoint}).bind(lambda rid: True)
    with KVEventPublisher(endpoint) as engine, link:
        link.register_tokens("salted", [7, 8], cache_salt="s9")
        link.register_tokens("unsalted", [7, 8])
        deadline = time.monotonic() + 10
        mirror = link.source.mirror  # type: ignore[union-attr]
        while mirror.cached_requests() != {"r", "salted"}:
            engine.publish(KVEventBatch(time.time(), [store([2], [7, 8], extra_keys=[["s9"]])]))
            engine.publish(KVEventBatch(time.time(), [event]))
            assert time.monotonic() < deadline, mirror.cached_requests()
            time.sleep(0.05)
