"""Decoding of the KV-cache event batches that SGLang and vLLM publish over ZMQ.

Wire format (SGLang ``sglang/srt/disaggregation/kv_events.py``, vLLM
``vllm/distributed/kv_events.py``; see ``shared/notes/engine-kv-events.md``):

- A batch is a msgpack array ``[ts, events, dp_rank]``: ``ts`` is the publisher's
  ``time.time()`` in seconds, ``dp_rank`` the data-parallel (SGLang: attention-DP) rank or nil.
- Each event is one of ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in one of two
  shapes:

  * positional tagged array (SGLang <= 0.5.18, vLLM 0.9):
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, ...]``;
  * map with a ``"type"`` key (SGLang 0.5.20+, current vLLM):
    ``{"type": "BlockStored", "block_hashes": [...], ...}``.

Fields added by later releases (``medium``, ``cache_salt``, ``session_id``, ``lora_name``,
vLLM's ``extra_keys``...) are tolerated: unknown map keys and extra trailing array items are
ignored, missing optional fields take their defaults. Block hashes are opaque ids taken from the
engine (SGLang: signed 64-bit ints; recent vLLM: bytes); they are never recomputed here.

Public API: :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`,
:class:`KVEventBatch`, :class:`KVEventDecoder`, :exc:`MalformedEventBatchError`.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

BlockHash = int | bytes
"""An engine block hash: an int (SGLang, older vLLM) or bytes (vLLM with bytes hashes)."""

TokenId = int | tuple[int, ...]
"""A token id; SGLang's EAGLE bigram pages publish ``(id, next_id)`` pairs instead."""

MEDIUM_GPU = "GPU"
"""The medium assumed when an event carries none (events before SGLang 0.5.9, vLLM GPU)."""


class KVCacheEvent(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    """Base of the three event kinds (map shape; positional events are decoded into these).

    msgspec passes ``frozen`` on to subclasses, but type checkers read each class's own
    keywords (``dataclass_transform``), so every subclass states ``frozen=True`` again."""


class BlockStored(KVCacheEvent, frozen=True, tag="BlockStored"):
    """Consecutive pages stored as one chain.

    ``block_hashes[i]`` is the hash of page i; its parent is ``block_hashes[i - 1]``, and the
    parent of page 0 is ``parent_block_hash`` (None: the page hangs from the root).
    ``token_ids`` holds ``block_size`` ids per page, pages in order.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[TokenId] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True, tag="BlockRemoved"):
    """Pages dropped from ``medium`` (None means GPU)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True, tag="AllBlocksCleared"):
    """The whole prefix cache was reset (SGLang ``RadixCache.reset``, vLLM prefix-cache reset)."""


class _StoredMetadata(msgspec.Struct, gc=False):
    """SGLang 0.5.18's ``BlockStoredMetadata``: a map trailing a salted positional BlockStored."""

    cache_salt: str | None = None


class _PositionalBlockStored(KVCacheEvent, frozen=True, array_like=True, tag="BlockStored"):
    """``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, metadata]``;
    ``metadata`` (``{"cache_salt": ...}``) only in SGLang 0.5.18 for salted requests."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[TokenId] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    metadata: _StoredMetadata | None = None

    def normalised(self) -> BlockStored:
        return BlockStored(
            block_hashes=self.block_hashes,
            parent_block_hash=self.parent_block_hash,
            token_ids=self.token_ids,
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=self.medium,
            cache_salt=self.metadata.cache_salt if self.metadata is not None else None,
        )


class _PositionalBlockRemoved(KVCacheEvent, frozen=True, array_like=True, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None

    def normalised(self) -> BlockRemoved:
        return BlockRemoved(block_hashes=self.block_hashes, medium=self.medium)


class _PositionalAllBlocksCleared(
    KVCacheEvent, frozen=True, array_like=True, tag="AllBlocksCleared"
):
    def normalised(self) -> AllBlocksCleared:
        return _ALL_BLOCKS_CLEARED


_ALL_BLOCKS_CLEARED = AllBlocksCleared()

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

EVENT_KINDS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One published batch: ``[ts, events, dp_rank]`` (extra trailing items are ignored)."""

    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    dp_rank: int | None = None


