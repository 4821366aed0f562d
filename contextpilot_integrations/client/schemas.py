"""Request and response bodies of the index service (pydantic models, JSON on the wire).

The wire form is the core's own types, field for field: ``POST /v1/plan`` takes one
:class:`PlanRequestModel` (the core's
:class:`~contextpilot_integrations.core.request.PlanRequest`: ``query``, ``blocks``, ``rid``,
``scope``: ``{conversation_id, tenant, turn, visibility}``), ``POST /v1/plan_batch``
``{"requests": [PlanRequest, ...]}``; they answer a :class:`PlanResponse` /
:class:`BatchPlanResponse`, every field of the core's
:class:`~contextpilot_integrations.core.plan.Plan` / ``BatchPlan`` but the layout, served once
(``GET /v1/layout``, :class:`LayoutModel`).

The models check what JSON Schema can state (types, lengths, ranges; the core's ``MAX_*``
limits), so the OpenAPI document describes the accepted bodies; the rules across fields are
the core's (:meth:`PlanRequestModel.to_core` raises its ``TypeError`` / ``ValueError``: a 422).

Wire conventions: block ids are unsigned 64-bit integers sent as decimal strings (JSON numbers
above 2**53 lose precision in many readers); a shown placement's ``rendered_text`` is ``null``
when it equals ``text``; every answer carries the service's boot id in the
:data:`BOOT_HEADER` header; every error body is an :class:`ErrorResponse` whose ``message``
names the field and the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from contextpilot_integrations.core.conversations.turns import MAX_TURN, TurnVisibility
from contextpilot_integrations.core.plan import (
    BatchPlan,
    DedupFigures,
    Placement,
    PlacementStatus,
    Plan,
)
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import (
    CONTROL_CHARACTERS,
    MAX_BLOCKS_PER_REQUEST,
    MAX_ID_CHARS,
    PlanRequest,
    Scope,
)

BOOT_HEADER = "x-contextpilot-boot"
"""The response header holding the service's boot id (random per start): a client that sees it
change knows the service restarted (:mod:`.conversations`)."""

MAX_VISIBLE_TURNS = 10_000
"""Most turn numbers in one ``visibility.turns`` list."""

MAX_BATCH_REQUESTS = 10_000
"""Most requests in one ``/v1/plan_batch`` body (a 422 above; in process a batch has no such
limit)."""


def _integral_number(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; strict validation would refuse it.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers: JSON 1.0 is taken as 1; true, "1" and 1.5 are refused.
TurnNumber = Annotated[int, Field(ge=0, le=MAX_TURN), BeforeValidator(_integral_number)]
TokenCount = Annotated[int, Field(ge=0, le=2**62), BeforeValidator(_integral_number)]

_NO_CONTROL_CHARACTERS = f"^[^{CONTROL_CHARACTERS}]*$"

Identifier = Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=_NO_CONTROL_CHARACTERS)
]
"""A non-empty id (rid, conversation id) of at most ``MAX_ID_CHARS`` characters, with no
control characters."""

Tenant = Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=_NO_CONTROL_CHARACTERS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class LastTurns(_Strict):
    """Only the ``last`` turns before this one are still in the app's prompt."""

    last: TurnNumber


class OnlyTurns(_Strict):
    """Only these earlier turns are still in the app's prompt (others were dropped)."""

    turns: Annotated[list[TurnNumber], Field(max_length=MAX_VISIBLE_TURNS)]


Visibility = LastTurns | OnlyTurns
"""Which earlier turns the app's prompt still holds (``null``: every earlier turn)."""


def visibility_to_core(visibility: Visibility | None) -> TurnVisibility | None:
    """The core's :class:`TurnVisibility` (None: all turns)."""
    if isinstance(visibility, LastTurns):
        return TurnVisibility.last(visibility.last)
    if isinstance(visibility, OnlyTurns):
        return TurnVisibility.only(visibility.turns)
    return None


def visibility_from_core(visibility: TurnVisibility | None) -> dict[str, Any] | None:
    """The JSON form of the core's :class:`TurnVisibility` (None: all turns)."""
    if visibility is None:
        return None
    if visibility.last_turns is not None:
        return {"last": visibility.last_turns}
    if visibility.turns is not None:
        return {"turns": sorted(visibility.turns)}
    return None


