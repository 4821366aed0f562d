"""The post-processor inside LlamaIndex's own engines: ``as_query_engine`` over a FAISS
``VectorStoreIndex`` with the real all-MiniLM-L6-v2 embeddings, ``RetrieverQueryEngine`` over
BM25, ``condense_plus_context`` chat (two turns, sync and async), and a Workflow."""

from __future__ import annotations

import asyncio

from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.plan import PlacementStatus
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    chat_context_template,
    text_qa_template,
)

SHOWN = PlacementStatus.SHOWN
REPLACED = PlacementStatus.REPLACED
TURN_HEADER = PromptLayout().turn_header


def _status(response) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.node.metadata["contextpilot"]["status"] for n in response.source_nodes]


def test_vector_query_engine_sync_and_async(vector_index, questions, recorder, top_k) -> None:
    pp = ContextPilotNodePostprocessor()
    engine = vector_index.as_query_engine(
        llm=MockLLM(),
        similarity_top_k=top_k,
        node_postprocessors=[pp],
        text_qa_template=text_qa_template(pp),
    )
    baseline = vector_index.as_query_engine(llm=MockLLM(), similarity_top_k=top_k)
    first = engine.query(questions[0])
    # The stored nodes are untouched: a plain engine renders them without contextpilot keys.
    plain = baseline.query(questions[0])
    assert "contextpilot" not in str(plain) and len(plain.source_nodes) == top_k

    async def ask() -> list:  # type: ignore[type-arg]
        # The last one repeats question 0: the same nodes, so the whole prefix is reused.
        return [await engine.aquery(q) for q in (*questions[1:4], questions[0])]

    responses = [first, *asyncio.run(ask())]
    prompts = [recorder.prompts[0], *recorder.prompts[2:]]
    assert len(prompts) == 5
    for response, prompt in zip(responses, prompts):
        plan = pp.plan_for(response.source_nodes)
        assert plan is not None and str(response) == prompt == plan.prompt  # MockLLM echoes
        assert len(response.source_nodes) == top_k
        assert set(_status(response)) == {SHOWN}
    # Whatever prefix the index matched is byte-identical to the start of an earlier prompt.
    layout = PromptLayout()
    for i, response in enumerate(responses):
        plan = pp.plan_for(response.source_nodes)
        head = layout.system_segment() + "".join(plan.segments[1 : 1 + plan.matched_prefix_blocks])  # type: ignore[union-attr]
        if plan.matched_prefix_blocks:  # type: ignore[union-attr]
            assert any(p.startswith(head) for p in prompts[:i])
    assert pp.plan_for(responses[-1].source_nodes).matched_prefix_blocks == top_k  # type: ignore[union-attr]
    assert prompts[-1] == prompts[0]


def test_retriever_query_engine_over_bm25(bm25, questions, recorder, top_k) -> None:
    pp = ContextPilotNodePostprocessor()
    engine = RetrieverQueryEngine.from_args(
        bm25, llm=MockLLM(), node_postprocessors=[pp], text_qa_template=text_qa_template(pp)
    )
    for question in questions[:10]:
        response = engine.query(question)
        assert str(response) == pp.plan_for(response.source_nodes).prompt  # type: ignore[union-attr]
    assert pp.pilot.stats()["requests"] == 10  # type: ignore[attr-defined]
    # Question 13 retrieves the same four articles as question 0: full prefix reuse.
    again = engine.query(questions[13])
    assert pp.plan_for(again.source_nodes).matched_prefix_blocks == top_k  # type: ignore[union-attr]
    head = recorder.prompts[0][: recorder.prompts[0].rindex("-----\n") + len("-----\n")]
    assert recorder.prompts[-1].startswith(head)


def _chat_engine(bm25, pp: ContextPilotNodePostprocessor) -> CondensePlusContextChatEngine:  # type: ignore[no-untyped-def]
    return CondensePlusContextChatEngine.from_defaults(
        bm25,
        llm=MockLLM(),
        node_postprocessors=[pp],
        context_prompt=chat_context_template(pp),
    )


TURN_1 = "What did Apple say in court about its Google search deal?"
TURN_2 = "And what did Google pay Apple and Samsung for that default?"


def _check_two_turns(pp: ContextPilotNodePostprocessor, replies, prompts, top_k: int) -> None:  # type: ignore[no-untyped-def]
    first, second = replies
    # Turn 1 answers at once (no history to condense); turn 2 condenses, then answers.
    answer_1, condense_2, answer_2 = prompts
    assert TURN_2 in condense_2 and answer_2.endswith(f"user: {TURN_2}\nassistant: ")
    plan_1, plan_2 = pp.plan_for(first.source_nodes), pp.plan_for(second.source_nodes)
    assert plan_1.scope.turn == 1 and plan_2.scope.turn == 2  # type: ignore[union-attr]
    assert plan_2.scope.conversation == pp.scope.conversation  # type: ignore[union-attr]
    # Turn 2 de-duplicates against turn 1: repeated documents become hints naming turn 1 ...
    replaced = [
        n for n in second.source_nodes if n.node.metadata["contextpilot"]["status"] == REPLACED
    ]
    assert replaced and plan_2.dedup_figures.blocks_replaced == len(replaced)  # type: ignore[union-attr]
    for node in replaced:
        hint = node.node.metadata["contextpilot"]["hint"]
        assert "of turn 1" in hint and hint in answer_2
    # ... whose text stands, in full, in turn 2's own prompt: turn 2's system message starts
    # with turn 1's documents, byte for byte (a prefix-cache hit on all of them).
    layout = PromptLayout()
    turn_1_docs = (
        "system: "
        + layout.system_segment()
        + TURN_HEADER.format(turn=1)
        + "".join(plan_1.segments[1:-1])  # type: ignore[union-attr]
    )
    assert answer_1.startswith(turn_1_docs) and answer_2.startswith(turn_1_docs)
    for node in replaced:
        assert node.node.get_content(metadata_mode=MetadataMode.LLM).strip() in turn_1_docs
    # Nothing lost: every retrieved node is kept or replaced.
    assert len(second.source_nodes) == top_k


