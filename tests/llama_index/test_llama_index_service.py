"""The post-processor with the index service's client as its pilot: a real
``contextpilot-server`` process shared by two "app processes" (two clients), on the sync path
(``plan``) and the async path (``await aplan``), in a query engine and a two-turn chat."""

from __future__ import annotations

import asyncio

from llama_index.core import get_response_synthesizer
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.llms import MockLLM

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.core.plan import PlacementStatus
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    chat_context_template,
    text_qa_template,
)


def test_two_clients_share_one_index_sync_and_async(
    service_url, retrieved, questions, recorder
) -> None:
    first = ContextPilotNodePostprocessor(ContextPilotClient(service_url, fallback=False))
    second = ContextPilotNodePostprocessor(ContextPilotClient(service_url, fallback=False))
    one = first.postprocess_nodes(retrieved[0], query_str=questions[0])

    async def ask() -> list:  # type: ignore[type-arg]
        return await second.apostprocess_nodes(retrieved[13], query_str=questions[13])

    two = asyncio.run(ask())  # another "process", the same articles in another order
    plan = second.plan_for(two)
    assert plan is not None and plan.matched_prefix_blocks == len(two)
    assert [n.node.node_id for n in two] == [n.node.node_id for n in one]
    assert {n.node.metadata[METADATA_KEY]["status"] for n in two} == {PlacementStatus.SHOWN}
    # The template renders the client's plan exactly.
    synthesizer = get_response_synthesizer(llm=MockLLM(), text_qa_template=text_qa_template(second))
    synthesizer.synthesize(questions[13], two)
    assert recorder.prompts[-1] == plan.prompt


def test_chat_through_the_service_deduplicates_the_second_turn(service_url, bm25) -> None:
    pp = ContextPilotNodePostprocessor(ContextPilotClient(service_url, fallback=False))
    chat_pp = pp.for_conversation(tenant="acme")
    chat = CondensePlusContextChatEngine.from_defaults(
        bm25,
        llm=MockLLM(),
        node_postprocessors=[chat_pp],
        context_prompt=chat_context_template(chat_pp),
    )

    async def talk() -> list:  # type: ignore[type-arg]
        question = "What did Apple say in court about its Google search deal?"
        return [await chat.achat(question), await chat.achat(question)]

    first, second = asyncio.run(talk())
    plan_1, plan_2 = chat_pp.plan_for(first.source_nodes), chat_pp.plan_for(second.source_nodes)
    assert (plan_1.scope.turn, plan_2.scope.turn) == (1, 2)  # type: ignore[union-attr]
    statuses = {n.node.metadata[METADATA_KEY]["status"] for n in second.source_nodes}
    assert statuses == {PlacementStatus.REPLACED}
