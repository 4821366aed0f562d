"""Request ids: armed by the post-processor and templates, taken once by ContextPilotOpenAILike,
seen in the body the real OpenAI client builds (the request is stopped before the network)."""

from __future__ import annotations

import asyncio
import contextvars
import json

import httpx
import pytest
from llama_index.core import get_response_synthesizer
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine

from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    ContextPilotOpenAILike,
    chat_context_template,
    request_id_kwargs,
    text_qa_template,
)
from contextpilot_integrations.llama_index.request_ids import (
    arm_request,
    nodes_rid,
    pending_request,
    take_request,
)
from contextpilot_integrations.llm_call.engine_fields import engine_body_fields


class Stopped(Exception):
    """Raised by the request hook: the body was captured, nothing goes out."""


class BodyCapture:
    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def sync_hook(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.read()))
        raise Stopped

    async def async_hook(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(await request.aread()))
        raise Stopped


def _llm(capture: BodyCapture, **kwargs: object) -> ContextPilotOpenAILike:
    return ContextPilotOpenAILike(
        model="test-model",
        api_base="http://127.0.0.1:9/v1",
        api_key="none",
        is_chat_model=True,
        max_retries=kwargs.pop("max_retries", 0),
        http_client=httpx.Client(event_hooks={"request": [capture.sync_hook]}),
        async_http_client=httpx.AsyncClient(event_hooks={"request": [capture.async_hook]}),
        **kwargs,
    )


def test_arm_and_take_once_shared_across_copied_contexts() -> None:
    def scenario() -> None:
        arm_request(None)  # whatever an earlier test left in this thread's context
        assert take_request() is None
        arm_request("r-1")
        copied = contextvars.copy_context()
        assert copied.run(take_request) == "r-1"  # a copied context takes the same holder
        assert take_request() is None  # ... so the original cannot send it again
        arm_request("r-1")  # re-arming the same rid keeps the taken holder
        assert take_request() is None
        arm_request("r-2")
        assert pending_request().rid == "r-2" and not pending_request().taken  # type: ignore[union-attr]
        arm_request(None)
        assert pending_request() is None and take_request() is None
        # With markers, only a prompt that shows one of them takes the request.
        arm_request("r-3", ["[Doc 1]\nApple defends"])
        assert take_request("Say hello.") is None
        assert take_request("...[Doc 1]\nApple defends Google Search deal...") == "r-3"

    contextvars.copy_context().run(scenario)


def test_an_unanswered_plan_does_not_tag_an_unrelated_call(retrieved, questions) -> None:
    capture = BodyCapture()
    llm = _llm(capture)
    pp = ContextPilotNodePostprocessor()
    synthesizer = get_response_synthesizer(llm=llm, text_qa_template=text_qa_template(pp))

    def run() -> str:
        out = pp.postprocess_nodes(retrieved[0], query_str=questions[0])  # retrieval only ...
        with pytest.raises(Exception, match="Connection error"):
            llm.chat([ChatMessage(role="user", content="An unrelated question.")])
        with pytest.raises(Exception, match="Connection error"):  # ... answered later
            synthesizer.synthesize(questions[0], out)
        return out[0].node.metadata["contextpilot"]["rid"]

    rid = contextvars.copy_context().run(run)
    unrelated, answer = capture.bodies
    assert "rid" not in unrelated
    assert answer["rid"] == rid


def test_request_id_fields_and_kwargs(retrieved) -> None:
    assert request_id_kwargs("r") == {
        "extra_body": {"rid": "r", "request_id": "r", "session_id": "r"}
    }
    assert request_id_kwargs("r", "sglang") == {"extra_body": {"rid": "r", "session_id": "r"}}
    out = ContextPilotNodePostprocessor().postprocess_nodes(retrieved[0], query_str="q")
    rid = out[0].node.metadata["contextpilot"]["rid"]
    assert nodes_rid(out) == rid
    assert request_id_kwargs(out) == {"extra_body": engine_body_fields(rid)}
    assert request_id_kwargs([]) == {} and nodes_rid([]) is None
    other = ContextPilotNodePostprocessor().postprocess_nodes(retrieved[1], query_str="q")
    with pytest.raises(ValueError, match="2 different request ids"):
        request_id_kwargs([out[0], other[0]])
    with pytest.raises(TypeError, match="non-empty .rid"):
        request_id_kwargs("")
    with pytest.raises(ValueError, match="engine must be one of"):
        request_id_kwargs("r", "tgi")  # type: ignore[arg-type]


