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
        (msgspec.msgpack.encode([1.0, 17]), "bad KV-event batch"),
    ],
    ids=["not-msgpack", "map-batch", "bad-ts", "events-not-a-list"],
)
def test_a_payload_that_is_no_batch_raises_a_specific_error(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedEventBatchError, match=re.escape(message)):
        KVEventDecoder().decode(payload)


GOOD_REMOVAL = ["BlockRemoved", [5], "GPU"]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "BlockStored", "block_hashes": ["x"]},  # a hash that is a string
        ["BlockRemoved"],  # a missing field
        17,  # not an event at all
        ["BlockStored", [1, 2], [5, 6, 7, 8], 2, None, "GPU"],  # positional, parent missing
        ["BlockStored", [1], None, "GPU", [5, 6], 2],  # positional, fields swapped
        {"type": "BlockStored", "block_hashes": [1], "block_size": -2},
        {"type": "BlockStored", "block_hashes": [1], "session_id": "s" * 5000},
        [["BlockRemoved"], [1]],  # the tag is not a string
    ],
    ids=[
        "bad-hash",
        "missing-field",
        "not-an-event",
        "shifted",
        "swapped",
        "negative-size",
        "long-string",
        "nested-tag",
    ],
)
def test_a_malformed_event_is_skipped_and_its_batch_mates_decoded(bad: object) -> None:
    # One bad event must not drop the whole batch (valid removals among it).
    decoder = KVEventDecoder()
    batch = decoder.decode(msgspec.msgpack.encode([1.0, [GOOD_REMOVAL, bad, GOOD_REMOVAL], 0]))
    assert [event_kind(e) for e in batch.events] == ["BlockRemoved", "BlockRemoved"]
    assert decoder.malformed_events == 1 and decoder.unknown_events == 0


def test_deep_nesting_is_a_malformed_frame_not_a_recursion_error() -> None:
    # About 1 KB nested more than 1,000 deep must not raise RecursionError out of decode.
    decoder = KVEventDecoder()
    for depth in (1_100, 100_000):
        nested = b"\x91" * depth + b"\x90"
        as_event = b"\x93\xcb" + b"\x00" * 8 + b"\x91" + nested + b"\xc0"
        in_a_field = (
            b"\x93\xcb" + b"\x00" * 8 + b"\x91\x82\xa4type\xabBlockStored\xa1x" + nested + b"\xc0"
        )
        for payload in (nested, as_event, in_a_field):
            with pytest.raises(MalformedEventBatchError, match="bad KV-event batch"):
                decoder.decode(payload)
    # Nesting inside one event that still fits the recursion limit: that event is skipped.
    shallow = msgspec.msgpack.encode([1.0, [GOOD_REMOVAL, {"type": "BlockStored", "x": 1}], 0])
    shallow = shallow.replace(b"\x01", b"\x91" * 800 + b"\x90")
    assert len(decoder.decode(shallow).events) == 1 and decoder.malformed_events == 1


def batch_of(*events: bytes, count: bytes | None = None) -> bytes:
    """A msgpack batch ``[0.0, [events...], nil]`` from already encoded events (``count``: the
    events array's header, to claim another length)."""
    header = count if count is not None else bytes([0x90 + len(events)])
    return b"\x93\xcb" + b"\x00" * 8 + header + b"".join(events) + b"\xc0"


def array32(length: int) -> bytes:
    return b"\xdd" + length.to_bytes(4, "big")


CLEARED = b"\x91\xb0AllBlocksCleared"


def test_sizes_beyond_the_limits_are_refused() -> None:
    from contextpilot_integrations.sync import kv_events

    decoder = KVEventDecoder()
    padding = b"\xc6" + kv_events.MAX_PAYLOAD_BYTES.to_bytes(4, "big") + b"\x00" * (1 << 24)
    with pytest.raises(MalformedEventBatchError, match="bytes, more than"):
        decoder.decode(batch_of(b"\x92\xacBlockRemoved\x91\x01" + padding))
    many = kv_events.MAX_EVENTS_PER_BATCH + 1
    with pytest.raises(MalformedEventBatchError, match=f"length <= {many - 1}"):
        decoder.decode(batch_of(CLEARED * many, count=array32(many)))
    # A length is checked from the array header, before any item is read or allocated.
    with pytest.raises(MalformedEventBatchError, match=f"length <= {many - 1}"):
        decoder.decode(batch_of(count=array32(2**32 - 1)))
    limit = kv_events.MAX_HASHES_PER_EVENT
    over = b"\x92\xacBlockRemoved" + array32(limit + 1) + b"\x01" * (limit + 1)
    at_limit = b"\x92\xacBlockRemoved" + array32(limit) + b"\x01" * limit
    batch = decoder.decode(batch_of(over, at_limit, CLEARED))
    assert [event_kind(e) for e in batch.events] == ["BlockRemoved", "AllBlocksCleared"]
    assert len(batch.events[0].block_hashes) == limit and decoder.malformed_events == 1
    tokens = kv_events.MAX_TOKENS_PER_EVENT + 1
    stored = b"\x94\xabBlockStored\x91\x01\xc0" + array32(tokens) + b"\x01" * tokens
    assert decoder.decode(batch_of(stored, CLEARED)).events == [AllBlocksCleared()]
    assert decoder.malformed_events == 2


def test_hashes_are_decoded_as_sent_and_made_canonical_by_one_function() -> None:
    from contextpilot_integrations.sync.kv_events import canonical_block_hash

    unsigned = 2**64 - 5
    (stored,) = (
        KVEventDecoder()
        .decode(msgspec.msgpack.encode([1.0, [["BlockStored", [unsigned], None, [], 0]]]))
        .events
    )
    assert stored.block_hashes == [unsigned]  # the decoder is faithful to the wire
    assert canonical_block_hash(unsigned) == canonical_block_hash(-5) == -5
    assert canonical_block_hash(2**63 - 1) == 2**63 - 1
    assert canonical_block_hash(b"\xff" * 8) == b"\xff" * 8  # bytes stay bytes
    for bad in (2**64, -(2**63) - 1, True, "5", 1.0):
        with pytest.raises(ValueError):
            canonical_block_hash(bad)


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
