"""Overlapping searches in a real ``create_agent`` loop: the second result's documents that the
first result holds become pointers naming their ``[Doc n]`` label in it, and every other byte of
the second result (its other documents, labels, separators, order annotation) is sent as the
tool returned it.

The search tool is :func:`~contextpilot_integrations.langchain.retriever_tool.retriever_tool`
over a ContextPilotRetriever, so its results are the library's own rendered blocks; the two
searches share two of their three documents but not their whole text, so only the per-document
rule can remove anything.
"""

from __future__ import annotations

from typing import Any

from agent_support import (
    SYSTEM,
    ScriptedChatModel,
    artifacts_of,
    assert_no_dangling,
    assert_prefix_stable,
    final,
    search_call,
    thread,
)
from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.retrievers import BaseRetriever
from langgraph.checkpoint.memory import InMemorySaver

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.langchain import ContextPilotRetriever
from contextpilot_integrations.langchain.agent_middleware import ContextPilotMiddleware
from contextpilot_integrations.langchain.retriever_tool import retriever_tool

NOTES = {
    "kv": "The KV cache stores the attention keys and values of every token the engine has "
    "already processed, so the prefix of a prompt it has served is not computed again; its size "
    "grows with the number of layers, heads and tokens held.",
    "prefix": "Prefix caching reuses the KV cache of the longest byte-identical prompt prefix "
    "across requests; it pays off when many requests start with the same system prompt and the "
    "same documents, in the same order.",
    "radix": "A radix tree indexes the cached prompt prefixes by their token ids; SGLang's radix "
    "cache evicts the least recently used leaves first when GPU memory runs out, so a prefix "
    "that is shared by running requests stays.",
    "evict": "When the engine evicts a cached prefix the context index must drop that request, "
    "or it keeps steering later requests toward a prefix that is no longer there and their "
    "time to first token gets worse instead of better.",
}
RESULTS = {
    "kv cache prefix": ["kv", "prefix", "radix"],
    "radix cache eviction": ["evict", "radix", "prefix"],
}


class FixedRetriever(BaseRetriever):
    """Returns the notes ``RESULTS`` lists for a query, in that order."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [Document(page_content=NOTES[k], metadata={"source": k}) for k in RESULTS[query]]


def agent_with(model: ScriptedChatModel, middleware: ContextPilotMiddleware) -> Any:
    search = retriever_tool(
        ContextPilotRetriever(base_retriever=FixedRetriever()), "search", "Search the notes."
    )
    return create_agent(
        model,
        [search],
        system_prompt=SYSTEM,
        middleware=[middleware],
        checkpointer=InMemorySaver(),
    )


def test_overlapping_searches_send_the_shared_documents_as_pointers() -> None:
    model = ScriptedChatModel(
        script=[
            search_call("kv cache prefix", "c1"),
            search_call("radix cache eviction", "c2"),
            final("Radix trees index prefixes; evictions must reach the index."),
        ]
    )
    middleware = ContextPilotMiddleware(tenant="acme")
    state = agent_with(model, middleware).invoke(
        {"messages": [HumanMessage("How are cached prefixes evicted?")]}, thread("t1")
    )

    first, second = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert isinstance(first.content, str) and isinstance(second.content, str)
    assert first.content.startswith("[Doc 1]\n") and second.content.startswith("[Doc 1]\n")
    assert first.content != second.content  # no whole-result pointer can be made
    label_in_first = {d.metadata["source"]: f"[Doc {i}]" for i, d in enumerate(first.artifact, 1)}

    received = [messages for messages, _ in model.calls]
    assert len(received) == 3
    assert_prefix_stable(received)
    sent = received[2][-1]
    assert isinstance(sent, ToolMessage) and sent.id == second.id
    call = 'search({"query": "kv cache prefix"})'
    expected, removed = second.content, 0
    count = ApproxTokenCounter().count  # the planner's default counter
    for document in second.artifact:
        source = document.metadata["source"]
        if source in label_in_first:  # shared: a pointer to its label in the first result
            pointer = f"[Same as document {label_in_first[source]} of {call} above.]"
            expected = expected.replace(document.page_content, pointer)
            removed += count(document.page_content) - count(pointer)
    assert sent.content == expected  # the new document, labels and tail exactly as returned
    assert NOTES["evict"] in sent.content
    assert sent.content.count("[Same as document [Doc ") == 2
    annotation = second.content[second.content.rindex("-----\n") :]
    assert "priority order" in annotation  # the pilot reordered: its annotation is kept
    assert sent.content.endswith(annotation)

    # Each pointer names a call whose result stands in full in the same request and holds the
    # text of the documents the pointer stands for (checked against the tool's artifact).
    pointed = {second.tool_call_id: [d for d in second.artifact if d.metadata["source"] != "evict"]}
    assert assert_no_dangling(received[2], {**artifacts_of(state["messages"]), **pointed}) == 2
    assert state["messages"][-2].content == second.content  # the state keeps the tool's output

    stats = middleware.stats()
    assert stats["new_pointers"] == 2 and stats["tokens_removed"] == removed > 0