class ScopeModel(_Strict):
    """The core's :class:`~contextpilot_integrations.core.request.Scope`."""

    conversation_id: Identifier | None = Field(
        default=None, description="Conversation for multi-turn de-duplication; null: none."
    )
    tenant: Tenant = Field(
        default="",
        description="Owner of the conversation. With API keys the key decides: empty, or the "
        "key's tenant (another tenant's name is refused with a 403).",
    )
    turn: TurnNumber | None = Field(
        default=None, description="Turn number; null: one after the conversation's latest."
    )
    visibility: Visibility | None = Field(
        default=None, description="Earlier turns the app's prompt still holds; null: all."
    )

    def to_core(self) -> Scope:
        """The core's :class:`Scope`.

        Raises:
            ValueError: ``turn`` or ``visibility`` without a ``conversation_id`` (the core's
                message).
        """
        return Scope(
            self.conversation_id, self.tenant, self.turn, visibility_to_core(self.visibility)
        )


def scope_json(scope: Scope) -> dict[str, Any]:
    """The JSON form of the core's :class:`Scope` (:class:`ScopeModel`)."""
    return {
        "conversation_id": scope.conversation_id,
        "tenant": scope.tenant,
        "turn": scope.turn,
        "visibility": visibility_from_core(scope.visibility),
    }


class PlanRequestModel(_Strict):
    """The core's :class:`~contextpilot_integrations.core.request.PlanRequest`: one request
    to plan."""

    query: str = Field(description="The question (may be empty).")
    blocks: Annotated[list[str], Field(max_length=MAX_BLOCKS_PER_REQUEST)] = Field(
        description="Block texts in retriever (relevance) order; empty or whitespace-only "
        "ones come back as skipped placements."
    )
    rid: Identifier | None = Field(
        default=None,
        description="Request id; a new one when null. With API keys the plan's rid is the "
        "tenant's tag, a dot and this rid (at most 499 characters then).",
    )
    scope: ScopeModel = ScopeModel()  # frozen: one shared default is safe

    def to_core(self) -> PlanRequest:
        """The core's :class:`PlanRequest`.

        Raises:
            TypeError / ValueError: the core's checks (the message names the field).
        """
        return PlanRequest(self.query, self.blocks, self.rid, self.scope.to_core())


def plan_request_json(request: PlanRequest) -> dict[str, Any]:
    """The JSON form of the core's :class:`PlanRequest` (:class:`PlanRequestModel`)."""
    return {
        "query": request.query,
        "blocks": list(request.blocks),
        "rid": request.rid,
        "scope": scope_json(request.scope),
    }


class PlanBatchRequest(_Strict):
    """A batch: the core's list of requests."""

    requests: Annotated[list[PlanRequestModel], Field(max_length=MAX_BATCH_REQUESTS)]

    def to_core(self) -> list[PlanRequest]:
        """The core's requests (each checked by the core; the batch's own rules are checked
        when it is planned)."""
        return [request.to_core() for request in self.requests]


def plan_batch_json(requests: Sequence[PlanRequest]) -> dict[str, Any]:
    """The JSON form of a batch (:class:`PlanBatchRequest`)."""
    return {"requests": [plan_request_json(request) for request in requests]}


class EvictRequest(_Strict):
    """Drop one request from the index."""

    rid: Identifier


class ForgetConversationRequest(_Strict):
    """Drop a conversation's de-duplication records (the user deleted it); its turn numbers go
    on after it."""

    conversation_id: Identifier
    tenant: Tenant = Field(
        default="", description="With API keys: empty, or the key's tenant (else a 403)."
    )


