"""Where each of a request's inputs goes in its prompt, once the blocks are ordered.

A distinct block is shown (its label in prompt order, its text, or its text with repeated
sub-blocks replaced by pointers) or, in a conversation, replaced by a hint to an earlier turn
that still shows it (:mod:`.dedup`); a repeated input is a duplicate of its first occurrence;
an empty one is skipped. Every input gets exactly one :class:`~.plan.Placement`
(docs/DESIGN.md, "Lossless"). The conversation turn the de-duplication records waits in
:class:`PendingTurns` until the planning call completes.

Public API: :func:`place_blocks`, :class:`PlacedBlocks`, :class:`PendingTurns`,
:class:`DeferredTurns`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from contextpilot_integrations.core.blocks import TokenCounter
from contextpilot_integrations.core.conversations.conversation_turn import ConversationTurn
from contextpilot_integrations.core.conversations.dedup import Deduplicator
from contextpilot_integrations.core.plan import DedupFigures, Placement, PlacementStatus
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.core.request_blocks import RequestBlocks

__all__ = ["DeferredTurns", "PendingTurns", "PlacedBlocks", "place_blocks"]


class PendingTurns:
    """The conversation turns one call records: committed when the call completes, aborted
    when it raises, so a failed plan or batch records nothing (no phantom turns). Inside
    :meth:`DeferredTurns.collecting` a completed call hands its turns to the collector
    instead, which commits them only once the plan has reached its caller."""

    def __init__(self) -> None:
        self._pending: list[ConversationTurn] = []

    def add(self, turn: ConversationTurn | None) -> None:
        if turn is not None:
            self._pending.append(turn)

    def __enter__(self) -> PendingTurns:
        return self

    def __exit__(self, error_type: object, error: object, traceback: object) -> None:
        collector = _COLLECTOR.get()
        for turn in self._pending:
            if error_type is not None:
                turn.abort()
            elif collector is not None:
                collector.turns.append(turn)
            else:
                turn.commit()


class DeferredTurns:
    """Turns planned in a worker thread for a coroutine, committed on its event loop once the
    coroutine has its plan (:meth:`commit`), or aborted if it was cancelled first
    (:meth:`abort`): a cancelled or timed-out ``aplan`` records no turn that a later hint
    could point to. Thread-safe: each call is made once, after the worker has finished."""

    def __init__(self) -> None:
        self.turns: list[ConversationTurn] = []

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Within this block (in the worker thread), completed plans defer their turns here."""
        token = _COLLECTOR.set(self)
        try:
            yield
        finally:
            _COLLECTOR.reset(token)

    def commit(self) -> None:
        for turn in self.turns:
            turn.commit()

    def abort(self) -> None:
        for turn in self.turns:
            turn.abort()


_COLLECTOR: contextvars.ContextVar[DeferredTurns | None] = contextvars.ContextVar(
    "contextpilot_deferred_turns", default=None
)


@dataclass(frozen=True, slots=True)
class PlacedBlocks:
    """The placements of one request.

    Attributes:
        placements: one per input, in input order.
        shown: the shown placements, in prompt order (each with its ``rendered_text``).
        rendered: what the prompt shows of each shown block (its ``rendered_text``), in
            prompt order.
        shown_indices: the input index of each shown block, in prompt order.
        hints: the hints replacing blocks, in prompt order.
        references: input index -> how the order annotation names it (a label, or where
            an earlier turn shows it), for the distinct blocks.
        figures: the de-duplication figures.
        scope: the request's scope, with the turn the conversation gave it.
        as_given: when every shown block shows its input text (no sub-block pointer), the
            shown blocks' ids and tokens (the input's), in prompt order; otherwise ``None``.
    """

    placements: tuple[Placement, ...]
    shown: list[Placement]
    rendered: list[str]
    shown_indices: list[int]
    hints: list[str]
    references: dict[int, str]
    figures: DedupFigures
    scope: Scope
    as_given: tuple[Sequence[int], list[int]] | None


