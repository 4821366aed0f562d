"""A local stand-in for the proxy's upstream on 127.0.0.1: OpenAI's ``/v1/chat/completions``
and ``/v1/models`` and Anthropic's ``/v1/messages``, in the providers' own wire formats (JSON
and server-sent events, tool calls included), recording every request it receives (path,
headers, raw body).

What it answers is chosen by the request's ``model``:

- ``"agent"``: a tool call ``search({"query": ...})`` while the request holds fewer than two
  tool results (queries ``alpha`` then ``beta``), then a text answer;
- ``"gated"`` (streaming): the first event, then it waits until the test sets ``gate``, then
  the rest; ``saw_gate`` says whether the gate was set before the wait ended;
- ``"hang"`` (streaming): the first event, then nothing until the client goes (``cancelled``
  is set when the proxy closes the connection);
- ``"break"`` (streaming): the first event, then the stand-in drops the connection;
- ``"slow-start"`` (streaming): the first event after 0.3 s (a prefill), the rest at once;
  ``timeline[rid]`` holds the monotonic times the request came, its first event went and its
  last went;
- ``"stall"``: no answer until ``release`` is set (at the fixture's end; the proxy's read
  timeout ends the wait first);
- ``"error-429"`` / ``"error-529"``: the provider's error body with that status;
- ``"echo"`` (OpenAI): the last message's content and the request's rid as the answer;
- ``"own-headers"`` (OpenAI): a text answer with ``x-contextpilot-rid`` and
  ``x-contextpilot-boot`` headers of its own (what an upstream must not set for the client);
- ``"usage-huge"`` (OpenAI): a text answer whose ``prompt_tokens`` is ``2**70``;
- anything else: a text answer.

Usage: ``prompt_tokens`` about a quarter of the JSON of the messages, ``cached_tokens`` (OpenAI)
or ``cache_read_input_tokens`` (Anthropic) the longest common prefix with an earlier request's
messages, in the same unit, so a byte-stable history reads as cached.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

SEARCH_RESULT = "\n".join(
    f"Result line {i}: the prefix cache keeps the key and value tensors of block {i} for reuse."
    for i in range(40)
)
"""What the tests' ``search`` tool returns for every query (the same text twice: a pointer)."""


@dataclass
class Received:
    """One request the stand-in received."""

    path: str
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.raw)
        return document


@dataclass
class StandIn:
    """The stand-in's state, read and set by the tests."""

    received: list[Received] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    saw_gate: list[bool] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    timeline: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: list[str] = field(default_factory=list)
    """Gateway workers (URLs) it answers as, as SMG under ``consistent_hashing`` does: a
    request's ``x-smg-target-worker: I`` names ``workers[I]``, else ``workers[0]``, and a
    non-streamed answer names it in ``x-smg-routed-worker-id``; empty: no such header."""
    _prefixes: list[str] = field(default_factory=list)

    def routed_worker(self, headers: Any) -> dict[str, str]:
        """The answer header naming the worker a request went to (see :attr:`workers`)."""
        if not self.workers:
            return {}
        index = headers.get("x-smg-target-worker")
        return {"x-smg-routed-worker-id": self.workers[int(index) if index else 0]}

    def bodies(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r.body for r in self.received if r.path == path]

    def usage(self, messages: Any, system: Any = None) -> tuple[int, int]:
        """``(prompt tokens, cached tokens)`` of a request (module docstring)."""
        text = json.dumps([system, messages], ensure_ascii=False, sort_keys=True)
        with self.lock:
            best = 0
            for earlier in self._prefixes:
                n = 0
                for a, b in zip(earlier, text):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self._prefixes.append(text)
        return max(1, len(text) // 4), best // 4


def _tool_results(messages: list[dict[str, Any]], api: str) -> int:
    if api == "openai":
        return sum(1 for m in messages if m.get("role") == "tool")
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    )


def _events(events: list[tuple[str | None, dict[str, Any] | str]]) -> list[bytes]:
    out = []
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {payload}\n\n".encode())
    return out


