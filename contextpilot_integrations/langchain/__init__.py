"""LangChain adapter: a drop-in retriever wrapper, prompt formatting, the plan's fields, batches.

Swap ``retriever`` for ``ContextPilotRetriever(base_retriever=retriever)``, format with
:data:`format_documents`, prompt with :data:`CONTEXTPILOT_PROMPT`, wrap the model with
:func:`with_plan_fields`::

    chain = (
        {"context": retriever | format_documents, "question": RunnablePassthrough()}
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(llm)
    )

For batches planned jointly and sent in schedule order, start the chain with
:class:`RAGInputs` instead of the dict. The pilot is any
:class:`~contextpilot_integrations.Planner`: the in-process ``ContextPilot`` (default; with
``cache_sync={...}`` it follows the engine's cache) or the index service's
``ContextPilotClient``. Returned documents carry ``metadata["contextpilot"]``
(:mod:`contextpilot_integrations.core.placement_metadata`, :mod:`.documents`). Install with
``pip install contextpilot-integrations[langchain]``; the framework types stay in this package.
"""

from contextpilot_integrations.langchain.agent_middleware import (
    AgentEngine,
    ContextPilotMiddleware,
)
from contextpilot_integrations.langchain.documents import planned_documents, planned_entry
from contextpilot_integrations.langchain.plan_fields import (
    PlanFieldsChatModel,
    schedule_order,
    with_plan_fields,
)
from contextpilot_integrations.langchain.prompts import (
    CONTEXTPILOT_PROMPT,
    ContextPilotChatPromptTemplate,
    ContextPilotPromptValue,
    RenderedContext,
    contextpilot_prompt,
    document_formatter,
    format_documents,
    render_context,
)
from contextpilot_integrations.langchain.rag_inputs import RAGInputs
from contextpilot_integrations.langchain.retriever import (
    CONVERSATION_ID_KEY,
    TENANT_KEY,
    TURN_KEY,
    VISIBLE_TURNS_KEY,
    ContextPilotRetriever,
)
from contextpilot_integrations.langchain.retriever_tool import retriever_tool

__all__ = [
    "CONTEXTPILOT_PROMPT",
    "CONVERSATION_ID_KEY",
    "TENANT_KEY",
    "TURN_KEY",
    "VISIBLE_TURNS_KEY",
    "AgentEngine",
    "ContextPilotChatPromptTemplate",
    "ContextPilotMiddleware",
    "ContextPilotPromptValue",
    "ContextPilotRetriever",
    "PlanFieldsChatModel",
    "RAGInputs",
    "RenderedContext",
    "contextpilot_prompt",
    "document_formatter",
    "format_documents",
    "planned_documents",
    "planned_entry",
    "render_context",
    "retriever_tool",
    "schedule_order",
    "with_plan_fields",
]
