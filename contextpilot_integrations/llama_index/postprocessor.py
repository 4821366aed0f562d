"""``ContextPilotNodePostprocessor``: align and de-duplicate retrieved nodes against the shared
context index (ContextPilot, MLSys 2026), for LlamaIndex query engines, chat engines and
Workflows.

What it does with the nodes it is given (in relevance order: the retriever's, or the previous
post-processor's):

1. Each node's text as LlamaIndex shows it to the LLM (``get_content(MetadataMode.LLM)``,
   stripped, as the response synthesizer strips it) is a context block. Nodes whose LLM text is
   empty (an image node without text) are not blocks; they pass through.
2. ``pilot.plan(query, blocks, conversation_id=..., tenant=...)`` aligns the blocks with the
   prefixes the index already holds (shared blocks first, in the order earlier requests sent
   them), de-duplicates them against the conversation's earlier turns, and indexes the request
   under a new request id.
3. It returns a *copy* of every node (the docstore's objects are shared and never changed), in
   this order: the blocks the prompt shows, in prompt order; then the blocks replaced by a hint
   (already shown in an earlier turn of the conversation); then repeated texts; then nodes
   without text. Nothing is dropped: the output is a permutation of the input. Each copy
   carries ``contextpilot_*`` metadata (see :data:`METADATA_KEYS`), all listed in
   ``excluded_llm_metadata_keys`` and ``excluded_embed_metadata_keys``, so the text LlamaIndex
   renders for a node is byte-identical to the original's. Scores are carried, never read.

Rendering: with the stock LlamaIndex templates the LLM sees the nodes joined in the aligned
order, so requests that share nodes share a byte-identical prefix, and every node's full text is
present (a replaced node too). With the templates of :mod:`.prompts`
(``text_qa_template(pp)``, ``chat_context_template(pp)``) the prompt is the layout of
DESIGN.md: labelled blocks, location hints, the order annotation, then the question, and a
replaced node appears only as its hint.

Per-call information (which conversation, which tenant): LlamaIndex hands a post-processor
only the nodes and the query, and a retriever only the query, so neither can learn per call
which conversation a request belongs to. The conversation is therefore bound to the
post-processor: ``pp.for_conversation(conversation_id, tenant=...)`` returns a sibling that
shares the index and the plan store; give one to each chat engine (or create it per call in a
Workflow step). Without a conversation id nothing is de-duplicated across requests (DESIGN.md
invariant 2). A retriever wrapper would add a second way to do the same thing, with no more
information, so there is none.

Request ids: see :mod:`.request_ids`. The plan's rid is armed in the caller's context and
:class:`~contextpilot_integrations.llama_index.llms.ContextPilotOpenAILike` sends it with the
next LLM request; it is also on every returned node (``contextpilot_rid``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot, Plan
from contextpilot_integrations.core.planner import Planner
from contextpilot_integrations.core.rendering import PromptLayout

from .plan_store import PlanStore, StoredPlan
from .request_ids import RID_METADATA_KEY, arm_request, plan_markers

__all__ = [
    "METADATA_KEYS",
    "ContextPilotNodePostprocessor",
    "Planner",
    "STATUS_DUPLICATE",
    "STATUS_KEPT",
    "STATUS_NO_TEXT",
    "STATUS_REPLACED",
]

logger = logging.getLogger(__name__)

STATUS_KEY = "contextpilot_status"
LABEL_KEY = "contextpilot_label"
RANK_KEY = "contextpilot_rank"
HINT_KEY = "contextpilot_hint"
DUPLICATE_OF_KEY = "contextpilot_duplicate_of"

METADATA_KEYS: tuple[str, ...] = (
    RID_METADATA_KEY,
    STATUS_KEY,
    LABEL_KEY,
    RANK_KEY,
    HINT_KEY,
    DUPLICATE_OF_KEY,
)
"""Metadata this post-processor sets on its copies, never rendered for the LLM or embeddings:
``contextpilot_rid`` (the plan's request id), ``contextpilot_status`` (one of the ``STATUS_*``
values), ``contextpilot_rank`` (0-based position in the input list), ``contextpilot_label``
(kept: the block's label in the prompt, ``"[Doc 2]"``), ``contextpilot_hint`` (replaced: the
hint shown instead), ``contextpilot_duplicate_of`` (repeated: input position of the first node
with the same text)."""

STATUS_KEPT = "kept"
STATUS_REPLACED = "replaced"
STATUS_DUPLICATE = "duplicate"
STATUS_NO_TEXT = "no_text"


@dataclass(frozen=True)
class _Prepared:
    """The input split into blocks (texts in input order) and nodes without text."""

    nodes: list[NodeWithScore]
    texts: list[str]
    block_nodes: list[int]  # block index -> input index
    no_text: list[int]  # input indices
    conversation: tuple[str, str] | None  # (tenant, conversation_id)
    sections: tuple[tuple[int, str], ...]


class ContextPilotNodePostprocessor(BaseNodePostprocessor):
    """Align (and, in a conversation, de-duplicate) retrieved nodes against the shared index.

    Drop-in: ``index.as_query_engine(node_postprocessors=[ContextPilotNodePostprocessor()])``;
    add ``text_qa_template=text_qa_template(pp)`` for the full prompt layout. Chat:
    ``index.as_chat_engine(chat_mode="condense_plus_context", node_postprocessors=[chat_pp],
    context_prompt=chat_context_template(chat_pp))`` with ``chat_pp = pp.for_conversation()``.
    Workflow step: ``nodes = await pp.apostprocess_nodes(nodes, query_str=query)``.

    Args:
        pilot: the planner holding the shared index (default: a new in-process
            :class:`~contextpilot_integrations.ContextPilot`); any object with ``plan(...)``.
        conversation_id: the conversation every request of this instance belongs to; ``None``
            (default): none, nothing is de-duplicated across requests.
        tenant: the tenant owning the conversation (``""`` for a single-tenant app).
        store: where plans are filed for the templates and conversation sections are kept
            (default: a new :class:`PlanStore` counting with the pilot's token counter).

    Raises:
        TypeError: ``pilot`` has no ``plan`` method, ``store`` is not a :class:`PlanStore`, or
            ``conversation_id`` / ``tenant`` are not ``str``.
        ValueError: ``conversation_id`` is an empty string.

    Calls raise ``TypeError`` when ``nodes`` is not a sequence of ``NodeWithScore`` (the message
    names the position and the type) and pass on the planner's errors.
    """

    conversation_id: str | None = Field(
        default=None, description="Conversation of every request; None: no de-duplication."
    )
    tenant: str = Field(default="", description="Tenant owning the conversation.")

    _pilot: Any = PrivateAttr()
    _store: PlanStore = PrivateAttr()

    def __init__(
        self,
        pilot: Planner | None = None,
        *,
        conversation_id: str | None = None,
        tenant: str = "",
        store: PlanStore | None = None,
        **kwargs: Any,
    ) -> None:
        if conversation_id is not None and (
            not isinstance(conversation_id, str) or not conversation_id
        ):
            raise ValueError(
                f"conversation_id must be a non-empty str or None, got {conversation_id!r}"
            )
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}: {tenant!r}")
        if pilot is not None and not callable(getattr(pilot, "plan", None)):
            raise TypeError(f"pilot must have a plan(...) method, got {type(pilot).__name__}")
        if store is not None and not isinstance(store, PlanStore):
            raise TypeError(f"store must be a PlanStore, got {type(store).__name__}")
        super().__init__(conversation_id=conversation_id, tenant=tenant, **kwargs)  # type: ignore[call-arg]
        self._pilot = pilot if pilot is not None else ContextPilot()
        counter = getattr(self._pilot, "token_counter", None)
        self._store = store if store is not None else PlanStore(token_counter=counter)

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotNodePostprocessor"

    # ------------------------------------------------------------------ accessors
    @property
    def pilot(self) -> Planner:
        """The planner (shared by every sibling from :meth:`for_conversation`)."""
        return self._pilot  # type: ignore[no-any-return]

    @property
    def store(self) -> PlanStore:
        """The plan store the templates read (shared by every sibling)."""
        return self._store

    @property
    def layout(self) -> PromptLayout:
        """The pilot's prompt layout (a default :class:`PromptLayout` if it has none)."""
        layout = getattr(self._pilot, "layout", None)
        return layout if isinstance(layout, PromptLayout) else PromptLayout()

    def for_conversation(
        self, conversation_id: str | None = None, *, tenant: str | None = None
    ) -> ContextPilotNodePostprocessor:
        """A post-processor for one conversation, sharing this one's pilot and store.

        Args:
            conversation_id: the conversation; ``None`` for a new unique one (one conversation
                per chat engine).
            tenant: its tenant; ``None`` keeps this post-processor's.
        """
        return type(self)(
            self._pilot,
            conversation_id=conversation_id or f"conversation-{uuid.uuid4().hex}",
            tenant=self.tenant if tenant is None else tenant,
            store=self._store,
        )

    def plan_for(self, nodes: Sequence[NodeWithScore]) -> Plan | None:
        """The plan that produced ``nodes`` (by their ``contextpilot_rid``), while the store
        still holds it; ``None`` for nodes this post-processor did not plan.

        Raises:
            ValueError: the nodes come from several plans.
        """
        rids = {rid for n in nodes if isinstance(rid := n.node.metadata.get(RID_METADATA_KEY), str)}
        if len(rids) > 1:
            raise ValueError(f"nodes come from {len(rids)} plans: {sorted(rids)[:4]!r}")
        if not rids:
            return None
        stored = self._store.get(rids.pop())
        return stored.plan if stored is not None else None

    # ------------------------------------------------------------------ LlamaIndex hooks
    def _postprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        prepared = self._prepare(nodes)
        if not prepared.texts:
            return self._finish(prepared, None)
        plan = self._pilot.plan(_query(query_bundle), prepared.texts, **self._plan_kwargs(prepared))
        return self._finish(prepared, plan)

    async def _apostprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        prepared = self._prepare(nodes)
        if not prepared.texts:
            return self._finish(prepared, None)
        query = _query(query_bundle)
        kwargs = self._plan_kwargs(prepared)
        aplan = getattr(self._pilot, "aplan", None)
        if isinstance(self._pilot, ContextPilot):
            plan = self._pilot.plan(query, prepared.texts, **kwargs)
        elif aplan is not None and inspect.iscoroutinefunction(aplan):
            plan = await aplan(query, prepared.texts, **kwargs)
        else:
            plan = await asyncio.to_thread(self._pilot.plan, query, prepared.texts, **kwargs)
        # Finished here, in the caller's task, so the armed request id is in its context.
        return self._finish(prepared, plan)

    # ------------------------------------------------------------------ internals
    def _prepare(self, nodes: Sequence[NodeWithScore]) -> _Prepared:
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
            raise TypeError(
                f"nodes must be a list of NodeWithScore, got {type(nodes).__name__}: {nodes!r:.80}"
            )
        clean: list[NodeWithScore] = []
        texts: list[str] = []
        block_nodes: list[int] = []
        no_text: list[int] = []
        for i, item in enumerate(nodes):
            if not isinstance(item, NodeWithScore):
                raise TypeError(
                    f"nodes[{i}] must be a NodeWithScore, got {type(item).__name__}: {item!r:.80}"
                )
            item = _without_own_metadata(item)
            clean.append(item)
            text = item.node.get_content(metadata_mode=MetadataMode.LLM).strip()
            if text:
                texts.append(text)
                block_nodes.append(i)
            else:
                no_text.append(i)
        conversation = None
        sections: tuple[tuple[int, str], ...] = ()
        if self.conversation_id is not None:
            conversation = (self.tenant, self.conversation_id)
            sections = self._store.conversation_sections(*conversation)
        return _Prepared(clean, texts, block_nodes, no_text, conversation, sections)

    def _plan_kwargs(self, prepared: _Prepared) -> dict[str, Any]:
        if prepared.conversation is None:
            return {"conversation_id": None, "tenant": self.tenant}
        return {
            "conversation_id": prepared.conversation[1],
            "tenant": prepared.conversation[0],
            "visibility": TurnVisibility.only(turn for turn, _ in prepared.sections),
        }

    def _finish(self, prepared: _Prepared, plan: Plan | None) -> list[NodeWithScore]:
        nodes = prepared.nodes
        if plan is None:
            arm_request(None)
            return [
                _annotated(nodes[i], {STATUS_KEY: STATUS_NO_TEXT, RANK_KEY: i})
                for i in prepared.no_text
            ]
        # Blocks in output order, as (block index, metadata): kept, replaced, repeated.
        blocks: list[tuple[int, dict[str, Any]]] = [
            (rank, {STATUS_KEY: STATUS_KEPT, LABEL_KEY: plan.layout.label(position)})
            for position, rank in enumerate(plan.order)
        ]
        blocks += [
            (rank, {STATUS_KEY: STATUS_REPLACED, HINT_KEY: plan.replaced[rank]})
            for rank in sorted(plan.replaced)
        ]
        at = prepared.block_nodes  # block index -> input index
        blocks += [
            (rank, {STATUS_KEY: STATUS_DUPLICATE, DUPLICATE_OF_KEY: at[plan.duplicates[rank]]})
            for rank in sorted(plan.duplicates)
        ]
        # The context LlamaIndex will build from the returned nodes (see plan_store).
        context = "\n\n".join(prepared.texts[rank] for rank, _ in blocks)
        placed = [(at[rank], meta) for rank, meta in blocks]
        placed += [(i, {STATUS_KEY: STATUS_NO_TEXT}) for i in prepared.no_text]
        if sorted(i for i, _ in placed) != list(range(len(nodes))):
            # A planner that lost (or invented) a block must not lose a node.
            raise RuntimeError(
                f"plan {plan.rid!r} does not account for each of the {len(nodes)} nodes once: "
                f"order {plan.order}, replaced {sorted(plan.replaced)}, "
                f"duplicates {sorted(plan.duplicates)}"
            )
        out = [
            _annotated(nodes[i], {RID_METADATA_KEY: plan.rid, RANK_KEY: i, **meta})
            for i, meta in placed
        ]
        self._store.put(StoredPlan(plan, prepared.sections), context)
        arm_request(plan.rid, plan_markers(plan))
        logger.debug(
            "plan %s: %d kept, %d replaced, %d repeated, %d without text; prefix %d blocks",
            plan.rid,
            len(plan.order),
            len(plan.replaced),
            len(plan.duplicates),
            len(prepared.no_text),
            plan.matched_prefix_blocks,
        )
        return out


def _query(query_bundle: QueryBundle | None) -> str:
    return query_bundle.query_str if query_bundle is not None else ""


def _without_own_metadata(item: NodeWithScore) -> NodeWithScore:
    """``item`` unchanged, or a copy without ``contextpilot_*`` keys (nodes planned before are
    planned afresh, and a stale key must not reach the LLM text)."""
    metadata = item.node.metadata
    if not any(key in metadata for key in METADATA_KEYS):
        return item
    node = item.node.model_copy(
        update={"metadata": {k: v for k, v in metadata.items() if k not in METADATA_KEYS}}
    )
    return item.model_copy(update={"node": node})


def _annotated(item: NodeWithScore, metadata: dict[str, Any]) -> NodeWithScore:
    """A copy of ``item`` whose node copy carries ``metadata``, excluded from LLM and embed text."""
    node = item.node
    excluded_llm = list(node.excluded_llm_metadata_keys)
    excluded_embed = list(node.excluded_embed_metadata_keys)
    for key in METADATA_KEYS:
        if key not in excluded_llm:
            excluded_llm.append(key)
        if key not in excluded_embed:
            excluded_embed.append(key)
    copy = node.model_copy(
        update={
            "metadata": {**node.metadata, **metadata},
            "excluded_llm_metadata_keys": excluded_llm,
            "excluded_embed_metadata_keys": excluded_embed,
        }
    )
    return item.model_copy(update={"node": copy})
