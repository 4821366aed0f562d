"""The hosted APIs' cache controls through the real SDKs and integration packages (anthropic,
openai, langchain-anthropic, langchain-openai, llama-index-llms-anthropic,
llama-index-llms-openai) against the local server of ``conftest.py``: breakpoints where the
plan says, keys, usage read back, nothing below the minimum length, never more than four."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_openai import ChatOpenAI
from llama_index.core import get_response_synthesizer
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.schema import NodeWithScore, TextNode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotRetriever,
    format_documents,
    with_plan_fields,
)
from contextpilot_integrations.llama_index import (
    ContextPilotAnthropic,
    ContextPilotNodePostprocessor,
    ContextPilotOpenAI,
    text_qa_template,
)
from contextpilot_integrations.llama_index.request_ids import arm_plan
from contextpilot_integrations.llm_call.anthropic_breakpoints import ANTHROPIC_MAX_BREAKPOINTS
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.engine_fields import (
    CacheUsageTracker,
    create_chat_completion,
)
from contextpilot_integrations.llm_call.hosted_cache import create_message
from contextpilot_integrations.llm_call.openai_cache_key import prompt_cache_key

# Eight documents of about 400 tokens each (by the approximate counter, 4 bytes a token).
DOCS = [
    f"Document {i} on topic {i}. " + f"Fact {i} is stated in this sentence. " * 42 for i in range(8)
]
# Three requests: B shares A's first three documents (1,200+ tokens: above Sonnet's 1,024
# minimum), C shares B's first three again.
REQUESTS = {
    "question A": [0, 1, 2, 3],
    "question B": [0, 1, 2, 5],
    "question C": [0, 1, 2, 6],
}


def texts(question: str) -> list[str]:
    return [DOCS[i] for i in REQUESTS[question]]


def marks(body: dict[str, Any]) -> list[tuple[str, int]]:
    """``(where, block index)`` of every cache_control in an Anthropic body."""
    out = [("tools", i) for i, t in enumerate(body.get("tools") or []) if "cache_control" in t]
    system = body.get("system")
    if isinstance(system, list):
        out += [("system", i) for i, b in enumerate(system) if "cache_control" in b]
    for m, message in enumerate(body["messages"]):
        content = message["content"]
        if isinstance(content, list):
            out += [(f"message {m}", i) for i, b in enumerate(content) if "cache_control" in b]
    return out


def joined_text(body: dict[str, Any]) -> str:
    parts = []
    for message in body["messages"]:
        content = message["content"]
        parts.append(content if isinstance(content, str) else "".join(b["text"] for b in content))
    return "".join(parts)


class FixedRetriever(BaseRetriever):
    """Returns the documents of ``REQUESTS[query]`` in that order."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [Document(page_content=t) for t in texts(query)]


# ---------------------------------------------------------------------- the plain SDKs
def test_anthropic_sdk_breakpoint_after_the_shared_prefix_then_a_read(hosted_server):
    url, state = hosted_server
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    usages = []
    for question in REQUESTS:
        plan = pilot.plan(question, texts(question))
        response = create_message(
            client, plan, model="claude-sonnet-4-6", max_tokens=16, tracker=tracker
        )
        body = state.last("messages")
        assert joined_text(body) == "".join(plan.segments[1:])  # the text is the plan's
        usages.append(response.usage)
        if question == "question A":
            assert plan.shared_prefix_blocks == 0 and marks(body) == []  # nothing shared yet
        else:
            assert plan.shared_prefix_blocks == 3
            # one block per rendered document: the third ends the shared prefix
            assert marks(body) == [("message 0", 2)]
    assert usages[0].cache_creation_input_tokens == 0 and usages[0].cache_read_input_tokens == 0
    assert usages[1].cache_creation_input_tokens > 1024 and usages[1].cache_read_input_tokens == 0
    assert usages[2].cache_read_input_tokens == usages[1].cache_creation_input_tokens
    stats = tracker.stats()
    assert stats["cache_write_tokens"] == usages[1].cache_creation_input_tokens
    assert stats["cached_tokens"] == usages[2].cache_read_input_tokens
    usage = pilot.stats()["usage"]
    assert usage["cache_write_tokens"] == stats["cache_write_tokens"]
    assert usage["cached_tokens"] == stats["cached_tokens"]


def test_anthropic_below_the_model_minimum_no_breakpoint(hosted_server):
    url, state = hosted_server
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    for question in REQUESTS:  # the shared 1,200 tokens are below Haiku 4.5's 4,096
        plan = pilot.plan(question, texts(question))
        create_message(client, plan, model="claude-haiku-4-5", max_tokens=16, tracker=tracker)
        assert marks(state.last("messages")) == []
    assert tracker.stats()["cache_write_tokens"] == 0
    assert tracker.stats()["uncached_requests"] == len(REQUESTS)


