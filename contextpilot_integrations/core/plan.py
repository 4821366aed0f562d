"""What the planner returns: per input block, where it went; the prompt; a batch's schedule.

A :class:`Plan` says, for every block the request gave, one :class:`Placement`: shown in the
prompt at a position under a label, a duplicate of an earlier identical input, replaced by a
location hint (its identical text already stands in an earlier turn of the conversation), or
skipped (empty text). Adapters only map placements to their framework's objects, in the one
order :meth:`Plan.output_order` gives: shown blocks in prompt order, then replaced blocks in
the order of their hints, then duplicates, then skipped inputs (each group by input index).

Nothing is lost (docs/DESIGN.md, "Lossless"): every input index has exactly one placement.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from typing import Any, TypeVar

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import Scope

__all__ = ["BatchPlan", "DedupFigures", "Placement", "PlacementStatus", "Plan"]

T = TypeVar("T")


class PlacementStatus(str, Enum):
    """Where an input block went (compares equal to its string value)."""

    SHOWN = "shown"
    """Rendered in the prompt (possibly with repeated sub-blocks replaced by pointers)."""
    REPLACED = "replaced"
    """Replaced by a location hint to where its identical text already stands."""
    DUPLICATE = "duplicate"
    """The same text as an earlier input of this request, which stands for it."""
    SKIPPED = "skipped"
    """Empty or whitespace only: not a context block, not planned."""


_OUTPUT_GROUP = {
    PlacementStatus.SHOWN: 0,
    PlacementStatus.REPLACED: 1,
    PlacementStatus.DUPLICATE: 2,
    PlacementStatus.SKIPPED: 3,
}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one input block went.

    Attributes:
        index: 0-based position in the request's blocks (the retriever's rank).
        status: a :class:`PlacementStatus`.
        text: the input text, as given.
        block_id: stable unsigned 64-bit id of ``text`` (``core.blocks.block_id``); ``None``
            when skipped.
        tokens: token length of ``text`` by the planner's counter (0 when skipped).
        position: shown: 0-based position among the prompt's blocks; replaced: 0-based
            position of its hint among the prompt's hints; otherwise ``None``.
        label: shown: the block's label in the prompt (``"[Doc 2]"``); otherwise ``None``.
        rendered_text: shown: what the prompt shows (``text``, or ``text`` with sub-blocks
            already shown earlier in the conversation replaced by pointers); otherwise ``None``.
        hint: replaced: the location hint the prompt shows instead; otherwise ``None``.
        duplicate_of: duplicate: ``index`` of the earlier input with the same text; otherwise
            ``None``.
    """

    index: int
    status: PlacementStatus
    text: str
    block_id: int | None = None
    tokens: int = 0
    position: int | None = None
    label: str | None = None
    rendered_text: str | None = None
    hint: str | None = None
    duplicate_of: int | None = None

    @classmethod
    def shown_blocks(
        cls,
        indices: Sequence[int],
        texts: Sequence[str],
        block_ids: Sequence[int],
        tokens: Sequence[int],
        labels: Sequence[str],
    ) -> list[Placement]:
        """The placements of blocks shown as given, in prompt order: the ``i``-th is equal to
        ``Placement(indices[i], PlacementStatus.SHOWN, texts[i], block_ids[i], tokens[i], i,
        labels[i], texts[i])``. Made slot by slot over all of them, one C loop per slot,
        where the frozen ``__init__`` sets each field of each placement by a Python call to
        ``object.__setattr__`` (docs/DESIGN.md, "Hot path"); the placements are the same
        values."""
        count = len(indices)
        placements = list(map(_new_object, repeat(cls, count)))
        columns: tuple[Iterable[Any], ...] = (
            indices,
            repeat(PlacementStatus.SHOWN),
            texts,
            block_ids,
            tokens,
            range(count),
            labels,
            texts,
            repeat(None),
            repeat(None),
        )
        for setter, column in zip(_SETTERS, columns):
            _SINK.extend(map(setter, placements, column))
        return placements

    @property
    def shown(self) -> bool:
        """Whether the prompt shows the block."""
        return self.status is PlacementStatus.SHOWN

    @property
    def prompt_text(self) -> str | None:
        """What the prompt shows for this input: the rendered text, the hint, or ``None``
        (duplicate, skipped)."""
        return self.rendered_text if self.rendered_text is not None else self.hint


