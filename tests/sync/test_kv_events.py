"""Wire-shape decoding: both shapes, added fields, bytes hashes, unknown kinds, bad input."""

from __future__ import annotations

import re

import msgspec
import pytest

from contextpilot_integrations.sync.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecoder,
    MalformedEventBatchError,
    encode_mapped,
    encode_positional,
    event_kind,
)

BATCH = KVEventBatch(
    ts=1700000000.25,
    events=[
        BlockStored(
            block_hashes=[-5, 7],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            medium="GPU",
            session_id="rid-1",
        ),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    ],
    dp_rank=3,
)


def fields(batch: KVEventBatch) -> list[tuple[str, dict]]:
    return [(event_kind(e), msgspec.structs.asdict(e)) for e in batch.events]


def test_map_shape_round_trips_every_field() -> None:
    decoded = KVEventDecoder().decode(encode_mapped(BATCH))
    assert decoded.ts == BATCH.ts and decoded.dp_rank == 3
    assert fields(decoded) == fields(BATCH)


def test_positional_shape_decodes_to_the_same_events_minus_new_fields() -> None:
    payload = encode_positional(BATCH)
    raw = msgspec.msgpack.decode(payload)
    # SGLang <= 0.5.18 layout: tag first, then fields in declaration order.
    assert raw[1][0] == ["BlockStored", [-5, 7], None, [1, 2, 3, 4], 2, None, "GPU"]
    assert raw[1][1] == ["BlockRemoved", [7], "GPU"] and raw[1][2] == ["AllBlocksCleared"]
    decoded = KVEventDecoder().decode(payload)
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored) and isinstance(decoded.events[2], AllBlocksCleared)
    assert stored.block_hashes == [-5, 7] and stored.token_ids == [1, 2, 3, 4]
    assert stored.session_id is None  # not part of the old shape


def test_sglang_0518_salted_positional_store_carries_metadata() -> None:
    salted = KVEventBatch(ts=1.0, events=[BlockStored([1], None, [7], 1, cache_salt="tenant")])
    raw = msgspec.msgpack.decode(encode_positional(salted))
    assert raw[1][0] == ["BlockStored", [1], None, [7], 1, None, None, {"cache_salt": "tenant"}]
    (stored,) = KVEventDecoder().decode(encode_positional(salted)).events
    assert type(stored) is BlockStored and stored.cache_salt == "tenant"


def test_vllm_09_positional_without_medium_and_batch_without_rank() -> None:
    payload = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [11], 10, [5, 6], 2, None], ["BlockRemoved", [11]]]]
    )
    decoded = KVEventDecoder().decode(payload)
    assert decoded.dp_rank is None
    stored, removed = decoded.events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 10
    assert stored.medium is None and isinstance(removed, BlockRemoved)


def test_added_fields_are_tolerated_in_both_shapes() -> None:
    mapped = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],  # vLLM bytes hashes
        "parent_block_hash": None,
        "token_ids": [9],
        "block_size": 1,
        "lora_id": 4,
        "medium": "CPU_PINNED",
        "cache_salt": "s",
        "session_id": "x",
        "lora_name": "adapter",
        "extra_keys": [["mm", 1]],
        "group_idx": 0,
        "something_new": {"a": 1},
    }
    positional = ["BlockRemoved", [3], "GPU", "future-field", 42]
    payload = msgspec.msgpack.encode([0.5, [mapped, positional], 0, "trailing"])
    stored, removed = KVEventDecoder().decode(payload).events
    assert stored.block_hashes == [b"\x01" * 32] and stored.lora_name == "adapter"
    assert stored.lora_id == 4 and stored.medium == "CPU_PINNED"
    assert removed.block_hashes == [3] and removed.medium == "GPU"


def test_unknown_event_kinds_are_skipped_and_counted() -> None:
    decoder = KVEventDecoder()
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockPinned", "x": 1}, ["BlockMoved", 1], {"type": "AllBlocksCleared"}]]
    )
    batch = decoder.decode(payload)
    assert [event_kind(e) for e in batch.events] == ["AllBlocksCleared"]
    assert decoder.unknown_events == 2


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "bad KV-event batch"),
        (msgspec.msgpack.encode({"ts": 1}), "bad KV-event batch"),
        (msgspec.msgpack.encode(["now", []]), "bad KV-event batch"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}]]),
            "events[0] (kind 'BlockStored')",
        ),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved"]]]), "events[0] (kind 'BlockRemoved')"),
        (msgspec.msgpack.encode([1.0, [17]]), "events[0] (kind None)"),
    ],
    ids=["not-msgpack", "map-batch", "bad-ts", "bad-hash", "missing-field", "not-an-event"],
)
def test_malformed_payloads_raise_a_specific_error(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedEventBatchError, match=re.escape(message)):
        KVEventDecoder().decode(payload)


def test_every_event_kind_is_frozen_in_both_shapes() -> None:
    # The mirror keeps decoded events' lists; an event must not change after decoding.
    decoded = [
        *KVEventDecoder().decode(encode_mapped(BATCH)).events,
        *KVEventDecoder().decode(encode_positional(BATCH)).events,
    ]
    for event in decoded + [BATCH]:
        field = msgspec.structs.fields(event)[0].name if msgspec.structs.fields(event) else "x"
        with pytest.raises(AttributeError):
            setattr(event, field, None)
        assert type(event).__struct_config__.frozen, type(event).__name__
