"""The proxy against hostile input and a misbehaving upstream, with the real SDKs and httpx:
metering of finished and abandoned answers, connections the upstream closes unanswered, headers
and usage figures an upstream must not set, lone surrogates, dot segments in passed-through
paths, conversation ids that cannot be ids (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import anthropic
import httpx
import openai
import pytest
from proxy_testing import hanging_up_upstream, serve_proxy
from service_testing import wait_for


def _metric_lines(proxy: str, prefix: str) -> list[str]:
    return [
        line for line in httpx.get(f"{proxy}/metrics").text.splitlines() if line.startswith(prefix)
    ]


_SERVED_499 = 'contextpilot_http_requests_total{endpoint="/v1/chat/completions",status="499"}'


def _wait_metered_499(proxy: str) -> None:
    wait_for(
        lambda: any(line.startswith(_SERVED_499) for line in _metric_lines(proxy, _SERVED_499)),
        what="the abandoned request metered as 499",
    )


def test_finished_answers_are_not_counted_as_cancelled(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="plain", messages=messages)  # type: ignore[arg-type]
        chunks = client.chat.completions.create(
            model="plain",
            messages=messages,  # type: ignore[arg-type]
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "done"
        claude = anthropic.Anthropic(base_url=proxy, api_key="none", max_retries=0)
        claude.messages.create(model="plain", max_tokens=8, messages=messages)  # type: ignore[arg-type]
        failures = _metric_lines(proxy, "contextpilot_proxy_upstream_failures_total")
        answered = _metric_lines(proxy, "contextpilot_proxy_requests_total")
    assert failures == []  # three whole answers: nothing cancelled
    assert 'contextpilot_proxy_requests_total{endpoint="chat_completions",status="200"} 2.0' in (
        answered
    )


def test_a_client_gone_before_the_answer_is_metered_499_never_500(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        body = {"model": "stall", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before any answer
            httpx.post(
                f"{proxy}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3)
            )
        _wait_metered_499(proxy)
        http = _metric_lines(proxy, "contextpilot_http_requests_total")
        proxied = _metric_lines(proxy, "contextpilot_proxy_requests_total")
        cancelled = _metric_lines(proxy, "contextpilot_proxy_upstream_failures_total")
    assert not [line for line in http if 'status="500"' in line]
    assert proxied == [
        'contextpilot_proxy_requests_total{endpoint="chat_completions",status="499"} 1.0'
    ]
    assert cancelled == ['contextpilot_proxy_upstream_failures_total{kind="cancelled"} 1.0']


def test_a_client_gone_mid_stream_is_metered_499_and_cancels_the_upstream(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        body = {"model": "hang", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200  # the answer started
            assert next(response.iter_lines()).startswith("data: ")
        wait_for(state.cancelled.is_set, what="the upstream saw the proxy hang up")
        _wait_metered_499(proxy)
        http = _metric_lines(proxy, 'contextpilot_http_requests_total{endpoint="/v1/chat')
        proxied = _metric_lines(proxy, "contextpilot_proxy_requests_total")
        cancelled = _metric_lines(proxy, "contextpilot_proxy_upstream_failures_total")
    assert http == [f"{_SERVED_499} 1.0"]  # never 200
    assert proxied == [
        'contextpilot_proxy_requests_total{endpoint="chat_completions",status="499"} 1.0'
    ]
    assert cancelled == ['contextpilot_proxy_upstream_failures_total{kind="cancelled"} 1.0']


def _slow_to_take_the_last_event(app: Any) -> Any:
    """``app`` served by a server that takes a while to take the ``data: [DONE]`` chunk: the
    client has it and closes, and the upstream's answer ends, before the proxy's end of the
    body goes out."""

    async def served(scope: Any, receive: Any, send: Any) -> None:
        async def slow_send(message: Any) -> None:
            await send(message)
            if b"[DONE]" in message.get("body", b""):
                await asyncio.sleep(0.3)

        await app(scope, receive, slow_send)

    return served


def test_a_client_that_closes_after_the_last_event_is_metered_200_never_cancelled(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url, wrap=_slow_to_take_the_last_event) as proxy:
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # what the openai SDK does: it stops reading and closes
        served = 'contextpilot_http_requests_total{endpoint="/v1/chat/completions"'
        wait_for(lambda: _metric_lines(proxy, served), what="the stream metered")
        http = _metric_lines(proxy, served)
        proxied = _metric_lines(proxy, "contextpilot_proxy_requests_total")
        cancelled = _metric_lines(proxy, "contextpilot_proxy_upstream_failures_total")
    assert http == [f'{served},status="200"}} 1.0']
    assert proxied == [
        'contextpilot_proxy_requests_total{endpoint="chat_completions",status="200"} 1.0'
    ]
    assert cancelled == []


def test_a_client_gone_before_its_body_ends_is_metered_499_and_nothing_forwarded(standin) -> None:  # type: ignore[no-untyped-def]
    url, upstream = standin
    with serve_proxy(url) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                b'{"model": "plain", "messages": ['
            )
        _wait_metered_499(proxy)
        proxied = _metric_lines(proxy, "contextpilot_proxy_requests_total")
    assert proxied == [
        'contextpilot_proxy_requests_total{endpoint="chat_completions",status="499"} 1.0'
    ]
    assert upstream.received == []


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "orderly-close"])
def test_a_connection_closed_unanswered_is_sent_once_more(reset: bool) -> None:
    with (
        hanging_up_upstream(1, reset=reset) as (upstream, accepted),
        serve_proxy(upstream) as proxy,
    ):
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="raw", messages=[{"role": "user", "content": "hi"}]
        )
        usage = httpx.get(f"{proxy}/v1/usage").json()
    assert answer.choices[0].message.content == "answered"
    assert accepted == [2]  # the first connection hung up on, the second answered
    assert usage["usage_reports"] == 1 and usage["prompt_tokens"] == 5


def test_a_second_unanswered_connection_is_a_502_naming_the_upstream() -> None:
    with (
        hanging_up_upstream(2, reset=False) as (upstream, accepted),
        serve_proxy(upstream) as proxy,
    ):
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="raw", messages=[{"role": "user", "content": "hi"}]
            )
    assert caught.value.status_code == 502
    assert upstream in caught.value.message and "gave no answer" in caught.value.message
    assert accepted == [2]  # sent twice, never more


def test_the_upstreams_own_contextpilot_headers_never_reach_the_client(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        boot = httpx.get(f"{proxy}/health").json()["boot_id"]
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="own-headers", messages=[{"role": "user", "content": "hi"}]
        )
    assert raw.parse().choices[0].message.content == "done"
    assert raw.headers.get_list("x-contextpilot-rid") == [raw.headers["x-contextpilot-rid"]]
    assert raw.headers["x-contextpilot-rid"].startswith("cp-")
    assert raw.headers.get_list("x-contextpilot-boot") == [boot]


def test_usage_figures_over_the_wire_bound_are_not_recorded(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        huge = client.chat.completions.create(
            model="usage-huge", messages=[{"role": "user", "content": "hi"}]
        )
        assert huge.usage is not None and huge.usage.prompt_tokens == 2**70  # passed unchanged
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "x"}])
        usage = httpx.get(f"{proxy}/v1/usage").json()
        prompt = _metric_lines(proxy, "contextpilot_usage_prompt_tokens_total")
    assert usage["plans"] == 2 and usage["usage_reports"] == 1  # only the sensible one
    assert 0 < usage["prompt_tokens"] < 1000
    assert prompt == [f"contextpilot_usage_prompt_tokens_total {float(usage['prompt_tokens'])}"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"model": "plain", "messages": [{"role": "user", '
         b'"content": "half \\ud800 of a pair"}]}'),
        ("/v1/messages", b'{"model": "plain", "max_tokens": 8, "messages": [{"role": "user", '
         b'"content": [{"type": "text", "text": "half \\udfff of a pair"}]}]}'),
    ],
)  # fmt: skip
def test_lone_surrogates_go_upstream_as_valid_utf8(standin, path: str, body: bytes) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        response = httpx.post(
            f"{proxy}{path}", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 200
    (received,) = state.received
    sent = json.loads(received.raw.decode("utf-8"))  # strict UTF-8: no surrogate bytes
    assert sent["messages"] == json.loads(body)["messages"]  # the same text, escaped again


@pytest.mark.parametrize(
    ("number", "named"), [(b"1e999", b"1e999"), (b"-1e400", b"-1e400"), (b"NaN", b"NaN")]
)
def test_a_number_json_cannot_carry_is_refused_never_forwarded(  # type: ignore[no-untyped-def]
    standin, number: bytes, named: bytes
) -> None:
    url, state = standin
    body = b'{"model": "plain", "temperature": ' + number + b', "messages": [{"role": "user", '
    body += b'"content": "hi"}]}'
    with serve_proxy(url) as proxy:
        response = httpx.post(
            f"{proxy}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    assert named.decode() in response.json()["error"]["message"]
    assert not state.received


@pytest.mark.parametrize(
    "path", ["/v1/%2e%2e/docs", "/v1/..%2f..%2fdocs", "/v1/models/%2E/x", "/v1/a/.%2e/%2e./models"]
)
def test_dot_segments_are_refused_never_forwarded(standin, path: str) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(f"{url}/v1") as proxy:
        request = httpx.Request("GET", f"{proxy}/v1/models")
        request.url = request.url.copy_with(raw_path=path.encode())  # sent exactly as written
        with httpx.Client() as client:
            response = client.send(request)
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "path"
    assert state.received == []


def test_a_passed_through_path_keeps_its_percent_encoding(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        # An encoded '?' is part of the path, never the start of a query the upstream serves.
        response = httpx.get(f"{proxy}/v1/models%3Flimit=1")
    assert response.status_code == 404
    assert state.received == []


@pytest.mark.parametrize(
    ("headers", "extension", "param"),
    [
        ({"x-contextpilot-session": "tab\there"}, None, "x-contextpilot-session"),
        ({}, "line\nbreak", "contextpilot.conversation_id"),
        ({}, "lone \ud800", "contextpilot.conversation_id"),
        ({}, "x" * 513, "contextpilot.conversation_id"),
    ],
)
def test_a_conversation_id_that_cannot_be_one_is_refused_naming_its_field(  # type: ignore[no-untyped-def]
    standin, headers: dict[str, str], extension: str | None, param: str
) -> None:
    url, state = standin
    body: dict[str, object] = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    if extension is not None:
        body["contextpilot"] = {"conversation_id": extension}
    with serve_proxy(url) as proxy:
        response = httpx.post(
            f"{proxy}/v1/chat/completions",
            content=json.dumps(body),  # ASCII JSON: the lone surrogate as its escape
            headers={"content-type": "application/json", **headers},
        )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert state.received == []


def test_a_user_field_that_cannot_be_an_id_falls_back_to_the_opening(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="plain", messages=[{"role": "user", "content": "hi"}], user="end\x00user"
        )
    assert raw.headers["x-contextpilot-conversation-source"] == "opening"
    assert state.bodies("/v1/chat/completions")[0]["user"] == "end\x00user"  # sent as given


def test_a_utf8_session_header_is_the_conversation_as_sent(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        answers = [
            httpx.post(
                f"{proxy}/v1/chat/completions",
                json=body,
                headers=[(b"x-contextpilot-session", value)],
            )
            for value in ("café".encode(), "café".encode("latin-1"))
        ]
        conversations = httpx.get(f"{proxy}/v1/usage").json()["conversations"][""]
    # UTF-8 bytes read as UTF-8; bytes that are not UTF-8 stay the Latin-1 text they are.
    assert [a.headers["x-contextpilot-conversation"] for a in answers] == ["caf%C3%A9"] * 2
    assert conversations["café"]["plans"] == 2


def test_a_client_gone_mid_stream_still_counts_the_usage_already_seen(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        body = {
            "model": "hang",
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream("POST", f"{proxy}/v1/messages", json=body) as response:
            lines = response.iter_lines()
            assert next(lines) == "event: message_start"  # its usage: the prompt's figures
            assert next(lines).startswith("data: ")
        wait_for(state.cancelled.is_set, what="the upstream saw the proxy hang up")
        wait_for(
            lambda: httpx.get(f"{proxy}/v1/usage").json()["usage_reports"] == 1,
            what="the usage of message_start recorded",
        )
        usage = httpx.get(f"{proxy}/v1/usage").json()
    assert usage["prompt_tokens"] > 0


def test_headers_a_connection_header_names_are_not_forwarded() -> None:
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.proxy.upstream import Upstream, answer_headers

    upstream = Upstream(ProxyConfig("http://127.0.0.1:9/v1"))
    given = [
        (b"Connection", b"keep-alive, X-Hop , x-other"),
        (b"X-Hop", b"v"),
        (b"x-other", b"w"),
        (b"x-kept", b"k"),
    ]
    sent = dict(upstream.request_headers(given))
    assert "x-hop" not in sent and "x-other" not in sent and "connection" not in sent
    assert sent["x-kept"] == "k"
    answer = dict(answer_headers([(b"connection", b"x-hop"), (b"x-hop", b"v"), (b"x-kept", b"k")]))
    assert answer == {b"x-kept": b"k"}


def test_an_answer_carries_one_date_and_one_server_header(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with serve_proxy(url) as proxy:
        planned = httpx.post(f"{proxy}/v1/chat/completions", json=body)
        passed = httpx.get(f"{proxy}/v1/models")
    for answer in (planned, passed):
        assert answer.is_success
        assert len(answer.headers.get_list("date")) == 1
        assert len(answer.headers.get_list("server")) == 1


def test_a_compressed_body_is_refused_in_the_apis_shape_and_not_forwarded(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with serve_proxy(url) as proxy:
        answer = httpx.post(
            f"{proxy}/v1/chat/completions", json=body, headers={"content-encoding": "gzip"}
        )
    assert answer.status_code == 415
    assert answer.json()["error"]["param"] == "content-encoding"
    assert state.bodies("/v1/chat/completions") == []


def test_a_body_trickled_past_the_read_limit_is_a_408(standin, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import socket as socket_module

    from contextpilot_integrations.service.proxy import routes

    monkeypatch.setattr(routes, "BODY_READ_TIMEOUT_S", 0.5)
    url, state = standin
    with serve_proxy(url) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        with socket_module.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"mo'
            )
            answer = conn.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert state.bodies("/v1/chat/completions") == []