def test_openai_sdk_prompt_cache_key_per_prefix_group(hosted_server):
    url, state = hosted_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    keys = []
    for question in [*REQUESTS, "other"]:
        blocks = texts(question) if question in REQUESTS else [DOCS[7], DOCS[4]]
        plan = pilot.plan(question, blocks)
        create_chat_completion(
            client,
            plan,
            engine="openai",
            model="gpt-4.1",
            tracker=tracker,
            prompt_cache_retention="24h",
        )
        body = state.last("chat")
        assert "rid" not in body and "session_id" not in body  # OpenAI refuses unknown fields
        assert body["prompt_cache_retention"] == "24h"
        keys.append(body["prompt_cache_key"])
        assert body["prompt_cache_key"] == prompt_cache_key(CachePrefix.of(plan))
    assert keys[0] == keys[1] == keys[2] != keys[3]
    assert tracker.stats()["cached_tokens"] >= 1024  # B and C hit A's cached prefix


# ---------------------------------------------------------------------- LangChain
def test_langchain_chat_anthropic_one_line(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    llm = ChatAnthropic(model="claude-sonnet-4-6", base_url=url, api_key="test", max_retries=0)
    chain = (
        {
            "context": ContextPilotRetriever(base_retriever=FixedRetriever(), pilot=pilot)
            | format_documents,
            "question": RunnablePassthrough(),
        }
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(llm, engine="anthropic", tracker=tracker)
    )
    for question in REQUESTS:
        assert chain.invoke(question).content == "answer [Doc 1]"
        body = state.last("messages")
        assert body["system"][0]["text"] == pilot.layout.system_prompt
        assert len(marks(body)) <= ANTHROPIC_MAX_BREAKPOINTS
        assert marks(body) == ([] if question == "question A" else [("message 0", 2)])
    stats = tracker.stats()
    assert stats["requests"] == 3 and stats["cache_write_tokens"] > 1024
    assert stats["cached_tokens"] == stats["cache_write_tokens"]  # C read what B wrote


def test_langchain_chat_openai_one_line(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    llm = ChatOpenAI(model="gpt-4.1", base_url=f"{url}/v1", api_key="test", max_retries=0)
    chain = (
        {
            "context": ContextPilotRetriever(base_retriever=FixedRetriever(), pilot=pilot)
            | format_documents,
            "question": RunnablePassthrough(),
        }
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(
            llm, engine="openai", prompt_cache_retention="in_memory", tracker=tracker
        )
    )
    keys = set()
    for question in REQUESTS:
        chain.invoke(question)
        body = state.last("chat")
        assert "rid" not in body and body["prompt_cache_retention"] == "in_memory"
        keys.add(body["prompt_cache_key"])
    assert len(keys) == 1
    assert tracker.stats()["cached_tokens"] >= 1024


# ---------------------------------------------------------------------- LlamaIndex
def nodes(question: str) -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in texts(question)]


def test_llama_index_anthropic_through_a_response_synthesizer(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    pp = ContextPilotNodePostprocessor(pilot)
    llm = ContextPilotAnthropic(
        model="claude-sonnet-4-6",
        base_url=url,
        api_key="test",
        max_retries=0,
        usage_tracker=tracker,
    )
    synthesizer = get_response_synthesizer(llm=llm, text_qa_template=text_qa_template(pp))
    for question in REQUESTS:
        planned = pp.postprocess_nodes(nodes(question), query_str=question)
        synthesizer.synthesize(question, planned)
        body = state.last("messages")
        assert marks(body) == ([] if question == "question A" else [("message 0", 2)])
    stats = tracker.stats()
    assert stats["requests"] == 3 and stats["cached_tokens"] == stats["cache_write_tokens"] > 0


def test_llama_index_anthropic_breakpoint_in_the_system_message(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    llm = ContextPilotAnthropic(model="claude-sonnet-4-6", base_url=url, api_key="test")
    for question in REQUESTS:
        plan = pilot.plan(question, texts(question))
        arm_plan(plan)
        # the chat template's form: the documents in the system message
        system = plan.layout.system_segment() + plan.context
        llm.chat(
            [
                ChatMessage(role=MessageRole.SYSTEM, content=system),
                ChatMessage(role=MessageRole.USER, content=question),
            ]
        )
        body = state.last("messages")
        sent = body["system"]  # blocks (in extra_body) only where a breakpoint stands
        assert (sent if isinstance(sent, str) else "".join(b["text"] for b in sent)) == system
        assert marks(body) == ([] if question == "question A" else [("system", 3)])


def test_llama_index_openai_prompt_cache_key(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    pp = ContextPilotNodePostprocessor(pilot)
    llm = ContextPilotOpenAI(
        model="gpt-4.1", api_base=f"{url}/v1", api_key="test", prompt_cache_retention="24h"
    )
    synthesizer = get_response_synthesizer(llm=llm, text_qa_template=text_qa_template(pp))
    keys = set()
    for question in REQUESTS:
        synthesizer.synthesize(question, pp.postprocess_nodes(nodes(question), query_str=question))
        body = state.last("chat")
        assert "rid" not in body and body["prompt_cache_retention"] == "24h"
        keys.add(body["prompt_cache_key"])
    assert len(keys) == 1


def test_more_than_four_breakpoints_is_refused_by_the_server(hosted_server):
    """The stand-in enforces the provider's limit, so the tests above would see a violation."""
    url, _ = hosted_server
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    content = [
        {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}} for t in DOCS[:5]
    ]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="claude-sonnet-4-6", max_tokens=8, messages=[{"role": "user", "content": content}]
        )


# ---------------------------------------------------------------------- markers on tools
MARK = {"cache_control": {"type": "ephemeral"}}


def marked_tool(name: str) -> dict[str, Any]:
    """An Anthropic tool definition carrying a breakpoint."""
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"name": name, "description": f"Tool {name}.", "input_schema": schema, **MARK}


def planned_requests(pilot: ContextPilot) -> list[Any]:
    return [pilot.plan(question, texts(question)) for question in REQUESTS]


def test_anthropic_sdk_counts_tools_and_merges_the_apps_system(hosted_server):
    url, state = hosted_server
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    tools = [marked_tool("search"), marked_tool("lookup"), marked_tool("fetch")]
    history = [
        {"role": "user", "content": [{"type": "text", "text": DOCS[7], **MARK}]},
        {"role": "assistant", "content": "noted"},
    ]
    for plan in planned_requests(ContextPilot()):
        create_message(
            client,
            plan,
            model="claude-sonnet-4-6",
            max_tokens=16,
            history=history,
            tools=tools,
            system="You answer in one line.",
        )
        body = state.last("messages")
        assert len(marks(body)) == ANTHROPIC_MAX_BREAKPOINTS  # three tools and the app's one
        assert [b["text"] for b in body["system"]][0] == "You answer in one line."
        assert body["system"][-1]["text"] == plan.messages[0]["content"]


def test_langchain_bind_tools_markers_count(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    llm = ChatAnthropic(model="claude-sonnet-4-6", base_url=url, api_key="test", max_retries=0)
    tools = [marked_tool(f"t{i}") for i in range(3)]
    chain = (
        {
            "context": ContextPilotRetriever(base_retriever=FixedRetriever(), pilot=pilot)
            | format_documents,
            "question": RunnablePassthrough(),
        }
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(llm.bind_tools(tools), engine="anthropic")
    )
    placed = []
    for question in REQUESTS:
        chain.invoke(question)
        body = state.last("messages")
        assert len(marks(body)) <= ANTHROPIC_MAX_BREAKPOINTS
        placed.append([m for m in marks(body) if m[0] != "tools"])
    assert placed[1] == [("message 0", 2)]  # the one slot left: after the shared prefix
    four = with_plan_fields(llm.bind_tools([*tools, marked_tool("t3")]), engine="anthropic")
    prompt = CONTEXTPILOT_PROMPT.invoke(
        {"context": format_documents.invoke(pilot_documents(pilot)), "question": "question B"}
    )
    four.invoke(prompt)
    assert marks(state.last("messages")) == [("tools", i) for i in range(4)]  # none added


def pilot_documents(pilot: ContextPilot) -> list[Document]:
    retriever = ContextPilotRetriever(base_retriever=FixedRetriever(), pilot=pilot)
    return retriever.invoke("question B")


def test_llama_index_anthropic_tools_markers_count(hosted_server):
    url, state = hosted_server
    pilot = ContextPilot()
    tools = [marked_tool(f"t{i}") for i in range(3)]
    llm = ContextPilotAnthropic(
        model="claude-sonnet-4-6", base_url=url, api_key="test", tools=tools
    )
    for question in REQUESTS:
        plan = pilot.plan(question, texts(question))
        arm_plan(plan)
        system = plan.layout.system_segment() + plan.context
        llm.chat(
            [
                ChatMessage(role=MessageRole.SYSTEM, content=system),
                ChatMessage(role=MessageRole.USER, content=question),
            ]
        )
        body = state.last("messages")
        assert len(marks(body)) <= ANTHROPIC_MAX_BREAKPOINTS
        expected = [] if question == "question A" else [("system", 3)]
        assert [m for m in marks(body) if m[0] != "tools"] == expected
    llm.tools = [*tools, marked_tool("t3")]
    plan = pilot.plan("question B", texts("question B"))
    arm_plan(plan)
    llm.chat(
        [
            ChatMessage(
                role=MessageRole.SYSTEM, content=plan.layout.system_segment() + plan.context
            ),
            ChatMessage(role=MessageRole.USER, content="question B"),
        ]
    )
    assert marks(state.last("messages")) == [("tools", i) for i in range(4)]


def test_an_empty_message_is_never_sent_as_an_empty_list(hosted_server):
    url, state = hosted_server
    client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)
    pilot = ContextPilot()
    plan = pilot.plan("question A", texts("question A"))
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]
    create_message(client, plan, model="claude-sonnet-4-6", max_tokens=8, history=history)
    assert state.last("messages")["messages"][1]["content"] == ""
