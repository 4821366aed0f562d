"""Decoding of the KV-cache event batches that SGLang and vLLM publish over ZMQ.

Wire format (SGLang ``sglang/srt/disaggregation/kv_events.py``, vLLM
``vllm/distributed/kv_events.py``; docs/DESIGN.md, "SGLang KV events" and "vLLM KV events"):

- A batch is a msgpack array ``[ts, events, dp_rank]``: ``ts`` is the publisher's
  ``time.time()`` in seconds, ``dp_rank`` the data-parallel (SGLang: attention-DP) rank or nil.
- Each event is ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``, either as a
  positional tagged array (SGLang <= 0.5.18, vLLM 0.9: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, ...]``) or as a map with a
  ``"type"`` key (SGLang 0.5.20+, current vLLM). Unknown map keys and extra trailing items are
  ignored, missing optional fields take their defaults. vLLM's ``extra_keys`` (per block, what
  was mixed into its hash: LoRA name, ``cache_salt``, ...) is kept for the namespaces
  (:func:`~contextpilot_integrations.sync.block_mirror.event_namespace`).
- Block hashes are opaque engine ids (SGLang: signed 64-bit ints; recent vLLM: bytes), never
  recomputed, only brought to one form (:func:`canonical_block_hash`: an int as signed 64
  bits), so a hash published unsigned matches its signed twin.

Errors (the decoder reads whatever arrives on the engine's socket): a frame that is not a batch,
larger than :data:`MAX_PAYLOAD_BYTES`, with more than :data:`MAX_EVENTS_PER_BATCH` events or
nested deeper than msgspec's recursion guard raises :exc:`MalformedEventBatchError` (the caller
counts and drops it); an event that does not decode (a missing or mistyped field, a string over
:data:`MAX_STRING_LENGTH`, too many hashes or token ids) is counted
(:attr:`KVEventDecoder.malformed_events`) and skipped, its batch-mates applied. The limits are
far above what an engine's scheduler step sends.

Public API: :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`,
:class:`KVEventBatch`, :class:`KVEventDecoder`, :exc:`MalformedEventBatchError`,
:func:`canonical_block_hash`, the limits (``MAX_*``).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec

logger = logging.getLogger(__name__)

BlockHash = int | bytes
"""An engine block hash: an int (SGLang, older vLLM) or bytes (vLLM with bytes hashes)."""

TokenId = int | tuple[int, ...]
"""A token id; SGLang's EAGLE bigram pages publish ``(id, next_id)`` pairs instead."""

MEDIUM_GPU = "GPU"
"""The medium assumed when an event carries none (events before SGLang 0.5.9, vLLM GPU)."""

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
"""Largest payload decoded (16 MiB); the subscriber's sockets refuse larger frames outright."""

MAX_EVENTS_PER_BATCH = 100_000
"""Most events in one batch (an engine step emits about one per request in it)."""

MAX_HASHES_PER_EVENT = 1 << 20
"""Most block hashes in one event (1,048,576: a 1M-token chain at page size 1)."""

MAX_TOKENS_PER_EVENT = 1 << 22
"""Most token ids in one event (4,194,304: four 1M-token chains at page size 1)."""

MAX_STRING_LENGTH = 4096
"""Longest ``medium``, ``cache_salt``, ``session_id`` or ``lora_name`` (a rid is at most 512)."""

MAX_EXTRA_KEYS = 64
"""Most extra keys of one block (vLLM: the LoRA name, one pair per image, the salt, digests)."""

_INT64_MIN, _INT64_MAX, _UINT64_SPAN = -(1 << 63), (1 << 63) - 1, 1 << 64

_Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_HASHES_PER_EVENT)]
_Tokens = Annotated[
    list[int | Annotated[tuple[int, ...], msgspec.Meta(max_length=16)]],
    msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT),
]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_STRING_LENGTH)]
_ExtraKeys = Annotated[
    list[Annotated[list[Any], msgspec.Meta(max_length=MAX_EXTRA_KEYS)] | None],
    msgspec.Meta(max_length=MAX_HASHES_PER_EVENT),
]
_BlockSize = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_PER_EVENT)]


def canonical_block_hash(block_hash: object) -> BlockHash:
    """The one form of ``block_hash`` kept inside the mirror.

    An int becomes its signed 64-bit value (SGLang's form: ``2**64 - 5`` and ``-5`` are the
    same hash, as an engine that packs it unsigned and one that packs it signed both mean);
    bytes stay bytes (vLLM's hashes: never compared with ints).

    Raises:
        ValueError: an int outside ``[-2**63, 2**64)``, or neither an int nor bytes (bool
            included).
    """
    kind = type(block_hash)
    if kind is int:
        value: int = block_hash  # type: ignore[assignment]
        if _INT64_MIN <= value <= _INT64_MAX:
            return value
        if _INT64_MAX < value < _UINT64_SPAN:
            return value - _UINT64_SPAN
        raise ValueError(f"block hash {value} does not fit 64 bits")
    if kind is bytes:
        return block_hash  # type: ignore[return-value]
    raise ValueError(f"block hash must be an int or bytes, got {kind.__name__}")


