"""A request's distinct context blocks: ids and tokens, with its duplicates and skipped inputs.

The first step of planning (docs/DESIGN.md, "The flow of one request"): each input text is a
context block unless it is empty or whitespace only (skipped: handed back, never lost,
docs/DESIGN.md, "Lossless"); a text identical to an earlier one of the same request is a
duplicate of that one; the rest are the distinct blocks the index and the ordering see, in
input order.

Public API: :class:`RequestBlocks`, :func:`distinct_blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contextpilot_integrations.core.request import is_block_text

__all__ = ["RequestBlocks", "distinct_blocks"]


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """A request's distinct block texts (input order) with their ids, tokens and input index,
    the duplicates (input index -> input index of the first identical text) and the skipped
    inputs (empty or whitespace only).

    Two maps of the same blocks come with them, made once here for every later step of the
    plan (docs/DESIGN.md, "Hot path"): ``positions`` (block id -> its position in ``ids``)
    and ``weights`` (block id -> its tokens, in ``ids`` order: what the index search reads)."""

    texts: list[str]
    ids: list[int]
    tokens: list[int]
    indices: list[int]
    duplicates: dict[int, int]
    skipped: list[int]
    positions: dict[int, int]
    weights: dict[int, int]


def distinct_blocks(
    blocks: Sequence[str], identify: Callable[[str], tuple[int, int]]
) -> RequestBlocks:
    """Split a request's input ``blocks`` into distinct blocks, duplicates and skipped inputs.

    Args:
        blocks: the request's block texts in retriever order.
        identify: text -> ``(block id, tokens)``; two texts are the same block when their ids
            are equal.
    """
    if "" not in blocks and not any(map(str.isspace, blocks)):
        # Every input is a block (:func:`.request.is_block_text`): identified in one pass
        # with no per-block Python step; a repeated block sends it to the general walk.
        identified = list(map(identify, blocks))
        ids = [bid for bid, _ in identified]
        positions = dict(zip(ids, range(len(ids))))
        if len(positions) == len(ids):
            tokens = [count for _, count in identified]
            return RequestBlocks(
                list(blocks),
                ids,
                tokens,
                list(range(len(ids))),
                {},
                [],
                positions,
                dict(zip(ids, tokens)),
            )
    texts: list[str] = []
    ids = []
    tokens = []
    indices: list[int] = []
    positions = {}
    duplicates: dict[int, int] = {}
    skipped: list[int] = []
    for index, text in enumerate(blocks):
        if not is_block_text(text):
            skipped.append(index)
            continue
        bid, count = identify(text)
        first = positions.get(bid)
        if first is not None:
            duplicates[index] = indices[first]
            continue
        positions[bid] = len(ids)
        texts.append(text)
        ids.append(bid)
        tokens.append(count)
        indices.append(index)
    return RequestBlocks(
        texts, ids, tokens, indices, duplicates, skipped, positions, dict(zip(ids, tokens))
    )
