"""A page's token ids as a lookup key: packed 8-byte ints, or a tuple where ids do not fit.

The mirror's token index (:mod:`~contextpilot_integrations.sync.block_mirror`) and the request
attribution (:mod:`~contextpilot_integrations.sync.request_attribution`) key pages the same
way, so that a request's page and a stored page with the same ids meet. Packed ints take far
less memory than tuples of Python ints, which matters at a million blocks
(``benchmarks/micro/bench_mirror_memory.py`` measures it).

Public API: :data:`PageKey`, :data:`PackedTokens`, :func:`pack_tokens`, :func:`packed_length`,
:func:`packed_page`, :func:`page_tokens`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PackedTokens",
    "PageKey",
    "pack_tokens",
    "packed_length",
    "packed_page",
    "page_tokens",
]

PageKey = bytes | tuple[Any, ...]
"""The token ids of one page as a lookup key: packed as 8-byte signed ints (:func:`pack_tokens`)
when every id is an int that fits, else a tuple (SGLang's EAGLE pages publish ``(id, next)``
pairs). The same ids always give the same key."""

PackedTokens = bytes | tuple[Any, ...]
"""A request's or an event's token ids, packed as :func:`pack_tokens` does."""

_INT_WIDTH = array("q").itemsize


def pack_tokens(token_ids: Sequence[Any]) -> PackedTokens:
    """``token_ids`` as 8-byte ints (``bytes``), or as a tuple when one is not an int that fits
    (EAGLE pairs stay tuples, other ids become ints).

    Raises:
        TypeError, ValueError: an id that is neither an int-like nor a tuple of int-likes.
    """
    try:
        return array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        return tuple(
            tuple(int(i) for i in t) if isinstance(t, tuple) else int(t) for t in token_ids
        )


def packed_length(packed: PackedTokens) -> int:
    """The number of token ids in ``packed``."""
    return len(packed) // _INT_WIDTH if isinstance(packed, bytes) else len(packed)


def packed_page(packed: PackedTokens, size: int, index: int) -> PageKey:
    """The key of page ``index`` (``size`` tokens each) of ``packed``."""
    if isinstance(packed, bytes):
        width = size * _INT_WIDTH
        return packed[index * width : (index + 1) * width]
    page = packed[index * size : (index + 1) * size]
    try:
        return array("q", page).tobytes()  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        return page


def page_tokens(key: PageKey) -> list[Any]:
    """The token ids of a page key, as a list."""
    if isinstance(key, bytes):
        return array("q", key).tolist()
    return list(key)