class MalformedEventBatchError(ValueError):
    """A payload that is not a KV-event batch in either wire shape.

    The message names the failing field (msgspec's path, e.g. ``$[1][0]``) and the cause.
    """


# msgpack type bytes that start a map: fixmap 0x80-0x8f, map16 0xde, map32 0xdf.
_MAP_HEADERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


class KVEventDecoder:
    """Decodes msgpack payloads of either wire shape into :class:`KVEventBatch`.

    One instance per thread (msgspec decoders hold no shared state, but reuse saves setup).
    Events of a kind not listed in :data:`EVENT_KINDS` (a newer engine) are skipped and
    counted in :attr:`unknown_events`, so that the known events of the batch still apply.
    """

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._positional = msgspec.msgpack.Decoder(
            _PositionalBlockStored | _PositionalBlockRemoved | _PositionalAllBlocksCleared
        )
        self._mapped = msgspec.msgpack.Decoder(KVEvent)
        self.unknown_events = 0

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        """Decode one payload.

        Args:
            payload: the third frame of a published message.

        Returns:
            the batch, events in publication order.

        Raises:
            MalformedEventBatchError: the payload is not a batch, or an event of a known kind
                has a missing or mistyped field.
        """
        try:
            raw = self._batch.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedEventBatchError(f"bad KV-event batch: {exc}") from exc
        events: list[KVEvent] = []
        for index, raw_event in enumerate(raw.events):
            event = self._decode_event(raw_event, index)
            if event is not None:
                events.append(event)
        return KVEventBatch(ts=raw.ts, events=events, dp_rank=raw.dp_rank)

    def _decode_event(self, raw_event: msgspec.Raw, index: int) -> KVEvent | None:
        data = memoryview(raw_event)
        is_map = len(data) > 0 and data[0] in _MAP_HEADERS
        try:
            if is_map:
                return self._mapped.decode(data)
            return self._positional.decode(data).normalised()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            kind = _event_kind(data, is_map)
            if isinstance(kind, str) and kind not in EVENT_KINDS:
                self.unknown_events += 1
                logger.debug("skipping KV event of unknown kind %r", kind)
                return None
            raise MalformedEventBatchError(
                f"bad KV event at events[{index}] (kind {kind!r}): {exc}"
            ) from exc


def _event_kind(data: memoryview, is_map: bool) -> Any:
    """The tag of an event that failed typed decoding, or None when there is none."""
    try:
        generic = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if is_map and isinstance(generic, dict):
        return generic.get("type")
    if isinstance(generic, list) and generic:
        return generic[0]
    return None


# Field order of the positional shape: the struct order of SGLang 0.5.18 (vLLM 0.9 stops at
# lora_id); 0.5.18 appends {"cache_salt": ...} as an eighth item for salted requests only.
_POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def event_kind(event: KVEvent) -> str:
    """The wire tag of ``event``: "BlockStored", "BlockRemoved" or "AllBlocksCleared"."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def encode_positional(batch: KVEventBatch) -> bytes:
    """Encode ``batch`` in the positional shape of SGLang <= 0.5.18 / vLLM 0.9.

    Each event becomes ``[kind, *fields]`` in the field order of SGLang 0.5.18 (a salted
    BlockStored ends with ``{"cache_salt": salt}``); fields added after it (``session_id``,
    ``lora_name``) have no place in that shape and are dropped.
    Used to produce old-shape frames for tests and benchmarks.
    """
    events = []
    for event in batch.events:
        kind = event_kind(event)
        items = [kind, *(getattr(event, name) for name in _POSITIONAL_FIELDS[kind])]
        if isinstance(event, BlockStored) and event.cache_salt is not None:
            items.append({"cache_salt": event.cache_salt})
        events.append(items)
    return msgspec.msgpack.encode([batch.ts, events, batch.dp_rank])


def encode_mapped(batch: KVEventBatch) -> bytes:
    """Encode ``batch`` in the map shape of SGLang 0.5.20+ / current vLLM.

    Fields left at None are omitted, as SGLang's ``omit_defaults`` does.
    """
    events = []
    for event in batch.events:
        fields = {k: v for k, v in msgspec.structs.asdict(event).items() if v is not None}
        events.append({"type": event_kind(event), **fields})
    return msgspec.msgpack.encode([batch.ts, events, batch.dp_rank])