_new_object = object.__new__
_SINK: deque[None] = deque(maxlen=0)  # runs an iterator for its effects
_SETTERS = tuple(
    getattr(Placement, name).__set__
    for name in (
        "index",
        "status",
        "text",
        "block_id",
        "tokens",
        "position",
        "label",
        "rendered_text",
        "hint",
        "duplicate_of",
    )
)


@dataclass(frozen=True, slots=True)
class DedupFigures:
    """One request's multi-turn de-duplication figures (all zero savings without a
    conversation).

    Attributes:
        blocks_kept: blocks the prompt shows.
        blocks_replaced: blocks replaced by a hint.
        sub_blocks_replaced: sub-blocks replaced by pointers inside shown blocks.
        tokens_in: tokens of the distinct input blocks.
        tokens_saved: tokens the replacements saved (by the planner's counter).
    """

    blocks_kept: int = 0
    blocks_replaced: int = 0
    sub_blocks_replaced: int = 0
    tokens_in: int = 0
    tokens_saved: int = 0


@dataclass(frozen=True, init=False)
class Plan:
    """What to send for one request.

    Attributes:
        rid: request id for the engine (SGLang ``rid``, vLLM ``request_id``, ``session_id``;
            :mod:`contextpilot_integrations.llm_call.engine_fields`).
        query: the question.
        scope: the request's scope, with ``turn`` set to the number the turn was planned as
            (``None`` without a conversation).
        placements: one :class:`Placement` per input block, in input order.
        hints: the location hints in prompt order (rendered after the blocks).
        segments: ``[system, block 1, ..., block n, tail]``; ``prompt`` is their join.
        annotation_labels: how the order annotation names the blocks, highest relevance
            first (empty when the prompt already shows relevance order or annotation is off).
        matched_prefix_blocks: blocks of the prefix the index already held.
        matched_prefix_tokens: their tokens.
        shared_prefix_blocks: leading shown blocks that another indexed request also starts
            with, once this plan (and the rest of its batch) was indexed: where the prefix a
            cache can reuse ends (a hosted API's cache breakpoint goes after it).
        shared_prefix_tokens: their tokens (the planner's counter).
        dedup_figures: the request's :class:`DedupFigures`.
        layout: the layout that rendered the plan.
        cache_salt: the engine's ``cache_salt`` for this request's tenant (its prefix cache is
            not shared with other salts), or ``None`` (``engine_fields.engine_body_fields``
            sends it).
        replica: with several engine replicas, the name of the one the request was planned
            for (:class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`); else
            ``None``.
        routing_key: the key a gateway routes the request to that replica by (sent in a
            header: ``engine_fields.engine_headers``), or ``None``.
        base_url: the replica's own OpenAI-compatible base URL, for apps that call the
            replicas without a gateway (``engine_fields.engine_base_url``), or ``None``.
    """

    rid: str
    query: str
    scope: Scope
    placements: tuple[Placement, ...]
    hints: tuple[str, ...]
    segments: tuple[str, ...]
    annotation_labels: tuple[str, ...]
    matched_prefix_blocks: int
    matched_prefix_tokens: int
    shared_prefix_blocks: int
    shared_prefix_tokens: int
    dedup_figures: DedupFigures
    layout: PromptLayout = field(repr=False)
    cache_salt: str | None = None
    replica: str | None = None
    routing_key: str | None = None
    base_url: str | None = None

    def __init__(
        self,
        rid: str,
        query: str,
        scope: Scope,
        placements: tuple[Placement, ...],
        hints: tuple[str, ...],
        segments: tuple[str, ...],
        annotation_labels: tuple[str, ...],
        matched_prefix_blocks: int,
        matched_prefix_tokens: int,
        shared_prefix_blocks: int,
        shared_prefix_tokens: int,
        dedup_figures: DedupFigures,
        layout: PromptLayout,
        cache_salt: str | None = None,
        replica: str | None = None,
        routing_key: str | None = None,
        base_url: str | None = None,
    ) -> None:
        # The fields set in one step, where the frozen dataclass's own ``__init__`` calls
        # ``object.__setattr__`` once per field (docs/DESIGN.md, "Hot path"); the same values.
        self.__dict__.update(
            rid=rid,
            query=query,
            scope=scope,
            placements=placements,
            hints=hints,
            segments=segments,
            annotation_labels=annotation_labels,
            matched_prefix_blocks=matched_prefix_blocks,
            matched_prefix_tokens=matched_prefix_tokens,
            shared_prefix_blocks=shared_prefix_blocks,
            shared_prefix_tokens=shared_prefix_tokens,
            dedup_figures=dedup_figures,
            layout=layout,
            cache_salt=cache_salt,
            replica=replica,
            routing_key=routing_key,
            base_url=base_url,
        )

    # ------------------------------------------------------------------ the prompt
    @property
    def prompt(self) -> str:
        """The plain-text prompt (``"".join(segments)``)."""
        return "".join(self.segments)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat form: system message, then one user message."""
        return self.layout.messages_from_segments(self.segments)

    @property
    def context_tail(self) -> str:
        """Hints and order annotation: the tail without the question (for adapters that
        render the question themselves)."""
        return self.layout.context_tail(annotation_labels=self.annotation_labels, hints=self.hints)

    @property
    def context(self) -> str:
        """Everything but the system prompt and the question: blocks, hints, annotation."""
        return "".join(self.segments[1:-1]) + self.context_tail

    # ------------------------------------------------------------------ placements
    @functools.cached_property
    def blocks(self) -> tuple[Placement, ...]:
        """The shown blocks, in prompt order."""
        shown = [p for p in self.placements if p.status is PlacementStatus.SHOWN]
        shown.sort(key=lambda p: p.position)  # type: ignore[arg-type, return-value]
        return tuple(shown)

    def output_order(self) -> list[Placement]:
        """Every placement in the order adapters return their objects: shown (prompt order),
        replaced (hint order), duplicates, skipped (input order)."""
        return sorted(
            self.placements,
            key=lambda p: (
                _OUTPUT_GROUP[p.status],
                p.position if p.position is not None else p.index,
            ),
        )

    @property
    def order(self) -> list[int]:
        """Input indices of the shown blocks, in prompt order."""
        return [p.index for p in self.blocks]

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the shown blocks' input texts (system prompt and tail not counted)."""
        return sum(p.tokens for p in self.blocks)

    def reorder(self, items: Sequence[T]) -> list[T]:
        """``items`` (one per input block, in input order) in prompt order, shown blocks only.

        Raises:
            ValueError: ``items`` has another length than the request's blocks.
        """
        if len(items) != len(self.placements):
            raise ValueError(
                f"items has {len(items)} entries, the plan was made for {len(self.placements)}"
            )
        return [items[i] for i in self.order]


@dataclass(frozen=True)
class BatchPlan:
    """Plans for a batch, in input order, and the order to send them in.

    Attributes:
        plans: one :class:`Plan` per input request, in input order.
        schedule: indices into ``plans`` in execution order (a permutation).
    """

    plans: tuple[Plan, ...]
    schedule: tuple[int, ...]

    def scheduled(self) -> list[Plan]:
        """The plans in execution order."""
        return [self.plans[i] for i in self.schedule]

    @functools.cached_property
    def schedule_positions(self) -> tuple[int, ...]:
        """``schedule_positions[i]``: where ``plans[i]`` runs in the schedule (0 first)."""
        positions = [0] * len(self.schedule)
        for position, index in enumerate(self.schedule):
            positions[index] = position
        return tuple(positions)