class UsageReport(_Strict):
    """Token usage the engine reported for a planned request (OpenAI ``usage``); the core
    checks ``cached_tokens <= prompt_tokens``."""

    rid: Identifier
    prompt_tokens: TokenCount
    cached_tokens: TokenCount
    cache_write_tokens: TokenCount | None = Field(
        None,
        description="Prompt tokens the engine wrote to its cache (Anthropic's "
        "cache_creation_input_tokens); null: not reported.",
    )


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class PlacementModel(BaseModel):
    """The core's :class:`~contextpilot_integrations.core.plan.Placement`: where one input
    block went."""

    index: int
    status: Literal["shown", "replaced", "duplicate", "skipped"]
    text: str
    block_id: str | None = Field(description="Unsigned 64-bit block id, as a decimal string.")
    tokens: int
    position: int | None
    label: str | None
    rendered_text: str | None = Field(
        description="Shown: what the prompt shows; null when it equals text."
    )
    hint: str | None
    duplicate_of: int | None

    def to_core(self) -> Placement:
        """The core's :class:`Placement`."""
        status = PlacementStatus(self.status)
        rendered = self.rendered_text
        if rendered is None and status is PlacementStatus.SHOWN:
            rendered = self.text
        return Placement(
            index=self.index,
            status=status,
            text=self.text,
            block_id=None if self.block_id is None else int(self.block_id),
            tokens=self.tokens,
            position=self.position,
            label=self.label,
            rendered_text=rendered,
            hint=self.hint,
            duplicate_of=self.duplicate_of,
        )


def _placement_json(p: Placement) -> dict[str, Any]:
    return {
        "index": p.index,
        "status": p.status.value,
        "text": p.text,
        "block_id": None if p.block_id is None else str(p.block_id),
        "tokens": p.tokens,
        "position": p.position,
        "label": p.label,
        "rendered_text": None if p.rendered_text == p.text else p.rendered_text,
        "hint": p.hint,
        "duplicate_of": p.duplicate_of,
    }


class DedupFiguresModel(BaseModel):
    """The core's :class:`~contextpilot_integrations.core.plan.DedupFigures`."""

    blocks_kept: int
    blocks_replaced: int
    sub_blocks_replaced: int
    tokens_in: int
    tokens_saved: int


class PlanResponse(BaseModel):
    """Every field of the core's :class:`Plan` except its layout (``GET /v1/layout``)."""

    rid: str
    query: str
    scope: ScopeModel
    placements: list[PlacementModel]
    hints: list[str]
    segments: list[str]
    annotation_labels: list[str]
    matched_prefix_blocks: int
    matched_prefix_tokens: int
    shared_prefix_blocks: int
    shared_prefix_tokens: int
    dedup_figures: DedupFiguresModel
    cache_salt: str | None = Field(
        None, description="The engine's cache_salt for the caller's tenant (send it along)."
    )
    replica: str | None = Field(None, description="The engine replica the plan was made for.")
    routing_key: str | None = Field(
        None, description="The gateway routing key of that replica (send it in a header)."
    )
    base_url: str | None = Field(None, description="That replica's own base URL (direct mode).")

    @staticmethod
    def encode(plan: Plan) -> dict[str, Any]:
        """The JSON-ready dict of ``plan`` (no validation: the core built it)."""
        return {
            "rid": plan.rid,
            "query": plan.query,
            "scope": scope_json(plan.scope),
            "placements": [_placement_json(p) for p in plan.placements],
            "hints": plan.hints,
            "segments": plan.segments,
            "annotation_labels": plan.annotation_labels,
            "matched_prefix_blocks": plan.matched_prefix_blocks,
            "matched_prefix_tokens": plan.matched_prefix_tokens,
            "shared_prefix_blocks": plan.shared_prefix_blocks,
            "shared_prefix_tokens": plan.shared_prefix_tokens,
            "dedup_figures": dataclasses.asdict(plan.dedup_figures),
            "cache_salt": plan.cache_salt,
            "replica": plan.replica,
            "routing_key": plan.routing_key,
            "base_url": plan.base_url,
        }

    def to_core(self, layout: PromptLayout) -> Plan:
        """The core's :class:`Plan`, rendered with ``layout`` (the server's)."""
        return Plan(
            rid=self.rid,
            query=self.query,
            scope=self.scope.to_core(),
            placements=tuple(p.to_core() for p in self.placements),
            hints=tuple(self.hints),
            segments=tuple(self.segments),
            annotation_labels=tuple(self.annotation_labels),
            matched_prefix_blocks=self.matched_prefix_blocks,
            matched_prefix_tokens=self.matched_prefix_tokens,
            shared_prefix_blocks=self.shared_prefix_blocks,
            shared_prefix_tokens=self.shared_prefix_tokens,
            dedup_figures=DedupFigures(**self.dedup_figures.model_dump()),
            layout=layout,
            cache_salt=self.cache_salt,
            replica=self.replica,
            routing_key=self.routing_key,
            base_url=self.base_url,
        )


