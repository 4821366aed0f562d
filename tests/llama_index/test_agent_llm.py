"""ContextPilotAgentLLM in real LlamaIndex ``FunctionAgent`` runs: a scripted function-calling
LLM (deterministic) that records what it is sent in the form ``llama-index-llms-openai`` puts
on the wire, a document-returning ``FunctionTool``, and ``OpenAILike`` against a local
OpenAI-compatible server.

What is checked on every LLM call is what the LLM received: repeated search results and
documents become pointers, every pointer holds on the received messages (the text it stands
for is verbatim in the earlier result it names, which is there) and stands for text the tool
really returned, later calls start with exactly the messages earlier calls were sent, and
another conversation (or tenant) replays nothing of the first. The prefill of the loop
(prompt tokens minus the longest common prefix with the previous call) is compared with the
same agent on the plain LLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.mock import MockLLM
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.tools import FunctionTool
from support.asgi_server import serve_in_thread

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.messages import MessagePlan, MessagePlanner
from contextpilot_integrations.core.messages.pointers import RequestView, check_pointer
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.llama_index import ContextPilotAgentLLM

openai_utils = pytest.importorskip("llama_index.llms.openai.utils")

SYSTEM = "You answer questions about serving LLMs. Search the notes before you answer."

DOCUMENTS = {
    "d1": (
        "The KV cache stores the attention keys and values of every token already processed, "
        "so decoding a new token attends to them without recomputing the whole prefix. Its "
        "size grows with the number of layers, heads, head dimension and sequence length."
    ),
    "d2": (
        "Prefix caching keeps the KV cache of finished requests and reuses it when a new "
        "request starts with the same tokens. SGLang organises the cached prefixes in a radix "
        "tree; vLLM hashes fixed-size blocks of tokens and looks each block up by its hash."
    ),
    "d3": (
        "A prefix hit skips the prefill of the matched tokens entirely: only the tokens after "
        "the longest cached prefix are computed. Reordering shared context so that it comes "
        "first, in the same order, turns repeated context into such hits."
    ),
    "d4": (
        "PagedAttention splits the KV cache into fixed-size pages allocated on demand, like "
        "virtual memory, which removes fragmentation and lets requests share pages of a common "
        "prefix through copy-on-write."
    ),
    "d5": (
        "Continuous batching admits new requests into the running batch at every decoding "
        "step instead of waiting for the whole batch to finish, which keeps the accelerator "
        "busy when output lengths differ widely."
    ),
    "d6": (
        "Speculative decoding drafts several tokens with a small model and verifies them with "
        "the large one in a single forward pass; accepted tokens cost one large-model step "
        "together, rejected ones are recomputed."
    ),
}
HITS = {
    "kv cache": ["d1", "d2", "d3"],
    "prefix caching": ["d2", "d3", "d4"],
    "paged attention": ["d4", "d5", "d1"],
    "batching": ["d5", "d6", "d3"],
}
# What the scripted model searches for on each question before it answers (MTRAG-like: later
# turns of the conversation come back to documents the earlier turns retrieved).
TURNS = {
    "What is a KV cache?": ["kv cache", "prefix caching"],
    "How does prefix caching save prefill?": ["prefix caching", "kv cache"],
    "And paged attention?": ["paged attention", "prefix caching"],
    "What else speeds up serving?": ["batching", "kv cache"],
}
QUESTIONS = list(TURNS)

POINTER = re.compile(
    r"\[Same (?:result as|as document .+? of|as the result of) "
    r"(?P<call>\w+\(.*?\)) above\.\]"
)


def search_numbered(query: str) -> str:
    """Search the notes on LLM serving."""
    hits = HITS.get(query, [])
    return "\n\n".join(f"[{k}] {DOCUMENTS[d]}" for k, d in enumerate(hits, 1))


def search_json(query: str) -> str:
    """Search the notes on LLM serving."""
    return json.dumps([{"id": d, "text": DOCUMENTS[d]} for d in HITS.get(query, [])])


def search_tool(search: Callable[[str], str] = search_numbered) -> FunctionTool:
    return FunctionTool.from_defaults(search, name="search")


# ---------------------------------------------------------------------------------- helpers
class ScriptedLLM(FunctionCallingLLM):
    """Searches for the queries of ``TURNS[question]`` one call at a time, then answers; records
    each request as ``llama-index-llms-openai`` sends it, and the message objects."""

    _requests: list[list[dict[str, Any]]] = PrivateAttr(default_factory=list)
    _received: list[list[ChatMessage]] = PrivateAttr(default_factory=list)

    @property
    def requests(self) -> list[list[dict[str, Any]]]:
        return self._requests

    @property
    def received(self) -> list[list[ChatMessage]]:
        return self._received

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_function_calling_model=True, model_name="scripted")

    def _respond(self, messages: Sequence[ChatMessage]) -> ChatResponse:
        self._received.append(list(messages))
        self._requests.append(
            [dict(m) for m in openai_utils.to_openai_message_dicts(list(messages))]
        )
        last_user = max(i for i, m in enumerate(messages) if m.role == MessageRole.USER)
        question = messages[last_user].content or ""
        step = sum(1 for m in messages[last_user:] if m.role == MessageRole.ASSISTANT)
        queries = TURNS.get(question, [])
        if step < len(queries):
            call = ToolCallBlock(
                tool_call_id=f"call-{len(messages)}",
                tool_name="search",
                tool_kwargs={"query": queries[step]},
            )
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=[call]))
        answer = f"Answer {last_user}."
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer))

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._respond(messages)

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._respond(messages)

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        response = self._respond(messages)
        return iter([response])

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        response = self._respond(messages)

        async def gen() -> Any:
            yield response

        return gen()

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=prompt)

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        return iter([CompletionResponse(text=prompt, delta=prompt)])

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return CompletionResponse(text=prompt)

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        async def gen() -> Any:
            yield CompletionResponse(text=prompt, delta=prompt)

        return gen()

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            messages.append(user_msg)
        return {"messages": messages, "tools": tools}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        return [
            ToolSelection(
                tool_id=b.tool_call_id or "",
                tool_name=b.tool_name,
                tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict) else {},
            )
            for b in response.message.blocks
            if isinstance(b, ToolCallBlock)
        ]


class RecordingPlanner(MessagePlanner):
    """A MessagePlanner that keeps every plan it returns (one per LLM call)."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[MessagePlan] = []

    def plan(self, messages: Any, **kwargs: Any) -> MessagePlan:
        plan = super().plan(messages, **kwargs)
        self.plans.append(plan)
        return plan


