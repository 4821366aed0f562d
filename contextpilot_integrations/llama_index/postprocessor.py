"""``ContextPilotNodePostprocessor``: align and de-duplicate retrieved nodes against the shared
context index, for LlamaIndex query engines, chat engines and Workflows.

For the nodes it is given (in relevance order):

1. each node's text as LlamaIndex shows it to the LLM (``get_content(MetadataMode.LLM)``,
   stripped) is a context block; the planner marks the empty ones ``skipped``;
2. ``pilot.plan(query, texts, scope=...)`` (``await pilot.aplan(...)`` on the async path)
   aligns the blocks with the prefixes the index holds, de-duplicates them against the
   conversation's earlier turns, and indexes the request under a new rid;
3. it returns a *copy* of every node (a permutation of the input) in ``plan.output_order()``:
   shown blocks in prompt order, then blocks replaced by a hint, repeated texts, nodes without
   text. Each copy carries ``metadata["contextpilot"]``
   (:mod:`contextpilot_integrations.core.placement_metadata`), excluded from the LLM and
   embedding text, so the text LlamaIndex renders for a node is unchanged. Scores are carried,
   never read.

With the stock templates the LLM sees every node's full text in the aligned order; with those
of :mod:`.prompts` it sees the prompt layout (docs/DESIGN.md, "Prompt layout"), a replaced
node as its hint. The conversation is bound to the post-processor
(``pp.for_conversation(conversation_id, tenant=...)``, a sibling sharing the pilot and the
stores; one per chat engine), since LlamaIndex passes a post-processor only the nodes and the
query; without one nothing is de-duplicated across requests (docs/DESIGN.md, "Isolation").
The plan's rid is armed for the next LLM call (:mod:`.request_ids`) and on every node.

Agents (``FunctionAgent``, ``AgentWorkflow``) are not served by the conversation mode, and
``scope.visibility`` stays refused: the turns it tracks are the sections a ContextPilot
template renders into one engine's prompt, while an agent's retrieval runs inside a tool
(a ``RetrieverTool`` joins the nodes' texts, a ``QueryEngineTool`` returns its engine's
answer) and the agent's model reads its own history of tool messages, which a post-processor
never sees. A hint made here would point at a prompt that model was never sent. For agents,
wrap the agent's LLM in
:class:`~contextpilot_integrations.llama_index.agent_llm.ContextPilotAgentLLM`: it plans the
history the model is sent, so repeated tool results and documents become pointers into that
history (docs/DESIGN.md, "LlamaIndex").
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY, placement_entry
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.planner_protocol import Planner, check_planner
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import NO_SCOPE, Scope
from contextpilot_integrations.llama_index.conversation_sections import ConversationSections
from contextpilot_integrations.llama_index.plan_store import PlanStore, StoredPlan
from contextpilot_integrations.llama_index.request_ids import arm_plan, nodes_rid

__all__ = ["ContextPilotNodePostprocessor"]

logger = logging.getLogger(__name__)


class ContextPilotNodePostprocessor(BaseNodePostprocessor):
    """Align (and, in a conversation, de-duplicate) retrieved nodes against the shared index.

    Drop-in: ``index.as_query_engine(node_postprocessors=[ContextPilotNodePostprocessor()])``;
    add ``text_qa_template=text_qa_template(pp)`` for the full prompt layout. Chat:
    ``index.as_chat_engine(chat_mode="condense_plus_context", node_postprocessors=[chat_pp],
    context_prompt=chat_context_template(chat_pp))`` with ``chat_pp = pp.for_conversation()``.
    Workflow step: ``nodes = await pp.apostprocess_nodes(nodes, query_str=query)``.

    Args:
        pilot: the :class:`~contextpilot_integrations.core.planner_protocol.Planner` holding
            the shared index: an in-process
            :class:`~contextpilot_integrations.ContextPilot` (the default, a new one) or a
            service client.
        scope: the conversation (``conversation_id``) and ``tenant`` of every request of this
            instance; default none: nothing is de-duplicated across requests. Its ``turn`` and
            ``visibility`` are set per call and must be ``None`` here.
        plans: where plans are filed for the templates (default a new :class:`PlanStore`).
        sections: each conversation's rendered sections (default a new
            :class:`ConversationSections`).

    Raises:
        TypeError: ``pilot`` does not implement the ``Planner`` protocol (the message names
            the missing members), or ``scope`` / ``plans`` / ``sections`` of the wrong type.
        ValueError: ``scope`` has a ``turn`` or a ``visibility``.

    Calls raise ``TypeError`` when ``nodes`` is not a sequence of ``NodeWithScore`` (the message
    names the position and the type), ``RuntimeError`` when the planner's placements do not
    account for every node once, and pass on the planner's errors.
    """

    scope: Scope = Field(
        default=NO_SCOPE, description="Conversation and tenant of every request (no turn)."
    )

    _pilot: Planner = PrivateAttr()
    _plans: PlanStore = PrivateAttr()
    _sections: ConversationSections = PrivateAttr()

    def __init__(
        self,
        pilot: Planner | None = None,
        *,
        scope: Scope = NO_SCOPE,
        plans: PlanStore | None = None,
        sections: ConversationSections | None = None,
        **kwargs: Any,
    ) -> None:
        if pilot is not None:
            check_planner(pilot)
        if not isinstance(scope, Scope):
            raise TypeError(f"scope must be a Scope, got {type(scope).__name__}: {scope!r:.80}")
        if scope.turn is not None or scope.visibility is not None:
            raise ValueError(
                "scope.turn and scope.visibility are set per call from the conversation's "
                f"kept sections; give only conversation_id and tenant, got {scope!r}"
            )
        for name, value, kind in (
            ("plans", plans, PlanStore),
            ("sections", sections, ConversationSections),
        ):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
        super().__init__(scope=scope, **kwargs)  # type: ignore[call-arg]
        self._pilot = pilot if pilot is not None else ContextPilot()
        self._plans = plans if plans is not None else PlanStore()
        self._sections = sections if sections is not None else ConversationSections()

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotNodePostprocessor"

    # ------------------------------------------------------------------ accessors
    @property
    def pilot(self) -> Planner:
        """The planner (shared by every sibling from :meth:`for_conversation`)."""
        return self._pilot

    @property
    def plans(self) -> PlanStore:
        """The plan store the templates read (shared by every sibling)."""
        return self._plans

    @property
    def sections(self) -> ConversationSections:
        """The conversations' rendered sections (shared by every sibling)."""
        return self._sections

    @property
    def layout(self) -> PromptLayout:
        """The pilot's prompt layout."""
        return self._pilot.layout

    def for_conversation(
        self, conversation_id: str | None = None, *, tenant: str | None = None
    ) -> ContextPilotNodePostprocessor:
        """A post-processor for one conversation, sharing this one's pilot and stores.

        Args:
            conversation_id: the conversation; ``None`` for a new unique one (one conversation
                per chat engine).
            tenant: its tenant; ``None`` keeps this post-processor's.

        Raises:
            TypeError / ValueError: an invalid id or tenant (from :class:`Scope`).
        """
        scope = Scope(
            conversation_id if conversation_id is not None else f"conversation-{uuid.uuid4().hex}",
            self.scope.tenant if tenant is None else tenant,
        )
        return type(self)(self._pilot, scope=scope, plans=self._plans, sections=self._sections)

    def plan_for(self, nodes: Sequence[NodeWithScore]) -> Plan | None:
        """The plan that produced ``nodes`` (by their ``metadata["contextpilot"]["rid"]``),
        while the store still holds it; ``None`` for nodes this post-processor did not plan.

        Raises:
            ValueError: the nodes come from several plans.
        """
        rid = nodes_rid(nodes)
        stored = self._plans.get(rid) if rid is not None else None
        return stored.plan if stored is not None else None

    # ------------------------------------------------------------------ LlamaIndex hooks
    def _postprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        clean, texts = _prepare(nodes)
        scope, sections = self._call_scope()
        plan = self._pilot.plan(_query(query_bundle), texts, scope=scope)
        return self._finish(clean, plan, sections)

    async def _apostprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        clean, texts = _prepare(nodes)
        scope, sections = self._call_scope()
        plan = await self._pilot.aplan(_query(query_bundle), texts, scope=scope)
        # Finished here, in the caller's task, so the armed request id is in its context.
        return self._finish(clean, plan, sections)

    # ------------------------------------------------------------------ internals
    def _call_scope(self) -> tuple[Scope, tuple[tuple[int, str], ...]]:
        """This call's scope (its turn number, and as visible the turns whose sections the
        prompt will show) and those sections."""
        conversation = self.scope.conversation
        if conversation is None:
            return self.scope, ()
        turn, sections = self._sections.begin_turn(*conversation)
        visibility = TurnVisibility.only(shown for shown, _ in sections)
        return dataclasses.replace(self.scope, turn=turn, visibility=visibility), sections

    def _finish(
        self,
        nodes: list[NodeWithScore],
        plan: Plan,
        sections: tuple[tuple[int, str], ...],
    ) -> list[NodeWithScore]:
        """The node copies in ``plan.output_order()``, each with its placement entry."""
        placements = plan.output_order()
        if sorted(p.index for p in placements) != list(range(len(nodes))):
            # A planner that lost (or invented) a block must not lose a node.
            raise RuntimeError(
                f"plan {plan.rid!r} does not account for each of the {len(nodes)} nodes once: "
                f"placements for inputs {[p.index for p in placements]}"
            )
        out = [_annotated(nodes[p.index], placement_entry(plan, p)) for p in placements]
        self._plans.put(StoredPlan(plan, sections))
        arm_plan(plan)
        logger.debug(
            "plan %s: %d nodes, %d shown; prefix %d blocks",
            plan.rid,
            len(nodes),
            len(plan.blocks),
            plan.matched_prefix_blocks,
        )
        return out