def place_blocks(
    request: PlanRequest,
    blocks: RequestBlocks,
    order: Sequence[int],
    layout: PromptLayout,
    deduplicator: Deduplicator,
    turns: PendingTurns,
    token_counter: TokenCounter | None = None,
) -> PlacedBlocks:
    """Place ``request``'s inputs with its distinct ``blocks`` in ``order`` (block ids, a
    permutation of ``blocks.ids``); in a conversation, de-duplicate them against its earlier
    turns (the turn recorded joins ``turns``), counting with ``token_counter`` (the one
    ``blocks.tokens`` come from; default the deduplicator's)."""
    at = blocks.positions
    aligned = [at[bid] for bid in order]  # distinct-block positions in prompt order
    placements: list[Placement | None] = [None] * len(request.blocks)
    references: dict[int, str] = {}  # input index -> how the annotation names it
    shown: list[Placement] = []  # in prompt order
    hints: list[str] = []
    scope = request.scope

    def show(p: int, rendered: str) -> None:
        index = blocks.indices[p]
        placement = Placement(
            index,
            PlacementStatus.SHOWN,
            blocks.texts[p],
            blocks.ids[p],
            blocks.tokens[p],
            position=len(shown),
            label=layout.label(len(shown)),
            rendered_text=rendered,
        )
        placements[index] = placement
        shown.append(placement)

    if scope.conversation_id is None:
        # Every block is shown as given, each input's column read in prompt order in one map
        # (docs/DESIGN.md, "Hot path").
        texts, tokens, indices = blocks.texts, blocks.tokens, blocks.indices
        labels = layout.labels(len(aligned))
        shown_indices = list(map(indices.__getitem__, aligned))
        rendered = list(map(texts.__getitem__, aligned))
        shown_tokens = list(map(tokens.__getitem__, aligned))
        shown = Placement.shown_blocks(shown_indices, rendered, order, shown_tokens, labels)
        for index, placement in zip(shown_indices, shown):
            placements[index] = placement
        references = dict(zip(shown_indices, labels))
        figures = DedupFigures(len(shown), 0, 0, sum(tokens), 0)
        as_given: tuple[Sequence[int], list[int]] | None = (order, shown_tokens)
    else:
        dedup = deduplicator.plan(
            scope.tenant,
            scope.conversation_id,
            [blocks.texts[p] for p in aligned],
            turn=scope.turn,
            visibility=scope.visibility,
            block_ids=list(order),
            block_tokens=[blocks.tokens[p] for p in aligned],
            token_counter=token_counter,
        )
        turns.add(dedup.pending)
        given = True
        for p, decision in zip(aligned, dedup.blocks):
            index = blocks.indices[p]
            references[index] = decision.reference
            if decision.text is not None:
                show(p, decision.text)
                given = given and decision.text == blocks.texts[p]
                continue
            placements[index] = Placement(
                index,
                PlacementStatus.REPLACED,
                blocks.texts[p],
                blocks.ids[p],
                blocks.tokens[p],
                position=len(hints),
                hint=decision.hint,
            )
            hints.append(decision.hint or "")
        figures = DedupFigures(
            dedup.blocks_kept,
            dedup.blocks_replaced,
            dedup.sub_blocks_replaced,
            dedup.tokens_in,
            dedup.tokens_saved,
        )
        scope = Scope(scope.conversation_id, scope.tenant, dedup.turn, scope.visibility)
        rendered = [p.rendered_text or "" for p in shown]
        shown_indices = [p.index for p in shown]
        as_given = ([p.block_id or 0 for p in shown], [p.tokens for p in shown]) if given else None
    for index, first in blocks.duplicates.items():
        original = placements[first]
        assert original is not None
        placements[index] = Placement(
            index,
            PlacementStatus.DUPLICATE,
            original.text,
            original.block_id,
            original.tokens,
            duplicate_of=first,
        )
    for index in blocks.skipped:
        placements[index] = Placement(index, PlacementStatus.SKIPPED, request.blocks[index])
    return PlacedBlocks(
        # Every input has its placement now; a placement is always true, so the filter (a C
        # loop) only narrows the type.
        tuple(filter(None, placements)),
        shown,
        rendered,
        shown_indices,
        hints,
        references,
        figures,
        scope,
        as_given,
    )
