"""The proxy with the real openai SDK (sync, async, streaming, tool calls) in front of a stand-in
OpenAI-compatible upstream: planned history, pointers, engine fields, usage, credentials,
streaming as it arrives, cancellation, errors (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from proxy_testing import TOOLS, agent_loop, assert_replayed, closed_port_url, serve_proxy
from service_testing import wait_for
from upstream_standin import SEARCH_RESULT

from contextpilot_integrations.service.proxy.routes import Proxy


def test_a_tool_using_conversation_is_planned_and_forwarded(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"api_key": "upstream-secret"}) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="client-secret", max_retries=0)
        raws = agent_loop([client] * 3, "conversation-1")
        bodies = state.bodies("/v1/chat/completions")
        assert len(bodies) == 3
        # Every earlier call's messages lead the next call's, byte for byte.
        assert_replayed(bodies[0]["messages"], bodies[1]["messages"])
        assert_replayed(bodies[1]["messages"], bodies[2]["messages"])
        # The second search returned the same text: it went out as a pointer to the first.
        first, second = (m for m in bodies[2]["messages"] if m["role"] == "tool")
        assert first["content"] == SEARCH_RESULT
        assert second["content"].startswith("[Same result as search(")
        assert '"alpha"' in second["content"]
        assert raws[2].headers["x-contextpilot-pointers"] == "1"
        assert raws[2].headers["x-contextpilot-new-pointers"] == "1"
        assert int(raws[2].headers["x-contextpilot-tokens-removed"]) > 0
        assert raws[2].headers["x-contextpilot-conversation"] == "conversation-1"
        assert raws[2].headers["x-contextpilot-conversation-source"] == "header"
        # Engine fields: one new rid per call, as the answer's header names it.
        rids = [raw.headers["x-contextpilot-rid"] for raw in raws]
        assert len(set(rids)) == 3
        for body, rid in zip(bodies, rids, strict=True):
            assert body["rid"] == body["request_id"] == body["session_id"] == rid
            assert "cache_salt" not in body  # no tenants: no salt
            assert "contextpilot" not in body
        # The upstream got the proxy's key, never the client's; the proxy's headers stay here.
        for received in state.received:
            assert received.headers["authorization"] == "Bearer upstream-secret"
            assert "client-secret" not in json.dumps(received.headers)
            assert "x-contextpilot-session" not in received.headers
        # Usage from the upstream's answers is in the conversation's totals.
        totals = httpx.get(f"{proxy}/v1/usage").json()
        conversation = totals["conversations"][""]["conversation-1"]
        assert conversation["plans"] == 3 and conversation["usage_reports"] == 3
        assert conversation["tokens_removed"] == int(
            raws[2].headers["x-contextpilot-tokens-removed"]
        )
        cached = sum(raw.parse().usage.prompt_tokens_details.cached_tokens for raw in raws)
        assert conversation["cached_tokens"] == cached > 0
        metrics = httpx.get(f"{proxy}/metrics").text
        assert (
            'contextpilot_proxy_requests_total{endpoint="chat_completions",status="200"} 3.0'
            in metrics
        )


def test_without_an_upstream_key_no_credentials_go_upstream(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="client-secret", max_retries=0)
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        client.models.list()
    assert [r.path for r in state.received] == ["/v1/chat/completions", "/v1/models"]
    for received in state.received:
        assert "authorization" not in received.headers
        assert "client-secret" not in json.dumps(received.headers)


def test_the_client_key_passes_through_where_configured(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"pass_client_key": True}) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="client-secret", max_retries=0)
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
    assert state.received[0].headers["authorization"] == "Bearer client-secret"


def test_async_streaming_tool_calls_and_usage(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin

    async def run(proxy: str) -> tuple[list[Any], list[Any]]:
        client = openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "find it"}]
        with_usage = await client.chat.completions.create(
            model="agent",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            user="user-7",
        )
        first = [chunk async for chunk in with_usage]
        call = first[0].choices[0].delta.tool_calls[0]
        messages.append(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": call.function.arguments,
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": SEARCH_RESULT})
        without = await client.chat.completions.create(
            model="plain",
            messages=messages,
            stream=True,
            user="user-7",  # type: ignore[arg-type]
        )
        second = [chunk async for chunk in without]
        await client.close()
        return first, second

    with serve_proxy(url) as proxy:
        first, second = asyncio.run(run(proxy))
        assert first[0].choices[0].delta.tool_calls[0].function.name == "search"
        assert first[-1].usage is not None and first[-1].choices == []
        assert "".join(c.choices[0].delta.content or "" for c in second if c.choices) == "done"
        assert all(c.usage is None for c in second)
        bodies = state.bodies("/v1/chat/completions")
        assert bodies[0]["stream_options"] == {"include_usage": True}
        assert "stream_options" not in bodies[1]  # never added: the client did not ask
        assert_replayed(bodies[0]["messages"], bodies[1]["messages"])
        totals = httpx.get(f"{proxy}/v1/usage").json()
        conversation = totals["conversations"][""]["user:user-7"]
        # The stream with a usage chunk was recorded; the one without reported none.
        assert conversation["plans"] == 2 and conversation["usage_reports"] == 1
        assert conversation["prompt_tokens"] == first[-1].usage.prompt_tokens


def test_a_stream_reaches_the_client_before_the_upstream_finishes(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="gated", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = iter(stream)
        first = next(chunks)  # the upstream holds the rest until the gate opens
        assert first.choices[0].delta.content == "do"
        state.gate.set()
        rest = list(chunks)
    assert state.saw_gate == [True]  # the gate was opened by the test, not by the timeout
    assert "".join(c.choices[0].delta.content or "" for c in rest) == "ne"


def test_a_client_that_goes_cancels_the_upstream_request(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        body = {"model": "hang", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
        wait_for(state.cancelled.is_set, what="the upstream saw the proxy hang up")
        metrics = httpx.get(f"{proxy}/metrics").text
        assert 'contextpilot_proxy_upstream_failures_total{kind="cancelled"} 1.0' in metrics


def test_an_upstream_that_breaks_off_cuts_the_answer_short(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="break", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.content == "do"
        with pytest.raises(httpx.RemoteProtocolError):  # incomplete, never silently ended
            list(chunks)
        metrics = httpx.get(f"{proxy}/metrics").text
        assert 'contextpilot_proxy_upstream_failures_total{kind="broken"} 1.0' in metrics


def test_upstream_errors_pass_through_with_their_status_and_body(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(
                model="error-429", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 429
        assert caught.value.body == {
            "message": "rate limited",
            "type": "rate_limit",
            "param": None,
            "code": None,
        }


def test_an_unreachable_upstream_is_a_502_naming_it() -> None:
    upstream = closed_port_url()
    with serve_proxy(upstream) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 502
        assert upstream in caught.value.message
        # The plan was made (and answered in the headers) even though nothing came back.
        assert caught.value.response.headers["x-contextpilot-rid"].startswith("cp-")


def test_a_stalled_upstream_is_a_504(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url, {"read_timeout_s": 0.3}) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="stall", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 504


@pytest.mark.parametrize(
    ("content", "status", "param", "words"),
    [
        (b"{not json", 400, "body", "cannot be read as JSON"),
        (b"[1, 2]", 422, "body", "must be a JSON object"),
        (b'{"model": "m", "messages": "hi"}', 422, "messages", "must be a list"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 422, None, "messages[0]"),
        (b'{"messages": [], "contextpilot": {"conversation": "x"}}', 422, None, "unknown fields"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_naming_the_field(  # type: ignore[no-untyped-def]
    standin, content: bytes, status: int, param: str | None, words: str
) -> None:
    url, state = standin
    with serve_proxy(url) as proxy:
        response = httpx.post(
            f"{proxy}/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    assert state.received == []  # nothing was forwarded


def test_a_body_over_the_limit_is_a_413(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, max_body_bytes=1000) as proxy:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
        response = httpx.post(f"{proxy}/v1/chat/completions", json=body)  # Content-Length
        anthropic_body = {**body, "max_tokens": 8}
        anthropic_answer = httpx.post(f"{proxy}/v1/messages", json=anthropic_body)
    assert response.status_code == 413
    # In the shape of the client's API, so its SDK raises its own error type.
    assert "exceeds the limit of 1000 bytes" in response.json()["error"]["message"]
    assert anthropic_answer.status_code == 413
    assert anthropic_answer.json()["type"] == "error"
    assert "exceeds the limit" in anthropic_answer.json()["error"]["message"]
    assert state.received == []


def test_other_paths_pass_through_and_the_service_paths_keep_working(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(f"{url}/v1") as proxy:  # a base URL given with its /v1
        models = httpx.get(f"{proxy}/v1/models?limit=2")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "agent"
        assert state.received[0].path == "/v1/models"
        plan = httpx.post(f"{proxy}/v1/plan", json={"query": "q", "blocks": ["a passage"]})
        assert plan.status_code == 200 and plan.json()["rid"]
        refused = httpx.get(f"{proxy}/v1/plan")
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"
        missing = httpx.get(f"{proxy}/v1/no-such-path")
        # The upstream's own 404 (FastAPI's body), passed through.
        assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    assert [r.path for r in state.received] == ["/v1/models"]


def test_the_hosted_openai_api_gets_a_cache_key_per_conversation(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"kind": "openai", "api_key": "sk-proxy"}) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        for session in ("a", "a", "b"):
            client.chat.completions.create(
                model="plain",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-contextpilot-session": session},
            )
        client.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "hi"}], prompt_cache_key="mine"
        )
    keys = [body["prompt_cache_key"] for body in state.bodies("/v1/chat/completions")]
    assert keys[0] == keys[1] != keys[2] and keys[3] == "mine"  # the client's own key is kept
    for body in state.bodies("/v1/chat/completions"):
        assert not {"rid", "request_id", "session_id", "cache_salt"} & set(body)


def test_usage_read_after_an_answer_counts_that_answers_usage(standin, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The usage thread records behind the answers; a slow one must not make GET /v1/usage
    # miss the usage of answers the client already has.
    record = Proxy.record_usage

    def slow_record(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        record(self, *args, **kwargs)

    monkeypatch.setattr(Proxy, "record_usage", slow_record)
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        agent_loop([client] * 3, "conversation-read-after")
        totals = httpx.get(f"{proxy}/v1/usage", timeout=10).json()
        assert totals["conversations"][""]["conversation-read-after"]["usage_reports"] == 3