def _query(query_bundle: QueryBundle | None) -> str:
    return query_bundle.query_str if query_bundle is not None else ""


def _prepare(nodes: Sequence[NodeWithScore]) -> tuple[list[NodeWithScore], list[str]]:
    """The nodes without an earlier plan's entry, and their LLM texts (stripped).

    Raises:
        TypeError: ``nodes`` is not a sequence of ``NodeWithScore``.
    """
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        raise TypeError(
            f"nodes must be a list of NodeWithScore, got {type(nodes).__name__}: {nodes!r:.80}"
        )
    clean: list[NodeWithScore] = []
    for i, item in enumerate(nodes):
        if not isinstance(item, NodeWithScore):
            raise TypeError(
                f"nodes[{i}] must be a NodeWithScore, got {type(item).__name__}: {item!r:.80}"
            )
        clean.append(_without_entry(item))
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in clean]
    return clean, texts


def _without_entry(item: NodeWithScore) -> NodeWithScore:
    """``item`` unchanged, or a copy without an earlier plan's ``contextpilot`` entry (nodes
    planned before are planned afresh, and a stale entry must not reach the LLM text)."""
    metadata = item.node.metadata
    if METADATA_KEY not in metadata:
        return item
    node = item.node.model_copy(
        update={"metadata": {k: v for k, v in metadata.items() if k != METADATA_KEY}}
    )
    return item.model_copy(update={"node": node})


def _annotated(item: NodeWithScore, entry: dict[str, Any]) -> NodeWithScore:
    """A copy of ``item`` whose node copy carries ``entry`` under ``metadata["contextpilot"]``,
    excluded from the LLM and embedding text."""
    node = item.node
    excluded_llm = list(node.excluded_llm_metadata_keys)
    excluded_embed = list(node.excluded_embed_metadata_keys)
    for excluded in (excluded_llm, excluded_embed):
        if METADATA_KEY not in excluded:
            excluded.append(METADATA_KEY)
    copy = node.model_copy(
        update={
            "metadata": {**node.metadata, METADATA_KEY: entry},
            "excluded_llm_metadata_keys": excluded_llm,
            "excluded_embed_metadata_keys": excluded_embed,
        }
    )
    return item.model_copy(update={"node": copy})
