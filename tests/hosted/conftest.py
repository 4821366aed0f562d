"""A local stand-in for the hosted APIs on 127.0.0.1: Anthropic's ``/v1/messages`` and OpenAI's
``/v1/chat/completions``, recording each request body and answering with the usage the
benchmark's cache models compute from it (Anthropic: breakpoints, minimum length, lookback,
lifetime; OpenAI: automatic caching from 1,024 tokens in 128-token steps, routing by the prompt's
head and ``prompt_cache_key``), in the providers' own response shapes."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from contextpilot_bench.hosted_cache_model import (
    AnthropicCacheModel,
    OpenAICacheModel,
    TooManyBreakpoints,
)
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from support.asgi_server import serve_in_thread

from contextpilot_integrations.core.blocks import ApproxTokenCounter, block_id
from contextpilot_integrations.llm_call.provider_minimums import anthropic_min_cacheable_tokens

COUNTER = ApproxTokenCounter()


@dataclass
class HostedState:
    """What the server saw: every body by path, and its cache models (one per model id)."""

    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    anthropic: dict[str, AnthropicCacheModel] = field(default_factory=dict)
    openai: OpenAICacheModel = field(default_factory=OpenAICacheModel)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def last(self, path: str) -> dict[str, Any]:
        return [body for p, body in self.bodies if p == path][-1]


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def anthropic_units(body: dict[str, Any]) -> tuple[list[tuple[int, int]], list[int]]:
    """The body's tools and content blocks, in the provider's prefix order (tools, system,
    messages), as ``(unit, tokens)`` and the indices carrying cache_control."""
    tools = [{"text": json.dumps(t, sort_keys=True), **t} for t in body.get("tools") or []]
    blocks = [*tools, *(_blocks(body.get("system") or []) if body.get("system") else [])]
    for message in body["messages"]:
        blocks += _blocks(message["content"])
    units = [(block_id(b.get("text", "")), COUNTER.count(b.get("text", ""))) for b in blocks]
    marks = [i for i, b in enumerate(blocks) if "cache_control" in b]
    return units, marks


def hosted_app(state: HostedState) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request) -> JSONResponse:
        body = await request.json()
        units, marks = anthropic_units(body)
        model_id = body["model"]
        with state.lock:
            state.bodies.append(("messages", body))
            model = state.anthropic.setdefault(
                model_id, AnthropicCacheModel(300.0, anthropic_min_cacheable_tokens(model_id))
            )
            try:
                usage = model.serve(time.monotonic(), units, marks)
            except TooManyBreakpoints as exc:
                error = {"type": "invalid_request_error", "message": str(exc)}
                return JSONResponse({"type": "error", "error": error}, status_code=400)
        return JSONResponse(
            {
                "id": f"msg_{len(state.bodies)}",
                "type": "message",
                "role": "assistant",
                "model": model_id,
                "content": [{"type": "text", "text": "answer [Doc 1]"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": usage.input_tokens,
                    "cache_creation_input_tokens": usage.cache_write_tokens,
                    "cache_read_input_tokens": usage.cache_read_tokens,
                    "output_tokens": 3,
                },
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        texts = []
        for message in body["messages"]:
            content = message["content"]
            for text in [content] if isinstance(content, str) else [b["text"] for b in content]:
                # OpenAI caches token prefixes; here they end where a rendered block does.
                texts += [t for t in re.split(r"(?<=-----\n)", text) if t]
        units = [(block_id(t), COUNTER.count(t)) for t in texts]
        with state.lock:
            state.bodies.append(("chat", body))
            usage = state.openai.serve(time.monotonic(), units, body.get("prompt_cache_key"))
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(state.bodies)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "answer [Doc 1]"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": 3,
                    "total_tokens": usage.prompt_tokens + 3,
                    "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens},
                },
            }
        )

    return app


@pytest.fixture
def hosted_server() -> Iterator[tuple[str, HostedState]]:
    """The running server: ``(base url without /v1, its state)``."""
    state = HostedState()
    with serve_in_thread(hosted_app(state)) as url:
        yield url, state
