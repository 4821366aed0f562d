"""The JSON form of a context index's snapshot, checked entry by entry on the way in.

:meth:`~contextpilot_integrations.core.index.context_index.ContextIndex.snapshot` writes
``{"version": 1, "requests": [{"rid": str, "blocks": [decimal str, ...], "tokens": [int, ...]},
...]}``, least recently used first; a snapshot file is input like any other (a crashed write,
a hand edit, a hostile file), so :func:`checked_entries` validates all of it before anything is
loaded.
"""

from __future__ import annotations

__all__ = ["INDEX_SNAPSHOT_VERSION", "checked_entries"]

INDEX_SNAPSHOT_VERSION = 1
"""Version of a context index's snapshot format (``ContextIndex.snapshot``)."""


def checked_entries(snapshot: object) -> list[tuple[str, list[int], list[int]]]:
    """The ``(rid, block ids, tokens)`` of each entry of a :meth:`ContextIndex.snapshot`.

    Raises:
        ValueError: an unknown version or a malformed entry (named by its index): a rid that is
            not a str of 1..512 characters, blocks that are not distinct decimal strings in
            ``0..2**64-1``, token counts that are not ints in ``0..2**32``, lengths that differ.
    """
    if not isinstance(snapshot, dict) or snapshot.get("version") != INDEX_SNAPSHOT_VERSION:
        found = snapshot.get("version") if isinstance(snapshot, dict) else type(snapshot).__name__
        raise ValueError(f"snapshot version must be {INDEX_SNAPSHOT_VERSION}, got {found!r:.40}")
    requests = snapshot.get("requests", [])
    if not isinstance(requests, list):
        raise ValueError(f"snapshot requests must be a list, got {type(requests).__name__}")
    entries = []
    for i, entry in enumerate(requests):
        try:
            rid, raw_blocks, raw_tokens = entry["rid"], entry["blocks"], entry["tokens"]
            if not isinstance(rid, str) or not 0 < len(rid) <= 512:
                raise ValueError(f"rid must be a str of 1..512 characters, got {rid!r:.40}")
            if not isinstance(raw_blocks, list) or not isinstance(raw_tokens, list):
                raise ValueError("blocks and tokens must be lists")
            if not raw_blocks or len(raw_blocks) != len(raw_tokens):
                raise ValueError("blocks must be non-empty, with one token count each")
            blocks = [
                int(b) if isinstance(b, str) and b.isascii() and b.isdigit() else -1
                for b in raw_blocks
            ]
            if any(not 0 <= b < 2**64 for b in blocks) or len(set(blocks)) != len(blocks):
                raise ValueError("block ids must be distinct decimal strings in 0..2**64-1")
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= 2**32
                for t in raw_tokens
            ):
                raise ValueError("token counts must be ints in 0..2**32")
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed snapshot entry requests[{i}]: {error}") from None
        entries.append((rid, blocks, list(raw_tokens)))
    return entries


def _block_id(value: object) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return -1  # refused by the range check
