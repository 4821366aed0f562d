"""Request and response bodies of the index service (pydantic models, JSON on the wire).

The models mirror the in-process API of
:class:`~contextpilot_integrations.core.pilot.ContextPilot`: a ``PlanRequest`` carries the
arguments of ``plan(...)``, a ``PlanResponse`` every field of the core's ``Plan`` (its layout
is served once, by ``GET /v1/layout``), so that
:class:`~contextpilot_integrations.service.client.ContextPilotClient` rebuilds the core's own
dataclasses. Wire conventions:

- block ids are unsigned 64-bit integers sent as decimal strings (JSON numbers above 2**53 lose
  precision in many JSON readers);
- ``PlannedBlock.rendered_text`` is ``null`` when it equals ``text`` (the usual case; it halves
  the payload);
- maps keyed by an input index (``duplicates``, ``replaced``) have string keys, as JSON objects
  must.

Every error body is an :class:`ErrorResponse` whose ``message`` names the field and the value.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import (
    MAX_BLOCKS_PER_REQUEST,
    BatchPlan,
    Plan,
    PlannedBlock,
)
from contextpilot_integrations.core.rendering import PromptLayout

MAX_BATCH_REQUESTS = 10_000
"""Most requests in one ``plan_batch`` call."""

MAX_ID_CHARS = 512
"""Longest rid, conversation id or tenant, in characters."""

MAX_TURN = 2**31 - 1
"""Largest turn number accepted."""


def _utf8_encodable(value: str) -> str:
    # JSON allows lone surrogates ("\ud800"); they cannot be hashed or rendered as UTF-8, so
    # they are refused here, with the field's name, instead of failing deep in the core.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text must be encodable as UTF-8 (no lone surrogates); "
                f"{value[exc.start : exc.end]!r} at character {exc.start}"
            ) from None
    return value


def _integral_number(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; strict validation would refuse it.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers: JSON 1.0 is taken as 1; true, "1" and 1.5 are refused.
TurnNumber = Annotated[int, Field(ge=0, le=MAX_TURN), BeforeValidator(_integral_number)]
TokenCount = Annotated[int, Field(ge=0, le=2**62), BeforeValidator(_integral_number)]


Text = Annotated[str, AfterValidator(_utf8_encodable)]
"""A string that UTF-8 can encode."""

Identifier = Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_utf8_encodable)
]
"""A non-empty id (rid, conversation id) of at most :data:`MAX_ID_CHARS` characters."""

Tenant = Annotated[str, Field(max_length=MAX_ID_CHARS), AfterValidator(_utf8_encodable)]

BlockText = Annotated[str, Field(pattern=r"[^\s\x1c-\x1f]"), AfterValidator(_utf8_encodable)]
"""A block: at least one character that is not whitespace (``str.isspace``)."""

Blocks = Annotated[list[BlockText], Field(max_length=MAX_BLOCKS_PER_REQUEST)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class LastTurns(_Strict):
    """Only the ``last`` turns before this one are still in the app's prompt."""

    last: TurnNumber


class OnlyTurns(_Strict):
    """Only these earlier turns are still in the app's prompt (others were dropped)."""

    turns: Annotated[list[TurnNumber], Field(max_length=10_000)]


Visibility = LastTurns | OnlyTurns
"""Which earlier turns the app's prompt still holds (``null``: every earlier turn)."""


def visibility_to_core(visibility: Visibility | None) -> TurnVisibility | None:
    """The core's :class:`TurnVisibility` (None: all turns)."""
    if isinstance(visibility, LastTurns):
        return TurnVisibility.last(visibility.last)
    if isinstance(visibility, OnlyTurns):
        return TurnVisibility.only(visibility.turns)
    return None


def visibility_from_core(visibility: TurnVisibility) -> dict[str, Any] | None:
    """The JSON form of the core's :class:`TurnVisibility` (None: all turns)."""
    if visibility.last_turns is not None:
        return {"last": visibility.last_turns}
    if visibility.turns is not None:
        return {"turns": sorted(visibility.turns)}
    return None


class PlanRequest(_Strict):
    """Arguments of ``ContextPilot.plan``."""

    query: Text = Field(description="The question (may be empty).")
    blocks: Blocks = Field(description="Block texts in retriever (relevance) order.")
    rid: Identifier | None = Field(None, description="Request id; a new one when null.")
    conversation_id: Identifier | None = Field(
        None, description="Conversation for multi-turn de-duplication; null: none."
    )
    tenant: Tenant = Field("", description="Owner of the conversation.")
    turn: TurnNumber | None = Field(
        None, description="Turn number; null: one after the conversation's latest."
    )
    visibility: Visibility | None = Field(
        None, description="Earlier turns the app's prompt still holds; null: all."
    )


class BatchItem(_Strict):
    """One request of a batch (the arguments of ``plan`` but the rid, which the batch's
    ``plan_batch`` takes for all its requests or none; a missing one gets a new id)."""

    query: Text
    blocks: Blocks
    rid: Identifier | None = None
    conversation_id: Identifier | None = None
    tenant: Tenant = ""
    turn: TurnNumber | None = None
    visibility: Visibility | None = None


class PlanBatchRequest(_Strict):
    """Arguments of ``ContextPilot.plan_batch``, one item per request."""

    requests: Annotated[list[BatchItem], Field(max_length=MAX_BATCH_REQUESTS)]


class EvictRequest(_Strict):
    """Drop one request from the index."""

    rid: Identifier


class ForgetConversationRequest(_Strict):
    """Drop a conversation's de-duplication records (the user deleted it)."""

    conversation_id: Identifier
    tenant: Tenant = ""


