"""Fixtures for the benchmark tests: a small OpenAI-compatible server (the real data directory,
``data_dir``, comes from ``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Response
from fastapi import Request as FastAPIRequest
from fastapi.responses import JSONResponse, StreamingResponse
from support.asgi_server import serve_in_thread

# --- a small real OpenAI-compatible HTTP server ------------------------------------------------
#
# It stands in for an engine, not for our code: it tokenizes the chat-templated prompt by
# whitespace, keeps every prompt it served in an unlimited prefix cache, and streams SSE chunks
# in the OpenAI chat-completions format with usage (and cached tokens) in the last chunk.


@dataclass
class EngineServerState:
    report_cached: bool = True
    first_token_delay_s: float = 0.0
    fail_status: int | None = None
    bodies: list[dict] = field(default_factory=list)
    history: list[list[str]] = field(default_factory=list)
    flushes: int = 0


def _make_engine_app(state: EngineServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "test-model", "object": "model"}]}

    @app.post("/flush_cache")
    def flush() -> dict:
        state.history.clear()
        state.flushes += 1
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(request: FastAPIRequest) -> Response:
        body = await request.json()
        state.bodies.append(body)
        if state.fail_status is not None:
            return JSONResponse({"error": "overloaded"}, status_code=state.fail_status)
        prompt = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in body["messages"])
        tokens = prompt.split()
        best = 0
        for old in state.history:
            n = 0
            while n < min(len(old), len(tokens)) and old[n] == tokens[n]:
                n += 1
            best = max(best, n)
        state.history.append(tokens)
        cached = min(best, len(tokens) - 1)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)

        async def events():  # type: ignore[no-untyped-def]
            def chunk(choices: list, usage: dict | None = None) -> str:
                data = {"id": "c1", "object": "chat.completion.chunk", "choices": choices}
                if usage is not None:
                    data["usage"] = usage
                return f"data: {json.dumps(data)}\n\n"

            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
            await asyncio.sleep(state.first_token_delay_s)
            yield chunk([{"index": 0, "delta": {"content": "ok"}}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": "length"}])
            if include_usage:
                usage: dict = {
                    "prompt_tokens": len(tokens),
                    "completion_tokens": 1,
                    "total_tokens": len(tokens) + 1,
                }
                if state.report_cached:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield chunk([], usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def engine_server() -> Iterator[tuple[str, EngineServerState]]:
    """A running server on 127.0.0.1 (an ephemeral port): ``(base url, its state)``."""
    state = EngineServerState()
    with serve_in_thread(_make_engine_app(state)) as url:
        yield url, state