class KVCacheEvent(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    """Base of the three event kinds (map shape; positional events are decoded into these).

    msgspec passes ``frozen`` on to subclasses, but type checkers read each class's own
    keywords (``dataclass_transform``), so every subclass states ``frozen=True`` again."""


class BlockStored(KVCacheEvent, frozen=True, tag="BlockStored"):
    """Consecutive pages stored as one chain.

    ``block_hashes[i]`` is the hash of page i; its parent is ``block_hashes[i - 1]``, and the
    parent of page 0 is ``parent_block_hash`` (None: the page hangs from the root).
    ``token_ids`` holds ``block_size`` ids per page, pages in order. ``cache_salt``
    (SGLang 0.5.18+), ``lora_name`` / ``lora_id`` and vLLM's per-block ``extra_keys`` name the
    cache namespace (tenant, adapter) the chain was stored in.
    """

    block_hashes: _Hashes
    parent_block_hash: BlockHash | None = None
    token_ids: _Tokens = []
    block_size: _BlockSize = 0
    lora_id: int | None = None
    medium: _Text | None = None
    cache_salt: _Text | None = None
    session_id: _Text | None = None
    lora_name: _Text | None = None
    extra_keys: _ExtraKeys | None = None


class BlockRemoved(KVCacheEvent, frozen=True, tag="BlockRemoved"):
    """Pages dropped from ``medium`` (None means GPU)."""

    block_hashes: _Hashes
    medium: _Text | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True, tag="AllBlocksCleared"):
    """The whole prefix cache was reset (SGLang ``RadixCache.reset``, vLLM prefix-cache reset)."""


class _StoredMetadata(msgspec.Struct, gc=False):
    """SGLang 0.5.18's ``BlockStoredMetadata``: a map trailing a salted positional BlockStored."""

    cache_salt: _Text | None = None


class _PositionalBlockStored(KVCacheEvent, frozen=True, array_like=True, tag="BlockStored"):
    """``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, metadata]``;
    ``metadata`` (``{"cache_salt": ...}``) only in SGLang 0.5.18 for salted requests."""

    block_hashes: _Hashes
    parent_block_hash: BlockHash | None = None
    token_ids: _Tokens = []
    block_size: _BlockSize = 0
    lora_id: int | None = None
    medium: _Text | None = None
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
    block_hashes: _Hashes
    medium: _Text | None = None

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
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    dp_rank: int | None = None


class _MapKind(msgspec.Struct, gc=False):
    """The tag of a map event that failed typed decoding (other keys are skipped unread)."""

    type: _Text | None = None


class _ArrayKind(msgspec.Struct, array_like=True, gc=False):
    """The tag of a positional event that failed typed decoding (the rest is skipped)."""

    kind: _Text | None = None


class MalformedEventBatchError(ValueError):
    """A payload that is not a KV-event batch in either wire shape (or breaks a limit).

    The message names the failing field (msgspec's path, e.g. ``$[1]``) and the cause.
    """


# msgpack type bytes that start a map: fixmap 0x80-0x8f, map16 0xde, map32 0xdf.
_MAP_HEADERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


class KVEventDecoder:
    """Decodes msgpack payloads of either wire shape into :class:`KVEventBatch`.

    One instance per thread (msgspec decoders hold no shared state, but reuse saves setup).
    An event that does not decode is skipped, so that the rest of its batch still applies:
    counted in :attr:`unknown_events` when it names a kind not in :data:`EVENT_KINDS` (a newer
    engine), else in :attr:`malformed_events` (logged, the first 10 at warning level).
    """

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._positional = msgspec.msgpack.Decoder(
            _PositionalBlockStored | _PositionalBlockRemoved | _PositionalAllBlocksCleared
        )
        self._mapped = msgspec.msgpack.Decoder(KVEvent)
        self._map_kind = msgspec.msgpack.Decoder(_MapKind)
        self._array_kind = msgspec.msgpack.Decoder(_ArrayKind)
        self.unknown_events = 0
        self.malformed_events = 0

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        """Decode one payload.

        Args:
            payload: the third frame of a published message.

        Returns:
            the batch, its decodable events in publication order.

        Raises:
            MalformedEventBatchError: the payload is not a batch, or breaks a limit of the
                module docstring (size, event count, nesting depth). An event that does not
                decode never raises: it is counted and skipped.
        """
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise MalformedEventBatchError(
                f"bad KV-event batch: {len(payload)} bytes, more than {MAX_PAYLOAD_BYTES}"
            )
        try:
            raw = self._batch.decode(payload)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise MalformedEventBatchError(f"bad KV-event batch: {exc}") from exc
        except RecursionError as exc:
            raise MalformedEventBatchError(
                "bad KV-event batch: nested deeper than the decoder's recursion limit"
            ) from exc
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
        except (msgspec.DecodeError, RecursionError) as exc:
            kind = self._kind(data, is_map)
            if kind is not None and kind not in EVENT_KINDS:
                self.unknown_events += 1
                logger.debug("skipping KV event of unknown kind %r", kind)
                return None
            self.malformed_events += 1
            cause = str(exc) if isinstance(exc, msgspec.DecodeError) else "nested too deep"
            logger.log(
                logging.WARNING if self.malformed_events <= 10 else logging.DEBUG,
                "skipping malformed KV event at events[%d] (kind %r): %s",
                index,
                kind,
                cause,
            )
            return None

    def _kind(self, data: memoryview, is_map: bool) -> str | None:
        """The tag of an event that failed typed decoding; None when it has no string tag."""
        try:
            if is_map:
                return self._map_kind.decode(data).type
            return self._array_kind.decode(data).kind
        except (msgspec.DecodeError, RecursionError):
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