def test_chat_engine_second_turn_deduplicates_against_the_first(bm25, recorder, top_k) -> None:
    pp = ContextPilotNodePostprocessor().for_conversation()
    chat = _chat_engine(bm25, pp)
    replies = [chat.chat(TURN_1), chat.chat(TURN_2)]
    _check_two_turns(pp, replies, recorder.prompts, top_k)


def test_async_chat_engine_two_turns(bm25, recorder, top_k) -> None:
    pp = ContextPilotNodePostprocessor().for_conversation("async-chat", tenant="acme")
    chat = _chat_engine(bm25, pp)

    async def talk() -> list:  # type: ignore[type-arg]
        return [await chat.achat(TURN_1), await chat.achat(TURN_2)]

    _check_two_turns(pp, asyncio.run(talk()), recorder.prompts, top_k)


def test_chat_context_is_the_layouts_turn_assembly(bm25, recorder) -> None:
    """The turn header is the layout's field, and the multi-turn context is exactly the core's
    ``render_turns`` of turn 1's section and turn 2's, then turn 2's hints and annotation."""
    layout = PromptLayout(turn_header="## Round {turn}\n")
    pp = ContextPilotNodePostprocessor(ContextPilot(layout=layout)).for_conversation()
    chat = _chat_engine(bm25, pp)
    first, second = chat.chat(TURN_1), chat.chat(TURN_2)
    plan_1, plan_2 = pp.plan_for(first.source_nodes), pp.plan_for(second.source_nodes)
    own_1, own_2 = plan_1.segments[1:-1], plan_2.segments[1:-1]  # type: ignore[union-attr]
    # Turn 2 adds a section of its own only where it shows a block (not only hints).
    turns = [(1, own_1), (2, own_2)] if own_2 else [(1, own_1)]
    segments, _ = layout.render_turns(turns)
    context = layout.system_segment() + "".join(segments) + plan_2.context_tail  # type: ignore[union-attr]
    assert "## Round 1\n" in context and plan_2.hints  # type: ignore[union-attr]
    assert recorder.prompts[-1].startswith("system: " + context)
    assert "### Turn" not in recorder.prompts[-1]


def test_context_chat_engine_repeats_turn_one_and_hints_the_repeats(bm25, recorder) -> None:
    from llama_index.core.chat_engine import ContextChatEngine

    pp = ContextPilotNodePostprocessor().for_conversation()
    chat = ContextChatEngine.from_defaults(
        retriever=bm25,
        llm=MockLLM(),
        node_postprocessors=[pp],
        context_template=chat_context_template(pp),
    )
    first = chat.chat(TURN_1)
    second = chat.chat(TURN_1)  # the same documents again: every one is already shown
    assert set(_status(second)) == {REPLACED}
    head = recorder.prompts[0][: recorder.prompts[0].rindex("-----\n") + len("-----\n")]
    assert head.startswith("system: ") and recorder.prompts[1].startswith(head)
    assert {n.node.node_id for n in first.source_nodes} == {
        n.node.node_id for n in second.source_nodes
    }


def test_conversations_and_tenants_are_isolated(bm25, recorder) -> None:
    shared = ContextPilotNodePostprocessor()
    alice = shared.for_conversation("same-id", tenant="alice")
    bob = shared.for_conversation("same-id", tenant="bob")
    _chat_engine(bm25, alice).chat(TURN_1)
    reply = _chat_engine(bm25, bob).chat(TURN_1)
    assert set(_status(reply)) == {SHOWN}  # bob's first turn: nothing shown before
    assert bob.plan_for(reply.source_nodes).scope.turn == 1  # type: ignore[union-attr]
    # No conversation at all: a chat engine on the shared post-processor never de-duplicates.
    stateless = _chat_engine(bm25, shared)
    stateless.chat(TURN_1)
    reply = stateless.chat(TURN_1)
    assert set(_status(reply)) == {SHOWN}
    assert TURN_HEADER.format(turn=1) not in recorder.prompts[-1]


def test_workflow_step(bm25, questions, recorder, top_k) -> None:
    from llamaindex_workflow import RAGWorkflow

    pp = ContextPilotNodePostprocessor()
    workflow = RAGWorkflow(bm25, MockLLM(), pp, timeout=60)

    async def run() -> list:  # type: ignore[type-arg]
        return [await workflow.run(query=q) for q in (questions[0], questions[13])]

    first, second = asyncio.run(run())
    for response, prompt in zip((first, second), recorder.prompts):
        plan = pp.plan_for(response.source_nodes)
        assert plan is not None and prompt == plan.prompt == str(response)
    assert pp.plan_for(second.source_nodes).matched_prefix_blocks == top_k  # type: ignore[union-attr]
    baseline = RAGWorkflow(bm25, MockLLM(), None, timeout=60)

    async def run_baseline():  # type: ignore[no-untyped-def]
        return await baseline.run(query=questions[0])

    plain = asyncio.run(run_baseline())
    assert "[Doc 1]" not in str(plain) and "Context information is below" in str(plain)
