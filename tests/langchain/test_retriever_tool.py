"""retriever_tool: labelled documents as the tool's content, the Documents as its artifact, the
order annotation when a ContextPilotRetriever reordered them; sync and async."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import ToolMessage
from langchain_support import Bm25sRetriever

from contextpilot_integrations import ContextPilot, PromptLayout
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import ContextPilotRetriever
from contextpilot_integrations.langchain.retriever_tool import retriever_tool


def call(query: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"type": "tool_call", "name": "search", "args": {"query": query}, "id": call_id}


def test_plain_retriever_documents_are_labelled_in_order(topic_documents: list[Document]) -> None:
    retriever = Bm25sRetriever(documents=topic_documents, k=3)
    tool = retriever_tool(retriever, "search", "Search the notes.")
    assert tool.name == "search" and tool.description == "Search the notes."
    assert set(tool.args) == {"query"} and tool.response_format == "content_and_artifact"

    message = tool.invoke(call("kv cache prefix"))
    expected = retriever.invoke("kv cache prefix")
    assert isinstance(message, ToolMessage) and message.tool_call_id == "call_1"
    assert message.artifact == expected
    layout = PromptLayout()
    assert message.content == "".join(
        layout.render_block(i, d.page_content) for i, d in enumerate(expected)
    )
    assert message.content.startswith("[Doc 1]\n") and "priority order" not in message.content


def test_reordered_documents_carry_the_order_annotation(topic_documents: list[Document]) -> None:
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents, k=4))
    tool = retriever_tool(retriever, "search", "Search the notes.")
    first = tool.invoke(call("kv cache prefix radix", "call_1"))
    second = tool.invoke(call("prefix cache eviction radix", "call_2"))

    assert "priority order" not in first.content  # retriever order kept: nothing to annotate
    entries = [d.metadata[METADATA_KEY] for d in second.artifact]
    assert [e["label"] for e in entries] == ["[Doc 1]", "[Doc 2]", "[Doc 3]", "[Doc 4]"]
    assert [e["index"] for e in entries] != sorted(e["index"] for e in entries)  # reordered
    for entry, document in zip(entries, second.artifact, strict=True):
        assert f"{entry['label']}\n{document.page_content}\n-----\n" in second.content
    # The annotation lists the labels in the retriever's (relevance) order.
    by_rank = [e["label"] for e in sorted(entries, key=lambda e: e["index"])]
    annotation = re.search(r"priority order: (.*)\.\n$", second.content)
    assert annotation is not None and annotation.group(1).split(" > ") == by_rank


def test_the_pilot_layout_or_the_given_one_names_the_documents(
    topic_documents: list[Document],
) -> None:
    layout = PromptLayout(label_template="[Source {position}]")
    base = Bm25sRetriever(documents=topic_documents, k=2)
    planned = ContextPilotRetriever(base_retriever=base, pilot=ContextPilot(layout=layout))
    message = retriever_tool(planned, "search", "Search.").invoke(call("bm25"))
    assert message.content.startswith("[Source 1]\n") and "[Source 2]\n" in message.content
    assert message.artifact[0].metadata[METADATA_KEY]["label"] == "[Source 1]"

    given = retriever_tool(base, "search", "Search.", layout=layout).invoke(call("bm25"))
    assert given.content == message.content


def test_async_gives_the_same_result(topic_documents: list[Document]) -> None:
    def tool() -> Any:
        retriever = ContextPilotRetriever(
            base_retriever=Bm25sRetriever(documents=topic_documents, k=4)
        )
        return retriever_tool(retriever, "search", "Search.")

    queries = ["kv cache prefix radix", "prefix cache eviction radix"]
    sync_tool, async_tool = tool(), tool()
    sync = [sync_tool.invoke(call(q)) for q in queries]

    async def run() -> list[ToolMessage]:
        return [await async_tool.ainvoke(call(q)) for q in queries]

    for a, s in zip(asyncio.run(run()), sync, strict=True):
        assert a.content == s.content
        assert [d.page_content for d in a.artifact] == [d.page_content for d in s.artifact]


def test_bad_arguments_are_refused(topic_documents: list[Document]) -> None:
    retriever = Bm25sRetriever(documents=topic_documents)
    with pytest.raises(TypeError, match="retriever must be a BaseRetriever"):
        retriever_tool(object(), "search", "Search.")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        retriever_tool(retriever, "", "Search.")
    with pytest.raises(TypeError, match="description must be a non-empty str"):
        retriever_tool(retriever, "search", None)  # type: ignore[arg-type]