async def _run(
    llm: FunctionCallingLLM,
    questions: Sequence[str],
    tool: FunctionTool,
    streaming: bool,
) -> list[str]:
    agent = FunctionAgent(llm=llm, tools=[tool], system_prompt=SYSTEM, streaming=streaming)
    memory = ChatMemoryBuffer.from_defaults(token_limit=1_000_000)
    answers = []
    for question in questions:
        answers.append(str(await agent.run(question, memory=memory)))
    return answers


def run_agent(
    llm: FunctionCallingLLM,
    questions: Sequence[str] = QUESTIONS,
    tool: FunctionTool | None = None,
    streaming: bool = True,
) -> list[str]:
    """One conversation: ``questions`` asked in turn of one agent with one memory."""
    return asyncio.run(_run(llm, questions, tool or search_tool(), streaming))


def render(messages: Sequence[dict[str, Any]]) -> str:
    """A ChatML-like prompt of wire messages (what an engine tokenises)."""
    parts = []
    for m in messages:
        calls = json.dumps(m["tool_calls"]) if m.get("tool_calls") else ""
        parts.append(f"<|im_start|>{m['role']}\n{m.get('content') or ''}{calls}<|im_end|>\n")
    return "".join(parts)


def prefill(requests: Sequence[Sequence[dict[str, Any]]]) -> tuple[int, int]:
    """(prompt tokens, prefill tokens) summed over the calls: prefill is the prompt minus its
    longest common prefix with the previous call (what a prefix cache does not hold)."""
    count = ApproxTokenCounter().count
    prompt = filled = 0
    previous = ""
    for request in requests:
        text = render(request)
        common = 0
        for a, b in zip(text, previous, strict=False):
            if a != b:
                break
            common += 1
        prompt += count(text)
        filled += count(text) - count(text[:common])
        previous = text
    return prompt, filled


