"""The engine client against a real local HTTP server speaking the OpenAI streaming format."""

from __future__ import annotations

import logging

import pytest
from contextpilot_bench.engine_client import EngineClient, EngineError, OpenAIEngine

from contextpilot_integrations.core.rendering import PromptLayout


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "sys prompt"}, {"role": "user", "content": text}]


def test_streamed_completion_reports_usage_cache_and_ttft(engine_server) -> None:
    url, state = engine_server
    state.first_token_delay_s = 0.05
    with EngineClient(url + "/v1/") as client:
        assert client.model == "test-model"
        first = client.chat(_messages("a b c d"), rid="r-1")
        second = client.chat(_messages("a b c e f"), rid="r-2")
    assert (first.prompt_tokens, first.cached_tokens) == (8, 0)
    # "<|system|> sys prompt <|user|> a b c" shared: 7 tokens of 9.
    assert (second.prompt_tokens, second.cached_tokens) == (9, 7)
    assert first.text == "ok"
    assert 0.05 <= first.ttft_s <= first.total_s
    body = state.bodies[0]
    assert body["rid"] == body["request_id"] == body["session_id"] == "r-1"
    assert body["max_tokens"] == 1 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "test-model"


def test_generated_token_ids_are_asked_for_only_when_wanted(engine_server) -> None:
    url, state = engine_server
    with EngineClient(url, model="m") as client:
        plain = client.chat(_messages("a b"), rid="a")
        asked = client.chat(_messages("a b"), rid="b", token_ids=True)
    assert "return_token_ids" not in state.bodies[0] and plain.token_ids is None
    # this stand-in returns no ids; vLLM's are checked in the vllm tier (test_smollm2_vllm)
    assert state.bodies[1]["return_token_ids"] is True and asked.token_ids == ()


def test_flush_cache_empties_the_engine_cache(engine_server) -> None:
    url, state = engine_server
    with EngineClient(url, model="m") as client:
        client.chat(_messages("x y z"), rid="a")
        # 7 tokens, all cached but the last (recomputed for its logits).
        assert client.chat(_messages("x y z"), rid="b").cached_tokens == 6
        assert client.flush_cache() is True
        assert client.chat(_messages("x y z"), rid="c").cached_tokens == 0
    assert state.flushes == 1


def test_missing_cached_tokens_is_none_with_one_warning(
    engine_server, caplog: pytest.LogCaptureFixture
) -> None:
    url, state = engine_server
    state.report_cached = False
    with caplog.at_level(logging.WARNING), EngineClient(url, model="m") as client:
        assert client.chat(_messages("q"), rid="a").cached_tokens is None
        assert client.chat(_messages("q"), rid="b").cached_tokens is None
    warnings = [r for r in caplog.records if "cached_tokens" in r.getMessage()]
    assert len(warnings) == 1


def test_error_status_and_unreachable_server_raise_engine_error(engine_server) -> None:
    url, state = engine_server
    state.fail_status = 503
    with EngineClient(url, model="m") as client, pytest.raises(EngineError, match="503"):
        client.chat(_messages("q"), rid="a")
    with EngineClient("http://127.0.0.1:9", model="m", timeout_s=2) as client:
        with pytest.raises(EngineError, match="unreachable"):
            client.chat(_messages("q"), rid="a")
        assert client.flush_cache() is False


def test_bad_url() -> None:
    with pytest.raises(ValueError, match="engine url must start with http"):
        EngineClient("localhost:30000")


def test_openai_engine_sends_layout_messages(engine_server) -> None:
    url, state = engine_server
    layout = PromptLayout()
    segments = layout.render_segments(["block one", "block two"], "why?")
    with EngineClient(url, model="m") as client:
        served = OpenAIEngine(client, layout).serve("rid-7", segments)
    assert served.cached_tokens == 0 and served.ttft_s is not None and served.ttft_s > 0
    assert state.bodies[0]["messages"] == layout.messages_from_segments(segments)
    assert state.bodies[0]["rid"] == "rid-7"
