"""The engine request-id fields on OpenAI-client calls and the cached-token usage read back
(:mod:`contextpilot_integrations.llm_call.engine_fields`).

The calls go through the real ``openai`` client to a small OpenAI-compatible HTTP server
started here (uvicorn on 127.0.0.1) that records each body and reports ``cached_tokens`` as the
words its prompt shares with the longest earlier prompt, as a prefix cache would. The real
engine (vLLM on the CPU) is exercised by the ``vllm`` tier of ``tests/engines``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from openai.types import Completion
from openai.types.chat import ChatCompletion
from service_testing import blocks_of, free_port

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.llm_call.engine_fields import (
    REQUEST_ID_FIELDS,
    CacheUsageTracker,
    Usage,
    acreate_chat_completion,
    create_chat_completion,
    engine_body_fields,
    read_usage,
    with_engine_fields,
)


def _engine_app(bodies: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()
    prompts: list[list[str]] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        bodies.append(body)
        words = " ".join(m["content"] for m in body["messages"]).split()
        cached = max(
            (
                next(
                    (i for i, (a, b) in enumerate(zip(p, words)) if a != b), min(len(p), len(words))
                )
                for p in prompts
            ),
            default=0,
        )
        prompts.append(words)
        return {
            "id": body.get("rid", "x"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "ok"},
                }
            ],
            "usage": {
                "prompt_tokens": len(words),
                "completion_tokens": 1,
                "total_tokens": len(words) + 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }

    return app


@pytest.fixture
def engine() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(_engine_app(bodies), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "engine did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1", bodies
    server.should_exit = True
    thread.join(10)


def test_request_id_fields_per_engine() -> None:
    plan = ContextPilot().plan("q", ["a block"], rid="r-1")
    assert engine_body_fields(plan) == {"rid": "r-1", "request_id": "r-1", "session_id": "r-1"}
    assert tuple(engine_body_fields(plan)) == REQUEST_ID_FIELDS
    assert engine_body_fields("r-2", "sglang") == {"rid": "r-2", "session_id": "r-2"}
    assert engine_body_fields("r-3", "vllm") == {"request_id": "r-3", "session_id": "r-3"}
    assert engine_body_fields(plan, "hosted") == {}
    with pytest.raises(ValueError, match="engine must be one of"):
        engine_body_fields(plan, "tgi")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty .rid"):
        engine_body_fields(object())  # type: ignore[arg-type]


def test_with_engine_fields_merges_without_mutating() -> None:
    kwargs = {"model": "m", "extra_body": {"top_k": 5, "rid": "old"}}
    merged = with_engine_fields(kwargs, "new", "sglang")
    assert merged == {"model": "m", "extra_body": {"top_k": 5, "rid": "new", "session_id": "new"}}
    assert kwargs == {"model": "m", "extra_body": {"top_k": 5, "rid": "old"}}
    assert with_engine_fields({}, "r")["extra_body"]["request_id"] == "r"
    with pytest.raises(TypeError, match="extra_body must be a mapping"):
        with_engine_fields({"extra_body": ["x"]}, "r")


def _chat_completion(usage: dict[str, Any] | None) -> ChatCompletion:
    return ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "x"},
                }
            ],
            "usage": usage,
        }
    )


def test_read_usage_from_openai_types_and_dicts() -> None:
    full = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}
    assert read_usage(
        _chat_completion({**full, "prompt_tokens_details": {"cached_tokens": 64}})
    ) == Usage(100, 64)
    assert read_usage(_chat_completion(full)) == Usage(100, 0)  # no details: nothing cached
    assert read_usage(_chat_completion(None)) is None
    completion = Completion.model_validate(
        {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [],
            "usage": {**full, "prompt_tokens_details": {"cached_tokens": 7}},
        }
    )
    assert read_usage(completion) == Usage(100, 7)
    assert read_usage(
        {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}}
    ) == Usage(5, 5)
    assert read_usage({"usage": {"prompt_tokens": "5"}}) is None
    assert read_usage(None) is None


def test_calls_carry_the_ids_and_the_tracker_reads_the_cache_back(engine) -> None:  # type: ignore[no-untyped-def]
    url, bodies = engine
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    client = openai.OpenAI(base_url=url, api_key="none")
    first = pilot.plan("first question?", blocks_of(1))
    second = pilot.plan("second question?", blocks_of(2))  # shares the aligned prefix
    create_chat_completion(client, first, tracker=tracker, model="m", max_tokens=1)
    response = create_chat_completion(
        client, second, tracker=tracker, model="m", extra_body={"top_k": 1}
    )
    assert [b["rid"] for b in bodies] == [first.rid, second.rid]
    assert all(b["rid"] == b["request_id"] == b["session_id"] for b in bodies)
    assert bodies[1]["top_k"] == 1 and bodies[0]["messages"] == first.messages
    usage = read_usage(response)
    assert usage is not None and usage.cached_tokens > 0  # the shared prefix
    stats = tracker.stats()
    assert stats["requests"] == 2 and stats["cached_tokens"] == usage.cached_tokens
    assert stats["hit_ratio"] == pytest.approx(usage.cached_tokens / stats["prompt_tokens"])
    # The in-process pilot takes the figures too (ContextPilot.record_usage).
    assert pilot.stats()["usage"]["cached_tokens"] == usage.cached_tokens


def test_usage_reaches_the_shared_service(engine, server_factory) -> None:  # type: ignore[no-untyped-def]
    url, _ = engine
    server = server_factory()
    with ContextPilotClient(server.base_url, fallback=False) as pilot:
        tracker = CacheUsageTracker(pilot)
        client = openai.OpenAI(base_url=url, api_key="none")
        for number in range(3):
            plan = pilot.plan(f"q{number}", blocks_of(number))
            create_chat_completion(client, plan, tracker=tracker, model="m", engine="vllm")
        service_usage = pilot.stats()["usage"]
    local = tracker.stats()
    assert service_usage["reports"] == 3
    assert service_usage["prompt_tokens"] == local["prompt_tokens"]
    assert service_usage["cached_tokens"] == local["cached_tokens"] > 0
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f"contextpilot_usage_cached_tokens_total {float(local['cached_tokens'])}" in metrics


def test_async_call_carries_the_ids(engine) -> None:  # type: ignore[no-untyped-def]
    url, bodies = engine
    pilot = ContextPilot()
    tracker = CacheUsageTracker(pilot)
    plan = pilot.plan("q", blocks_of(3), rid="async-1")

    async def call() -> Any:
        async with openai.AsyncOpenAI(base_url=url, api_key="none") as client:
            return await acreate_chat_completion(
                client, plan, tracker=tracker, model="m", engine="sglang"
            )

    response = asyncio.run(call())
    assert response.id == "async-1"
    assert (
        bodies[-1]["rid"] == bodies[-1]["session_id"] == "async-1"
        and "request_id" not in bodies[-1]
    )
    assert tracker.stats()["requests"] == 1


def test_a_plans_cache_salt_rides_along_except_to_hosted_apis() -> None:
    from contextpilot_integrations import ContextPilot

    plan = ContextPilot(cache_salt="tenant-salt").plan("q", ["a block"])
    assert plan.cache_salt == "tenant-salt"
    assert engine_body_fields(plan)["cache_salt"] == "tenant-salt"
    assert engine_body_fields(plan, "vllm") == {
        "request_id": plan.rid,
        "session_id": plan.rid,
        "cache_salt": "tenant-salt",
    }
    assert engine_body_fields(plan, "hosted") == {}
    assert "cache_salt" not in engine_body_fields(ContextPilot().plan("q", ["a block"]))


def test_cache_writes_reach_the_service_usage(service_url: str) -> None:
    client = ContextPilotClient(service_url)
    plan = client.plan("q", ["a block for the usage test " * 10])
    before = client.stats()["usage"]
    assert client.record_usage(plan.rid, 120, 20, cache_write_tokens=90) is True
    usage = client.stats()["usage"]
    assert usage["cache_write_tokens"] - before["cache_write_tokens"] == 90
    assert usage["cached_tokens"] - before["cached_tokens"] == 20
    client.close()