def wire(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


def assert_prefix_stable(requests: Sequence[Sequence[dict[str, Any]]]) -> None:
    """Every call's messages start with exactly (byte for byte) the previous call's."""
    for before, after in zip(requests, requests[1:], strict=False):
        assert [wire(m) for m in after[: len(before)]] == [wire(m) for m in before]


def assert_pointers_hold(
    plans: Sequence[MessagePlan],
    requests: Sequence[Sequence[dict[str, Any]]],
    plain: Sequence[Sequence[dict[str, Any]]],
) -> int:
    """Every pointer of every call holds on the messages the LLM received, and stands for text
    the tool returned at that place (the plain run's request). Returns the pointers checked."""
    assert len(plans) == len(requests) == len(plain)
    checked = 0
    for plan, request, original in zip(plans, requests, plain, strict=True):
        view = RequestView(request, "openai")
        for placement in plan.pointers:
            assert check_pointer(view, placement), placement
            sent = request[placement.message]["content"]
            assert placement.pointer is not None and placement.offset is not None
            assert sent[placement.offset :].startswith(placement.pointer)
            assert placement.original is not None
            assert placement.original in original[placement.message]["content"]
            target = request[placement.target_message]["content"]  # type: ignore[index]
            assert placement.original.strip() in target
            assert not POINTER.fullmatch(target.strip())
            checked += 1
        for message in request:
            if message["role"] == "tool":
                for match in POINTER.finditer(message["content"]):
                    assert any(
                        match.group(0) == p.pointer
                        for p in plan.pointers
                        if p.message == request.index(message)
                    ), match.group(0)
    return checked


# ---------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "not-streaming"])
def test_later_calls_get_pointers_the_prefix_stays_stable_and_no_pointer_dangles(
    streaming: bool,
) -> None:
    plain = ScriptedLLM()
    answers_plain = run_agent(plain, streaming=streaming)
    inner = ScriptedLLM()
    planner = RecordingPlanner()
    llm = ContextPilotAgentLLM(inner, planner=planner, tenant="acme", conversation_id="c-1")
    answers = run_agent(llm, streaming=streaming)

    assert answers == answers_plain
    assert len(inner.requests) == len(plain.requests) == len(planner.plans)
    assert_prefix_stable(inner.requests)
    assert_prefix_stable(plain.requests)
    assert assert_pointers_hold(planner.plans, inner.requests, plain.requests) > 0
    last = inner.requests[-1]
    tool_texts = [m["content"] for m in last if m["role"] == "tool"]
    assert any(t.startswith("[Same result as search(") for t in tool_texts)
    assert any("[Same as document [" in t for t in tool_texts)
    # The first search's result stands in full; the agent's memory kept the tool's own text.
    assert tool_texts[0] == search_numbered("kv cache")
    assert all(p.replayed for p in planner.plans[-1].pointers[:-1])
    stats = llm.stats()
    assert stats["calls"] == len(inner.requests)
    assert stats["conversations"]["acme"]["c-1"]["new_pointers"] > 0


def test_prefill_against_the_plain_llm(capsys: pytest.CaptureFixture[str]) -> None:
    plain = ScriptedLLM()
    run_agent(plain)
    inner = ScriptedLLM()
    run_agent(ContextPilotAgentLLM(inner, conversation_id="c-1"))

    prompt_plain, prefill_plain = prefill(plain.requests)
    prompt, filled = prefill(inner.requests)
    ratio = filled / prefill_plain
    with capsys.disabled():
        print(
            f"\nFunctionAgent loop, {len(inner.requests)} LLM calls: prompt tokens "
            f"{prompt}/{prompt_plain} ({prompt / prompt_plain:.3f}), prefill tokens "
            f"{filled}/{prefill_plain} (ratio {ratio:.3f})"
        )
    assert ratio < 1.0
    assert prompt < prompt_plain


def test_json_documents_get_pointers_and_stay_valid_json() -> None:
    plain = ScriptedLLM()
    run_agent(plain, tool=search_tool(search_json))
    inner = ScriptedLLM()
    planner = RecordingPlanner()
    run_agent(
        ContextPilotAgentLLM(inner, planner=planner, conversation_id="c-json"),
        tool=search_tool(search_json),
    )

    assert_prefix_stable(inner.requests)
    assert assert_pointers_hold(planner.plans, inner.requests, plain.requests) > 0
    for request in inner.requests:
        for message in request:
            if message["role"] == "tool" and not message["content"].startswith("[Same result"):
                json.loads(message["content"])


def test_another_conversation_or_tenant_gets_nothing_from_the_first() -> None:
    planner = RecordingPlanner()
    first = ScriptedLLM()
    run_agent(ContextPilotAgentLLM(first, planner=planner, tenant="acme", conversation_id="c-1"))
    calls = len(planner.plans)
    others = []
    for tenant, conversation in (("acme", "c-2"), ("other", "c-1")):
        inner = ScriptedLLM()
        start = len(planner.plans)
        llm = ContextPilotAgentLLM(
            inner, planner=planner, tenant=tenant, conversation_id=conversation
        )
        # The second question first: a shared memory would replay the system prompt and
        # diverge at the question.
        run_agent(llm, QUESTIONS[1:])
        assert planner.plans[start].replayed == 0
        assert planner.plans[start].diverged_at is None
        others.append(inner.requests)

    # Planned as a conversation of their own: the same as a fresh planner plans them.
    alone = ScriptedLLM()
    run_agent(ContextPilotAgentLLM(alone, conversation_id="c-9"), QUESTIONS[1:])
    assert others[0] == others[1] == alone.requests
    assert planner.conversations == 3
    assert len(planner.plans) == calls + 2 * len(alone.requests)


def test_without_a_conversation_nothing_is_remembered() -> None:
    planner = RecordingPlanner()
    inner = ScriptedLLM()
    llm = ContextPilotAgentLLM(inner, planner=planner)
    run_agent(llm)

    bound = ScriptedLLM()
    run_agent(ContextPilotAgentLLM(bound, conversation_id="c-1"))
    assert planner.conversations == 0
    assert all(plan.replayed == 0 for plan in planner.plans)
    # Each call planned alone plans the history the same way: the same messages go out.
    assert inner.requests == bound.requests
    assert llm.stats()["conversations"] == {}


def test_for_conversation_without_an_id_is_a_new_conversation() -> None:
    llm = ContextPilotAgentLLM(ScriptedLLM(), tenant="acme")
    a, b = llm.for_conversation(), llm.for_conversation()
    assert a.conversation_id and b.conversation_id and a.conversation_id != b.conversation_id
    assert a.tenant == b.tenant == "acme"
    assert a.planner is llm.planner and a.llm is llm.llm
    other = llm.for_conversation("c-1", tenant="other")
    assert (other.conversation_id, other.tenant) == ("c-1", "other")
    assert other._scope == Scope(conversation_id="c-1", tenant="other")
    assert llm._scope is None and llm.conversation_id is None
    with pytest.raises((TypeError, ValueError), match="conversation_id"):
        llm.for_conversation("")

    # The copies add to one set of totals, per conversation.
    a.chat(_history())
    other.chat(_history())
    stats = llm.stats()
    assert stats["calls"] == 2 and stats["new_pointers"] == 2
    assert stats["conversations"].keys() == {"acme", "other"}
    assert set(stats["conversations"]["acme"]) == {a.conversation_id}
    assert set(stats["conversations"]["other"]) == {"c-1"}
    assert a.stats() == stats


def test_an_agent_workflow_is_planned_the_same_way() -> None:
    plain = ScriptedLLM()
    run_agent(plain, QUESTIONS[:2])
    inner = ScriptedLLM()
    llm = ContextPilotAgentLLM(inner, conversation_id="c-1")
    agent = FunctionAgent(name="searcher", llm=llm, tools=[search_tool()], system_prompt=SYSTEM)
    workflow = AgentWorkflow(agents=[agent], root_agent="searcher")

    async def ask() -> None:
        memory = ChatMemoryBuffer.from_defaults(token_limit=1_000_000)
        for question in QUESTIONS[:2]:
            await workflow.run(question, memory=memory)

    asyncio.run(ask())
    assert_prefix_stable(inner.requests)
    assert llm.stats()["new_pointers"] > 0
    assert prefill(inner.requests)[1] < prefill(plain.requests)[1]


# ---------------------------------------------------------------------------------- one call
def _history() -> list[ChatMessage]:
    """System, user, two identical search calls with their results."""
    result = search_numbered("kv cache")
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content=SYSTEM),
        ChatMessage(role=MessageRole.USER, content="What is a KV cache?"),
    ]
    for call_id in ("call-1", "call-2"):
        messages.append(
            ChatMessage(
                role=MessageRole.ASSISTANT,
                blocks=[
                    ToolCallBlock(
                        tool_call_id=call_id, tool_name="search", tool_kwargs={"query": "kv cache"}
                    )
                ],
            )
        )
        messages.append(
            ChatMessage(
                role=MessageRole.TOOL,
                blocks=[TextBlock(text=result)],
                additional_kwargs={"tool_call_id": call_id},
            )
        )
    return messages