def standin_app(state: StandIn) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> Received:
        received = Received(request.url.path, dict(request.headers), await request.body())
        with state.lock:
            state.received.append(received)
        return received

    async def stream(chunks: list[bytes], model: str, rid: Any = None) -> AsyncIterator[bytes]:
        times = state.timeline.setdefault(str(rid), [time.monotonic()])
        if model == "slow-start":
            await anyio.sleep(0.3)
            times.append(time.monotonic())
        yield chunks[0]
        if model == "gated":
            state.saw_gate.append(await anyio.to_thread.run_sync(state.gate.wait, 10.0))
        elif model == "break":
            raise ConnectionAbortedError("the stand-in breaks off its answer")
        elif model == "hang":
            try:
                await anyio.sleep(30)
            finally:
                state.cancelled.set()
        for chunk in chunks[1:]:
            yield chunk
        times.append(time.monotonic())

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        await record(request)
        return JSONResponse({"object": "list", "data": [{"id": "agent", "object": "model"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = (await record(request)).body
        model = body["model"]
        if model.startswith("error-"):
            error = {"message": "rate limited", "type": "rate_limit", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=int(model[6:]))
        if model == "stall":
            await anyio.to_thread.run_sync(state.release.wait, 60.0)
        prompt, cached = state.usage(body["messages"])
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 3,
            "total_tokens": prompt + 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        results = _tool_results(body["messages"], "openai")
        call = None
        if model == "agent" and results < 2:
            query = "alpha" if results == 0 else "beta"
            call = {
                "id": f"call_{results}",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": query})},
            }
        base = {"id": "chatcmpl-1", "created": int(time.time()), "model": model}
        finish = "tool_calls" if call else "stop"
        if model == "usage-huge":
            usage = {"prompt_tokens": 2**70, "completion_tokens": 3, "total_tokens": 2**70 + 3}
        if not body.get("stream"):
            text = "done"
            if model == "echo":
                text = json.dumps([body["messages"][-1]["content"], body.get("rid")])
            message: dict[str, Any] = {"role": "assistant", "content": None if call else text}
            if call:
                message["tool_calls"] = [call]
            own = {"x-contextpilot-rid": "forged", "x-contextpilot-boot": "forged"}
            return JSONResponse(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                },
                headers={
                    **(own if model == "own-headers" else {}),
                    **state.routed_worker(request.headers),
                }
                or None,
            )
        chunk = {**base, "object": "chat.completion.chunk"}
        delta: dict[str, Any] = {"role": "assistant", "content": "" if call else "do"}
        if call:
            delta["tool_calls"] = [{"index": 0, **call}]
        events: list[tuple[str | None, dict[str, Any] | str]] = [
            (None, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        ]
        if not call:
            more = {"index": 0, "delta": {"content": "ne"}, "finish_reason": None}
            events.append((None, {**chunk, "choices": [more]}))
        end = {"index": 0, "delta": {}, "finish_reason": finish}
        events.append((None, {**chunk, "choices": [end]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, {**chunk, "choices": [], "usage": usage}))
        events.append((None, "[DONE]"))
        return StreamingResponse(
            stream(_events(events), model, body.get("rid")), media_type="text/event-stream"
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = (await record(request)).body
        model = body["model"]
        if model.startswith("error-"):
            error = {"type": "overloaded_error", "message": "overloaded"}
            return JSONResponse({"type": "error", "error": error}, status_code=int(model[6:]))
        prompt, cached = state.usage(body["messages"], body.get("system"))
        usage = {
            "input_tokens": prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": 3,
        }
        results = _tool_results(body["messages"], "anthropic")
        tool = None
        if model == "agent" and results < 2:
            query = "alpha" if results == 0 else "beta"
            tool = {"type": "tool_use", "id": f"toolu_{results}", "name": "search"}
            tool["input"] = {"query": query}
        stop = "tool_use" if tool else "end_turn"
        content = [tool] if tool else [{"type": "text", "text": "done"}]
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": model,
            "stop_sequence": None,
        }
        if not body.get("stream"):
            return JSONResponse(
                {**message, "content": content, "stop_reason": stop, "usage": usage}
            )
        start_usage = {**usage, "output_tokens": 1}
        events: list[tuple[str | None, dict[str, Any] | str]] = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        **message,
                        "content": [],
                        "stop_reason": None,
                        "usage": start_usage,
                    },
                },
            )
        ]
        if tool:
            block = {**tool, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(tool["input"])}
        else:
            block = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": "done"}
        events += [
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": block}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 3},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip
        return StreamingResponse(
            stream(_events(events), model, body.get("rid")), media_type="text/event-stream"
        )

    return app