class BatchPlanResponse(BaseModel):
    """The core's :class:`BatchPlan`: plans in input order and the order to send them in."""

    plans: list[PlanResponse]
    schedule: list[int]

    @staticmethod
    def encode(batch: BatchPlan) -> dict[str, Any]:
        """The JSON-ready dict of ``batch``."""
        return {
            "plans": [PlanResponse.encode(p) for p in batch.plans],
            "schedule": batch.schedule,
        }

    def to_core(self, layout: PromptLayout) -> BatchPlan:
        """The core's :class:`BatchPlan`."""
        return BatchPlan(
            plans=tuple(p.to_core(layout) for p in self.plans), schedule=tuple(self.schedule)
        )


class LayoutModel(BaseModel):
    """The server's :class:`PromptLayout`: every field of it (templates are strings), to
    render plans client-side. A field this client does not know is refused (a client older
    than the server would otherwise render prompts the server does not)."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str
    block_template: str
    label_template: str
    block_separator: str
    annotation_template: str
    annotation_joiner: str
    hint_template: str
    question_template: str
    turn_header: str

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


class UsageFiguresModel(BaseModel):
    """Running totals of planned requests since the service started (``ContextPilot.totals``):
    plans made, tokens their de-duplication removed (``dedup_figures.tokens_saved``, by the
    service's token counter), blocks replaced by a hint, sub-blocks replaced by a pointer, and
    the engine's usage reports of those plans (``POST /v1/usage``) with their prompt and
    cached tokens."""

    plans: int
    tokens_removed: int
    blocks_replaced: int
    sub_blocks_replaced: int
    usage_reports: int
    prompt_tokens: int
    cached_tokens: int


class UsageTotalsResponse(UsageFiguresModel):
    """``GET /v1/usage``: the caller tenant's totals and its recent conversations'
    (``conversations``: ``{tenant: {conversation_id: figures}}``, the caller's tenant only;
    without API keys ``tenant`` is null and every conversation is listed)."""

    tenant: str | None
    conversations: dict[str, dict[str, UsageFiguresModel]]


class SnapshotResponse(BaseModel):
    """``saved``: False when the service has no snapshot path or the save failed."""

    saved: bool


class HealthResponse(BaseModel):
    """Liveness and the state of the engine link; in the proxy mode with a fleet, the replicas
    up (``status`` ``"replicas_down"`` and HTTP 503 when none is)."""

    status: Literal["ok", "replicas_down"]
    version: str
    boot_id: str = Field(
        description="Random per service start (also the x-contextpilot-boot header of every "
        "answer): a new value means the service restarted."
    )
    cache_model: str
    engine_connected: bool | None = Field(
        description="KV-event publisher connected (null: no event stream configured)."
    )
    resync_pending: bool
    replicas: int | None = Field(
        default=None, description="Proxy with a fleet: its replicas (null: no fleet)."
    )
    replicas_up: int | None = Field(
        default=None,
        description="Proxy with a fleet: replicas up, neither refusing connections nor "
        "reported down by their KV events (null: no fleet). 0: every replica is down, the "
        "status is replicas_down and the answer a 503.",
    )


class FieldError(BaseModel):
    """One invalid field."""

    field: str = Field(description="Where: body.blocks[2], body.scope.turn, ...")
    message: str
    value: Any = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    message: str = Field(description="What is wrong, naming the field and the value.")
    error_type: str = Field(
        description="ValueError, TypeError, RidConflictError, PermissionError, ..."
    )
    fields: list[FieldError] = Field(default_factory=list)