def test_query_engine_request_carries_the_plan_rid_once(bm25, questions) -> None:
    capture = BodyCapture()
    llm = _llm(capture, additional_kwargs={"extra_body": {"top_k": 5}})
    pp = ContextPilotNodePostprocessor()
    engine = RetrieverQueryEngine.from_args(
        bm25, llm=llm, node_postprocessors=[pp], text_qa_template=text_qa_template(pp)
    )

    def run() -> None:
        with pytest.raises(Exception, match="Connection error"):
            engine.query(questions[0])
        # The next, unrelated call carries no id (taken once).
        with pytest.raises(Exception, match="Connection error"):
            llm.chat([ChatMessage(role="user", content="hello")])

    contextvars.copy_context().run(run)
    first, unrelated = capture.bodies
    rid = first["rid"]
    assert rid.startswith("cp-") and first["request_id"] == first["session_id"] == rid
    assert first["top_k"] == 5  # the user's extra_body is kept
    plan = pp.plans.get(rid)
    assert plan is not None
    assert [m["content"] for m in first["messages"]] == [m["content"] for m in plan.plan.messages]
    assert "rid" not in unrelated and unrelated["top_k"] == 5


def test_async_streaming_chat_engine_sends_each_turn_its_own_rid(bm25) -> None:
    from llama_index.core.chat_engine import CondensePlusContextChatEngine

    capture = BodyCapture()
    pp = ContextPilotNodePostprocessor().for_conversation()
    engine = CondensePlusContextChatEngine.from_defaults(
        bm25,
        llm=_llm(capture),
        node_postprocessors=[pp],
        context_prompt=chat_context_template(pp),
        skip_condense=True,
    )

    async def run() -> None:
        for message in ("Apple and the Google search deal?", "Epic Games versus Google?"):
            with pytest.raises(Exception, match="Connection error"):
                response = await engine.astream_chat(message)
                async for _ in response.async_response_gen():
                    pass

    asyncio.run(run())
    rids = [body.get("rid") for body in capture.bodies]
    assert len(rids) == 2 and all(rids) and rids[0] != rids[1]
    assert all(body["stream"] is True for body in capture.bodies)


def test_retries_keep_the_rid_and_no_fields_sends_none(retrieved, questions) -> None:
    capture = BodyCapture()
    pp = ContextPilotNodePostprocessor()
    synthesizer = get_response_synthesizer(
        llm=_llm(capture, max_retries=1), text_qa_template=text_qa_template(pp)
    )

    def run() -> None:
        out = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
        with pytest.raises(Exception, match="Connection error"):
            synthesizer.synthesize(questions[0], out)

    contextvars.copy_context().run(run)
    assert len(capture.bodies) >= 2
    assert len({body["rid"] for body in capture.bodies}) == 1

    silent = BodyCapture()
    llm = _llm(silent, request_id_engine="hosted")

    def run_silent() -> None:
        arm_request("r-silent")
        with pytest.raises(Exception, match="Connection error"):
            llm.complete("hello")

    contextvars.copy_context().run(run_silent)
    assert "rid" not in silent.bodies[0] and "extra_body" not in silent.bodies[0]

    vllm = BodyCapture()
    llm = _llm(vllm, request_id_engine="vllm")

    def run_vllm() -> None:
        arm_request("r-vllm")
        with pytest.raises(Exception, match="Connection error"):
            llm.complete("hello")

    contextvars.copy_context().run(run_vllm)
    assert vllm.bodies[0]["request_id"] == vllm.bodies[0]["session_id"] == "r-vllm"
    assert "rid" not in vllm.bodies[0]
    assert ContextPilotOpenAILike.class_name() == "ContextPilotOpenAILike"


def test_concurrent_requests_send_the_rid_of_the_prompt_they_carry(retrieved, questions) -> None:
    """Eight threads, identical and different questions mixed: every request body carries the
    rid of the plan whose messages it holds, and every rid is sent once."""
    from concurrent.futures import ThreadPoolExecutor

    capture = BodyCapture()
    pp = ContextPilotNodePostprocessor()
    synthesizer = get_response_synthesizer(llm=_llm(capture), text_qa_template=text_qa_template(pp))
    jobs = [i % 5 for i in range(40)]

    def ask(i: int) -> str:
        def run() -> str:
            out = pp.postprocess_nodes(retrieved[i], query_str=questions[i])
            with pytest.raises(Exception, match="Connection error"):
                synthesizer.synthesize(questions[i], out)
            return out[0].node.metadata["contextpilot"]["rid"]

        return contextvars.copy_context().run(run)

    with ThreadPoolExecutor(max_workers=8) as pool:
        rids = list(pool.map(ask, jobs))
    sent = [body["rid"] for body in capture.bodies]
    assert sorted(sent) == sorted(rids)  # each plan's rid, once
    for body in capture.bodies:
        plan = pp.plans.get(body["rid"]).plan  # type: ignore[union-attr]
        assert [m["content"] for m in body["messages"]] == [m["content"] for m in plan.messages]