def test_only_changed_tool_messages_are_copied() -> None:
    inner = ScriptedLLM()
    llm = ContextPilotAgentLLM(inner, conversation_id="c-1")
    messages = _history()
    llm.chat(messages)

    received = inner.received[0]
    assert [m is g for m, g in zip(received, messages, strict=True)] == [True] * 5 + [False]
    pointer = '[Same result as search({"query": "kv cache"}) above.]'
    assert received[5].content == pointer
    assert received[5].additional_kwargs == {"tool_call_id": "call-2"}
    assert messages[5].content == search_numbered("kv cache")  # the caller's is unchanged


def test_tool_calls_from_additional_kwargs_are_read() -> None:
    inner = ScriptedLLM()
    llm = ContextPilotAgentLLM(inner)
    messages = _history()
    for i in (2, 4):
        block = messages[i].blocks[0]
        assert isinstance(block, ToolCallBlock)
        messages[i] = ChatMessage(
            role=MessageRole.ASSISTANT,
            content="",
            additional_kwargs={
                "tool_calls": [
                    {
                        "id": block.tool_call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"query": "kv cache"}'},
                    }
                ]
            },
        )
    llm.chat(messages)
    assert inner.requests[0][5]["content"].startswith("[Same result as ")


def test_prepared_then_chat_is_planned_once_and_delegates() -> None:
    inner = ScriptedLLM()
    planner = RecordingPlanner()
    llm = ContextPilotAgentLLM(inner, planner=planner, conversation_id="c-1")
    kwargs = llm._prepare_chat_with_tools([search_tool()], chat_history=_history())
    response = llm.chat(**kwargs)
    assert len(planner.plans) == 1 and llm.stats()["calls"] == 1
    assert inner.requests[0][5]["content"].startswith("[Same result")
    assert llm.metadata == inner.metadata and llm.metadata.is_function_calling_model
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []

    response = llm.chat_with_tools([search_tool()], user_msg="Again?", chat_history=_history())
    assert inner.received[-1][-1].content == "Again?"
    assert len(planner.plans) == 2
    assert llm.complete("hi").text == "hi"


