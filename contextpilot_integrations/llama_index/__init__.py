"""LlamaIndex adapter: a node post-processor, prompt templates and request-id plumbing.

Needs ``llama-index-core`` (0.14); the LLMs are imported on first use and need their
integration package: ``ContextPilotOpenAILike`` (self-hosted engines)
``llama-index-llms-openai-like``, ``ContextPilotOpenAI`` ``llama-index-llms-openai``,
``ContextPilotAnthropic`` ``llama-index-llms-anthropic``.

Quick start::

    from contextpilot_integrations.llama_index import (
        ContextPilotNodePostprocessor, text_qa_template)

    pp = ContextPilotNodePostprocessor()          # one shared context index
    query_engine = index.as_query_engine(node_postprocessors=[pp],
                                         text_qa_template=text_qa_template(pp))

Each returned node is a copy carrying ``node.metadata["contextpilot"]``, the placement entry of
:mod:`contextpilot_integrations.core.placement_metadata` (excluded from the LLM and embedding text).

Chat (one conversation per chat engine; its second turn de-duplicates against the first)::

    chat_pp = pp.for_conversation()               # or pp.for_conversation("id", tenant="t")
    chat = index.as_chat_engine(chat_mode="condense_plus_context",
                                node_postprocessors=[chat_pp],
                                context_prompt=chat_context_template(chat_pp))

Request ids: use ``ContextPilotOpenAILike`` (an ``OpenAILike``) as the LLM and each request
carries its plan's rid (see :mod:`.request_ids`). Hosted APIs: ``ContextPilotAnthropic`` places
the plan's cache breakpoints, ``ContextPilotOpenAI`` sends its ``prompt_cache_key``
(:mod:`contextpilot_integrations.llm_call`).

Agents (``FunctionAgent``, ``AgentWorkflow``): retrieval runs inside the tools, so the agent's
LLM is wrapped instead; every call's history is planned (byte-stable, repeated tool results
and documents sent once, then as checked pointers; see :mod:`.agent_llm`)::

    pilot_llm = ContextPilotAgentLLM(llm, tenant="acme")
    agent = FunctionAgent(llm=pilot_llm.for_conversation(session_id), tools=[search_tool])
"""

from typing import Any

from contextpilot_integrations.llama_index.agent_llm import ContextPilotAgentLLM
from contextpilot_integrations.llama_index.conversation_sections import ConversationSections
from contextpilot_integrations.llama_index.plan_store import PlanStore, StoredPlan
from contextpilot_integrations.llama_index.postprocessor import ContextPilotNodePostprocessor
from contextpilot_integrations.llama_index.prompts import (
    PlanRenderer,
    chat_context_template,
    text_qa_template,
)
from contextpilot_integrations.llama_index.request_ids import (
    arm_request,
    nodes_rid,
    request_id_kwargs,
    take_request,
)

__all__ = [
    "ContextPilotAgentLLM",
    "ContextPilotAnthropic",
    "ContextPilotNodePostprocessor",
    "ContextPilotOpenAI",
    "ContextPilotOpenAILike",
    "ConversationSections",
    "PlanRenderer",
    "PlanStore",
    "StoredPlan",
    "arm_request",
    "chat_context_template",
    "nodes_rid",
    "request_id_kwargs",
    "take_request",
    "text_qa_template",
]


def __getattr__(name: str) -> Any:
    # optional dependencies, imported on first use
    if name == "ContextPilotOpenAI":
        from contextpilot_integrations.llama_index.llms import ContextPilotOpenAI

        return ContextPilotOpenAI
    if name == "ContextPilotOpenAILike":
        from contextpilot_integrations.llama_index.llms import ContextPilotOpenAILike

        return ContextPilotOpenAILike
    if name == "ContextPilotAnthropic":
        from contextpilot_integrations.llama_index.anthropic import ContextPilotAnthropic

        return ContextPilotAnthropic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