class UsageReport(_Strict):
    """Token usage the engine reported for a planned request (OpenAI ``usage``)."""

    rid: Identifier
    prompt_tokens: TokenCount
    cached_tokens: TokenCount

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> UsageReport:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        return self


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class PlannedBlockModel(BaseModel):
    """One block of a plan, in prompt order (see the core's ``PlannedBlock``)."""

    text: str
    block_id: str = Field(description="Unsigned 64-bit block id, as a decimal string.")
    original_rank: int
    tokens: int
    rendered_text: str | None = Field(None, description="What the prompt shows; null: text.")


class PlanResponse(BaseModel):
    """Every field of the core's ``Plan`` except its layout (``GET /v1/layout``)."""

    rid: str
    query: str
    blocks: list[PlannedBlockModel]
    order: list[int]
    duplicates: dict[int, int]
    replaced: dict[int, str]
    hints: list[str]
    segments: list[str]
    matched_prefix_blocks: int
    matched_prefix_tokens: int
    conversation_id: str | None
    tenant: str
    turn: int | None
    dedup: dict[str, int]
    annotation_labels: list[str]

    @staticmethod
    def encode(plan: Plan) -> dict[str, Any]:
        """The JSON-ready dict of ``plan`` (no validation: the core built it)."""
        return {
            "rid": plan.rid,
            "query": plan.query,
            "blocks": [
                {
                    "text": b.text,
                    "block_id": str(b.block_id),
                    "original_rank": b.original_rank,
                    "tokens": b.tokens,
                    "rendered_text": None if b.rendered_text == b.text else b.rendered_text,
                }
                for b in plan.blocks
            ],
            "order": plan.order,
            "duplicates": plan.duplicates,
            "replaced": plan.replaced,
            "hints": plan.hints,
            "segments": plan.segments,
            "matched_prefix_blocks": plan.matched_prefix_blocks,
            "matched_prefix_tokens": plan.matched_prefix_tokens,
            "conversation_id": plan.conversation_id,
            "tenant": plan.tenant,
            "turn": plan.turn,
            "dedup": plan.dedup,
            "annotation_labels": plan.annotation_labels,
        }

    def to_plan(self, layout: PromptLayout) -> Plan:
        """The core's :class:`Plan`, rendered with ``layout`` (the server's)."""
        return Plan(
            rid=self.rid,
            query=self.query,
            blocks=[
                PlannedBlock(
                    text=b.text,
                    block_id=int(b.block_id),
                    original_rank=b.original_rank,
                    tokens=b.tokens,
                    rendered_text=b.text if b.rendered_text is None else b.rendered_text,
                )
                for b in self.blocks
            ],
            order=self.order,
            duplicates=self.duplicates,
            segments=self.segments,
            matched_prefix_blocks=self.matched_prefix_blocks,
            matched_prefix_tokens=self.matched_prefix_tokens,
            layout=layout,
            replaced=self.replaced,
            hints=self.hints,
            conversation_id=self.conversation_id,
            tenant=self.tenant,
            turn=self.turn,
            dedup=self.dedup,
            annotation_labels=self.annotation_labels,
        )


class BatchPlanResponse(BaseModel):
    """The core's ``BatchPlan``: plans in input order and the order to send them in."""

    plans: list[PlanResponse]
    schedule: list[int]

    @staticmethod
    def encode(batch: BatchPlan) -> dict[str, Any]:
        """The JSON-ready dict of ``batch``."""
        return {
            "plans": [PlanResponse.encode(p) for p in batch.plans],
            "schedule": batch.schedule,
        }

    def to_batch_plan(self, layout: PromptLayout) -> BatchPlan:
        """The core's :class:`BatchPlan`."""
        return BatchPlan(plans=[p.to_plan(layout) for p in self.plans], schedule=self.schedule)


class LayoutModel(BaseModel):
    """The server's :class:`PromptLayout`: every field of it (templates are strings), to
    render plans client-side. Fields the layout gains later travel as extra keys."""

    model_config = ConfigDict(extra="allow")

    system_prompt: str
    block_template: str
    label_template: str
    block_separator: str
    annotation_template: str
    annotation_joiner: str
    hint_template: str
    question_template: str

    @classmethod
    def from_core(cls, layout: PromptLayout) -> LayoutModel:
        """From the core's layout (all its dataclass fields)."""
        return cls(**dataclasses.asdict(layout))

    def to_core(self) -> PromptLayout:
        """The core's layout."""
        return PromptLayout(**self.model_dump())


class EvictResponse(BaseModel):
    """``evicted``: False when the rid was not indexed (evicting twice is harmless)."""

    evicted: bool


class ForgetConversationResponse(BaseModel):
    """``forgotten``: False when the conversation was not held."""

    forgotten: bool


class UsageResponse(BaseModel):
    """``indexed``: whether the rid is still in the index (then it was marked as used)."""

    indexed: bool


class HealthResponse(BaseModel):
    """Liveness and the state of the engine link."""

    status: Literal["ok"]
    version: str
    cache_model: str
    engine_connected: bool | None = Field(
        description="KV-event publisher connected (null: no event stream configured)."
    )
    resync_pending: bool


class FieldError(BaseModel):
    """One invalid field."""

    field: str = Field(description="Where: body.blocks[2], query.tenant, ...")
    message: str
    value: Any = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    message: str = Field(description="What is wrong, naming the field and the value.")
    error_type: str = Field(description="ValueError, TypeError, PermissionError, ...")
    fields: list[FieldError] = Field(default_factory=list)