def test_a_history_the_planner_refuses_is_sent_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = ScriptedLLM()
    llm = ContextPilotAgentLLM(inner, conversation_id="c-1")
    messages = _history()
    messages[2] = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[ToolCallBlock(tool_call_id="call-1", tool_name="search", tool_kwargs={"x": {1j}})],
    )
    with caplog.at_level(logging.WARNING, "contextpilot_integrations.llama_index.agent_llm"):
        llm.chat(messages)
    assert all(m is g for m, g in zip(inner.received[0], messages, strict=True))
    assert "sent unplanned" in caplog.text
    assert llm.stats()["calls"] == 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ContextPilotAgentLLM(MockLLM()), "llm must be a FunctionCallingLLM"),  # type: ignore[arg-type]
        (
            lambda: ContextPilotAgentLLM(ContextPilotAgentLLM(ScriptedLLM())),
            "not a ContextPilotAgentLLM",
        ),
        (lambda: ContextPilotAgentLLM(ScriptedLLM(), planner=object()), "planner must be"),  # type: ignore[arg-type]
        (lambda: ContextPilotAgentLLM(ScriptedLLM(), conversation_id=""), "conversation_id"),
        (lambda: ContextPilotAgentLLM(ScriptedLLM(), max_conversations=0), "max_conversations"),
    ],
)
def test_bad_arguments_are_refused(make: Callable[[], Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_scope_is_the_constructors() -> None:
    llm = ContextPilotAgentLLM(ScriptedLLM(), tenant="t", conversation_id="c")
    assert llm._scope == Scope(conversation_id="c", tenant="t")
    assert ContextPilotAgentLLM(ScriptedLLM(), tenant="t")._scope is None


# ---------------------------------------------------------------------------------- the wire
def scripted_server(queries: Sequence[str], bodies: list[dict[str, Any]]) -> FastAPI:
    """An OpenAI-compatible chat server that records each body and answers by the number of
    tool messages in it: a search for ``queries[n]``, then an answer; a ``"stream": true``
    request is answered with server-sent chunks."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        bodies.append(body)
        step = sum(1 for m in body["messages"] if m["role"] == "tool")
        head = {"id": f"chatcmpl-{len(bodies)}", "created": 0, "model": body["model"]}
        message: dict[str, Any] = {"role": "assistant", "content": ANSWER}
        if step < len(queries):
            call = {
                "id": f"call_{step}",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": queries[step]})},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        if not body.get("stream"):
            return {
                **head,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            }
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": 0, **c} for c in message["tool_calls"]]
        chunks = [
            {"index": 0, "delta": message, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": "stop"},
        ]
        lines = [
            f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [c]})}\n\n"
            for c in chunks
        ]
        return StreamingResponse(iter([*lines, "data: [DONE]\n\n"]), media_type="text/event-stream")

    return app


ANSWER = "The KV cache keeps keys and values."


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "not-streaming"])
def test_openai_like_sends_the_pointers(streaming: bool) -> None:
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    bodies: list[dict[str, Any]] = []
    queries = [*TURNS[QUESTIONS[0]], TURNS[QUESTIONS[0]][0]]
    app = scripted_server(queries, bodies)

    with serve_in_thread(app) as url:
        model = openai_like.OpenAILike(
            model="test-model",
            api_base=f"{url}/v1",
            api_key="test-key",
            is_chat_model=True,
            is_function_calling_model=True,
            max_retries=0,
        )
        llm = ContextPilotAgentLLM(model, tenant="acme", conversation_id="c-1")
        answers = asyncio.run(_run(llm, QUESTIONS[:1], search_tool(), streaming=streaming))

    assert answers == [ANSWER]
    assert all(bool(body.get("stream")) == streaming for body in bodies)
    assert len(bodies) == len(queries) + 1
    for before, after in zip(bodies, bodies[1:], strict=False):
        assert after["messages"][: len(before["messages"])] == before["messages"]
    tool_messages = [m for m in bodies[-1]["messages"] if m["role"] == "tool"]
    assert tool_messages[0]["content"] == search_numbered(queries[0])
    assert "[Same as document [2] of " in tool_messages[1]["content"]
    assert tool_messages[2] == {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": '[Same result as search({"query": "kv cache"}) above.]',
    }
