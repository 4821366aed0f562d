"""Wire frames captured from the real publishers of SGLang 0.5.23 (maps with "type") and
SGLang 0.5.18 (positional arrays) by the sglang tier (``CONTEXTPILOT_CAPTURE_FRAMES``), read
here without SGLang installed."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventDecoder,
    event_kind,
)

DATA = Path(__file__).parent / "data"


def frames(name: str) -> list[list[bytes]]:
    return msgspec.msgpack.decode((DATA / f"{name}.msgpack").read_bytes())


@pytest.mark.parametrize(
    ("name", "raw_event_type"),
    [("sglang-0.5.23-map", dict), ("sglang-0.5.18-positional", list)],
)
def test_captured_frames_decode(name: str, raw_event_type: type) -> None:
    decoder = KVEventDecoder()
    captured = frames(name)
    assert captured
    kinds: set[str] = set()
    sequence = [int.from_bytes(seq, "big") for _, seq, _ in captured]
    assert sequence == sorted(sequence)
    mirror = CacheMirror()
    for topic, seq, payload in captured:
        assert topic == b"kv" and len(seq) == 8
        assert all(isinstance(e, raw_event_type) for e in msgspec.msgpack.decode(payload)[1])
        batch = decoder.decode(payload)
        assert batch.dp_rank == 0
        for event in batch.events:
            kinds.add(event_kind(event))
            if isinstance(event, BlockStored):
                assert event.medium == "GPU" and event.block_size == 2
                assert len(event.token_ids) == 2 * len(event.block_hashes)
                assert all(-(2**63) <= h < 2**63 for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert event.medium == "GPU" and event.block_hashes
        mirror.apply_batch(0, batch)
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert decoder.unknown_events == 0
