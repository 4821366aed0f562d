"""Requests lost, answered with another request's answer, or crossing tenants, through the proxy
in front of an upstream that fails, stalls and disconnects at random (target: 0, 0 and 0
across at least 10,000 fuzzed and 10,000 concurrent proxied requests).

Run: ``.venv/bin/python benchmarks/micro/bench_proxy_faults.py`` (defaults: 10,000 + 10,000;
``--fuzzed 500 --concurrent 500`` for a quick run, ``--memory 100000`` to follow the proxy's
RSS over that many more requests, ``--json`` for machine-readable output;
``tests/service/proxy/test_proxy_fault_injection.py`` runs a small one in CI).

Set-up, on 127.0.0.1: ``contextpilot-server --upstream <stand-in>/v1`` with two tenants from a
key file and ``--upstream-timeout`` seconds of patience (docs/DESIGN.md, "The proxy"), in front
of this file's stand-in upstream (:class:`StandInUpstream`, in its own process): OpenAI's
``/v1/chat/completions`` and Anthropic's ``/v1/messages``, JSON and server-sent events, and
every other path. Each answer echoes which request it got (:data:`NONCE_HEADER`, the body's
``bench_nonce`` and the ``rid`` the proxy added), so an answer that went to the wrong client
shows. Each request names, in :data:`FAULT_HEADER` (drawn at random, :data:`FAULT_WEIGHTS`),
what the stand-in does with it; it is a raw HTTP/1.1 server because an ASGI server answers a
500 itself for an app that sends nothing, where this one must hang up:

* ``none``: the answer; ``error-500`` / ``error-429``: the provider's error body with that
  status (after a 500 the connection is closed half the time without saying so, as uvicorn
  does); ``hangup`` / ``hangup-once``: the connection closed (a FIN or a reset) before any
  byte of the answer, on every attempt or on the first only (the proxy retries once);
  ``stall``: nothing until the proxy gives up; ``stall-midway`` / ``break``: the answer
  started, then nothing, or the connection closed, halfway.

Phases:

* **fuzzed**: mutated valid bodies (fields dropped, retyped, nested deep, huge numbers,
  unknown fields, lone surrogates, truncated or non-JSON bodies, invalid ``contextpilot``
  extension values) to ``/v1/chat/completions``, ``/v1/messages`` and passed-through paths
  (dot segments and service paths with the wrong method included), with hostile session
  headers and alice's, bob's, a wrong or no key; 32 at a time. Counted: hangs, the proxy's
  own 5xx (a 502 or 504 where the stand-in hung up or stalled is the proper answer, any other
  5xx the stand-in did not send is not), answers that are not the request's.
* **concurrent**: agent conversations of both tenants (both APIs, multi-turn, tool calls and
  tool results repeating so the planner sends pointers, streamed or not, the conversation
  named by the session header, the body extension or the ``user`` field), 128 at a time;
  half the conversation ids are used by both tenants. Every request must get its own answer
  or the status its fault calls for (a cut-short answer for ``break`` and ``stall-midway``).
  Cross-tenant: every body the stand-in received holds exactly the messages its client sent
  (a tool result may be a pointer to an earlier call of the same body, whose result holds the
  replaced text), with its tenant's ``cache_salt`` and rid tag; afterwards each tenant's
  ``GET /v1/usage`` lists only conversations its own answers named, with as many plans as it
  sent.
* **memory** (``--memory N``): N more small valid requests without faults, conversations of
  four steps one after the other, the proxy's RSS printed every N/10.

At the end ``/health`` must answer within a second and SIGTERM must stop the server; the
proxy's RSS (``/proc/<pid>/status``, Linux) is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote

import httpx

KEYS = {"alice": "alice-proxy-fault-key-51d2", "bob": "bob-proxy-fault-key-0e7a"}
TENANTS = tuple(KEYS)
NONCE_HEADER = "x-bench-nonce"
"""The request's nonce: the stand-in echoes it in every answer, as :data:`ECHO_HEADER` too."""
ECHO_HEADER = "x-bench-echo"
FAULT_HEADER = "x-bench-fault"
"""What the stand-in does with the request (module docstring)."""
RECORD_HEADER = "x-bench-record"
"""Asks the stand-in to write the body it received to its record file."""
FORGED_RID = "forged-by-the-upstream"
"""The stand-in's own ``x-contextpilot-rid`` header, which the proxy must drop."""
FAULT_WEIGHTS = {
    "none": 70,
    "hangup-once": 6,
    "hangup": 4,
    "error-500": 4,
    "error-429": 4,
    "stall": 3,
    "stall-midway": 3,
    "break": 6,
}
CUT_SHORT = ("break", "stall-midway")
"""Faults after which the proper answer is one cut short."""

# --------------------------------------------------------------------------------------------
# The stand-in upstream
# --------------------------------------------------------------------------------------------


@dataclass
class _Request:
    method: str
    target: str
    headers: dict[str, str]
    raw: bytes

    def body(self) -> Any:
        try:
            return json.loads(self.raw)
        except (ValueError, RecursionError):
            return None


class StandInUpstream:
    """A raw HTTP/1.1 server answering as an OpenAI-compatible engine and Anthropic's API
    would, with the faults :data:`FAULT_HEADER` asks for (module docstring).

    Args:
        stall_s: how long a stalled answer waits for the proxy to give up (longer than its
            ``--upstream-timeout``).
        record: where to write, one JSON line each, the requests sent with
            :data:`RECORD_HEADER` (``nonce``, ``path``, ``body``); ``None``: nowhere.
    """

    def __init__(self, stall_s: float, record: IO[str] | None) -> None:
        self.stall_s = stall_s
        self.record = record
        self.attempts: Counter[str] = Counter()
        self.rng = random.Random(7)

    async def serve(self, port: int) -> None:
        server = await asyncio.start_server(self._connection, "127.0.0.1", port, limit=1 << 22)
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                if not await self._answer(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request as its fault asks; whether the connection stays open."""
        nonce = request.headers.get(NONCE_HEADER, "")
        fault = request.headers.get(FAULT_HEADER, "none")
        self.attempts[nonce] += 1
        body = request.body()
        if self.record is not None and RECORD_HEADER in request.headers:
            line = {"nonce": nonce, "path": request.target, "body": body}
            self.record.write(json.dumps(line) + "\n")
        if fault == "hangup" or (fault == "hangup-once" and self.attempts[nonce] == 1):
            _hang_up(writer, reset=self.rng.random() < 0.5)
            return False
        if fault == "stall":
            await self._stall(reader)
            return False
        status, content_type, chunks = _answer_of(request, body, fault)
        headers = {
            "content-type": content_type,
            ECHO_HEADER: nonce,
            "x-contextpilot-rid": FORGED_RID,
        }
        streamed = content_type == "text/event-stream"
        whole = b"".join(chunks)
        if streamed:
            headers["transfer-encoding"] = "chunked"
        else:
            headers["content-length"] = str(len(whole))
        writer.write(_head(status, headers))
        if fault in CUT_SHORT:
            half = _chunked(chunks[0]) if streamed else whole[: len(whole) // 2]
            writer.write(half)
            await writer.drain()
            if fault == "break":
                _hang_up(writer, reset=self.rng.random() < 0.5)
            else:
                await self._stall(reader)
            return False
        if streamed:
            for chunk in chunks:
                writer.write(_chunked(chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(whole)
        await writer.drain()
        # After a 500 the connection is closed half the time without a word, as uvicorn does.
        return status != 500 or self.rng.random() < 0.5

    async def _stall(self, reader: asyncio.StreamReader) -> None:
        """Wait, saying nothing, until the proxy closes the connection or ``stall_s``."""
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(), self.stall_s)


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One HTTP/1.1 request (``content-length`` or chunked body); ``None`` at the end of the
    connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raw = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            raw += (await reader.readexactly(size + 2))[:size]
            if size == 0:
                break
    else:
        raw = await reader.readexactly(int(headers.get("content-length") or 0))
    return _Request(method, target, headers, raw)


def _hang_up(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    if reset:  # SO_LINGER 0: the close sends a TCP reset
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many", 500: "Error"}


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _sse(name: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "").encode() + f"data: {payload}\n\n".encode()


def _answer_of(request: _Request, body: Any, fault: str) -> tuple[int, str, list[bytes]]:
    """``(status, content type, body chunks)`` of the stand-in's answer to ``request``."""
    nonce = request.headers.get(NONCE_HEADER, "")
    path = request.target.split("?", 1)[0]
    anthropic = path == "/v1/messages"
    if fault.startswith("error-"):
        status = int(fault[6:])
        message = f"stand-in error {status} for {nonce}"
        if anthropic:
            error: dict[str, Any] = {"type": "error", "error": {"type": "api_error"}}
            error["error"]["message"] = message
        else:
            error = {"error": {"message": message, "type": "server_error", "code": status}}
        return status, "application/json", [json.dumps(error).encode()]
    echo = json.dumps(
        {
            "nonce": nonce,
            "body_nonce": body.get("bench_nonce") if isinstance(body, dict) else None,
            "rid": body.get("rid") if isinstance(body, dict) else None,
        }
    )
    if path not in ("/v1/chat/completions", "/v1/messages"):
        if path in ("/v1/models", "/v1/completions", "/v1/embeddings"):
            return 200, "application/json", [json.dumps({"object": "echo", "echo": echo}).encode()]
        answer = {"error": {"message": f"no route {path} ({echo})", "type": "not_found"}}
        return 404, "application/json", [json.dumps(answer).encode()]
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        answer = {"error": {"message": f"bad body ({echo})", "type": "invalid_request_error"}}
        return 400, "application/json", [json.dumps(answer).encode()]
    parts = [echo[: len(echo) // 3], echo[len(echo) // 3 : 2 * len(echo) // 3]]
    parts.append(echo[2 * len(echo) // 3 :])
    prompt = max(1, len(request.raw) // 4)
    model = body["model"] if isinstance(body.get("model"), str) else "stand-in"
    if anthropic:
        return _anthropic_answer(body.get("stream") is True, model, parts, prompt)
    return _openai_answer(body, model, parts, prompt)


def _openai_answer(
    body: dict[str, Any], model: str, parts: list[str], prompt: int
) -> tuple[int, str, list[bytes]]:
    usage = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
    base = {"id": "chatcmpl-standin", "created": 0, "model": model}
    if body.get("stream") is not True:
        message = {"role": "assistant", "content": "".join(parts)}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        answer = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
        return 200, "application/json", [json.dumps(answer).encode()]
    chunk = {**base, "object": "chat.completion.chunk"}
    events = [
        _sse(None, {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": part},
                                          "finish_reason": None}]})
        for part in parts
    ]  # fmt: skip
    events.append(_sse(None, {**chunk, "choices": [{"index": 0, "delta": {},
                                                    "finish_reason": "stop"}]}))  # fmt: skip
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        events.append(_sse(None, {**chunk, "choices": [], "usage": usage}))
    events.append(_sse(None, "[DONE]"))
    return 200, "text/event-stream", events


def _anthropic_answer(
    stream: bool, model: str, parts: list[str], prompt: int
) -> tuple[int, str, list[bytes]]:
    usage = {"input_tokens": prompt, "cache_read_input_tokens": 0, "output_tokens": 3}
    message = {"id": "msg_standin", "type": "message", "role": "assistant", "model": model}
    if not stream:
        content = [{"type": "text", "text": "".join(parts)}]
        answer = {**message, "content": content, "stop_reason": "end_turn", "usage": usage}
        return 200, "application/json", [json.dumps(answer).encode()]
    start: dict[str, Any] = {**message, "content": [], "stop_reason": None, "usage": usage}
    block = {"type": "text", "text": ""}
    events = [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse("content_block_start",
             {"type": "content_block_start", "index": 0, "content_block": block}),
    ]  # fmt: skip
    for part in parts:
        delta = {"type": "text_delta", "text": part}
        events.append(
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        )
    events += [
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                               "usage": {"output_tokens": 3}}),
        _sse("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return 200, "text/event-stream", events


def serve_upstream(port: int, stall_s: float, record: str | None) -> None:
    """Run the stand-in (in the child process ``--serve-upstream`` starts) until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(record or os.devnull, "w", buffering=1, encoding="utf-8") as handle:
        asyncio.run(StandInUpstream(stall_s, handle if record else None).serve(port))


# --------------------------------------------------------------------------------------------
# Agent conversations (the concurrent phase, and the fuzzed phase's valid bodies)
# --------------------------------------------------------------------------------------------

TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the document store.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
TOOLS_ANTHROPIC = [
    {
        "name": "search",
        "description": "Search the document store.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
_TAG = re.compile(r"\[(alice|bob):([^\]]+)\]")


@dataclass
class Conversation:
    """One agent conversation of one tenant: at step ``s`` its request holds the opening and
    ``s`` more events, each a tool round (an assistant tool call and its result) or a turn
    (an assistant answer and a user follow-up), so every step extends the last.

    Every message of the client's own text is tagged ``[tenant:conversation]``. The tool
    results come from a small pool per conversation id, so they repeat (pointers) and are the
    same for both tenants' conversations of a shared id; the calls' queries name the tenant.
    """

    tenant: str
    conversation_id: str
    api: str
    source: str  # "header", "body" or "user"
    steps: int
    seed: int

    @property
    def tag(self) -> str:
        return f"[{self.tenant}:{self.conversation_id}]"

    def messages(self, step: int) -> tuple[Any, list[dict[str, Any]]]:
        """``(system, messages)`` of the request at ``step``."""
        rng = random.Random(self.seed)
        pool_rng = random.Random(self.conversation_id)
        pool = [
            f"Passage {k} on {self.conversation_id}: "
            + " ".join(f"w{pool_rng.randrange(900)}" for _ in range(60))
            for k in range(3)
        ]
        system = f"{self.tag} You are a research agent; call search for evidence."
        openai = self.api == "openai"
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if openai else []
        messages.append({"role": "user", "content": f"{self.tag} Find the facts on topic 7."})
        for event in range(step):
            if rng.random() < 0.75:
                call_id = f"call_{event}"
                query = {"query": f"{self.tenant}-{self.conversation_id}-r{event}"}
                result = pool[random.Random(f"{self.conversation_id}/{event}").randrange(3)]
                if openai:
                    function = {"name": "search", "arguments": json.dumps(query)}
                    messages.append({"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function", "function": function}]})  # fmt: skip
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
                else:
                    use = {"type": "tool_use", "id": call_id, "name": "search", "input": query}
                    text = {"type": "text", "text": f"{self.tag} Searching."}
                    messages.append({"role": "assistant", "content": [text, use]})
                    answer = {"type": "tool_result", "tool_use_id": call_id, "content": result}
                    messages.append({"role": "user", "content": [answer]})
            else:
                messages.append({"role": "assistant", "content": f"{self.tag} Answer {event}."})
                messages.append({"role": "user", "content": f"{self.tag} And then, {event}?"})
        return (None if openai else system), messages

    def request(
        self, step: int, nonce: str, rng: random.Random
    ) -> tuple[str, dict[str, Any], dict[str, str]]:
        """``(path, body, headers)`` of the request at ``step``."""
        system, messages = self.messages(step)
        openai = self.api == "openai"
        body: dict[str, Any] = {"model": "stand-in", "messages": messages, "bench_nonce": nonce}
        body["tools"] = TOOLS_OPENAI if openai else TOOLS_ANTHROPIC
        if not openai:
            body |= {"system": system, "max_tokens": 64}
        if rng.random() < 0.5:
            body["stream"] = True
            if openai and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json", NONCE_HEADER: nonce}
        if self.source == "header":
            headers["x-contextpilot-session"] = self.conversation_id
        elif self.source == "body":
            body["contextpilot"] = {"conversation_id": self.conversation_id}
        elif openai:
            body["user"] = self.conversation_id
        else:
            body["metadata"] = {"user_id": self.conversation_id}
        if openai or rng.random() < 0.5:
            headers["authorization"] = f"Bearer {KEYS[self.tenant]}"
        else:
            headers["x-api-key"] = KEYS[self.tenant]
        return ("/v1/chat/completions" if openai else "/v1/messages"), body, headers


# --------------------------------------------------------------------------------------------
# Fuzzed requests
# --------------------------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


_ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**63, -(2**70), 10**400, 1e308, -0.0, 1.5, "", "x" * 600, "\u0000",
    "é\u202e", [], {}, ["a", 1, None], {"role": "user"}, {"type": "tool_result"},
]  # fmt: skip
_BAD_EXTENSIONS: list[Any] = [
    5, "x", [], {"unknown": 1}, {"documents": "one"}, {"documents": [""]}, {"documents": [1]},
    {"documents": ["d"] * 300}, {"documents": ["d" * 1_000_000] * 5}, {"query": "q"},
    {"documents": ["d"], "query": 3}, {"conversation_id": 5}, {"conversation_id": "\u0007x"},
    {"conversation_id": "x" * 600}, {"conversation_id": ""}, {"documents": ["   "]},
    {"documents": ["a valid document", "another"], "query": "what?"},
]  # fmt: skip
_HOSTILE_SESSIONS: list[bytes] = [
    b"", b"x" * 600, b"mid\tdle", "c\u0085one".encode(), b"\xff\xfe\xfd", b"../../etc",
    "\u202eevil".encode(), b"%00", b"alice", b"bob", b"conv-0-0", "é".encode("latin-1"),
]  # fmt: skip
_PASS_THROUGH: list[tuple[str, str]] = [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
    ("GET", "/v1/models/org%2Fname"), ("GET", "/v1/nothing/here"), ("GET", "/v1/../health"),
    ("GET", "/v1/%2e%2e/metrics"), ("GET", "/v1/./models"), ("PUT", "/v1/plan"),
    ("DELETE", "/v1/usage"), ("GET", "/v1/chat/completions"), ("PATCH", "/v1/messages"),
    ("GET", "/v1/models?x=%3F&y"), ("OPTIONS", "/v1/models"),
]  # fmt: skip


def _odd(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.05:
        return _nested(rng.choice([30, 70, 300, 900]))
    if roll < 0.08:
        return [{"role": "user", "content": "m"}] * rng.randrange(1, 2_000)
    return copy.deepcopy(rng.choice(_ODD_VALUES))


def mutate(body: Any, rng: random.Random) -> Any:
    """A mutated copy of a JSON value (one to three mutations at random places)."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        body = _mutate_once(body, rng)
    return body


def _mutate_once(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict) and value and rng.random() < 0.75:
        key = rng.choice(list(value))
        action = rng.random()
        if action < 0.25:
            del value[key]
        elif action < 0.35:
            value[f"extra_{rng.randrange(9)}"] = _odd(rng)
        elif action < 0.5:
            value[key] = _odd(rng)
        else:
            value[key] = _mutate_once(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.75:
        index = rng.randrange(len(value))
        value[index] = _mutate_once(value[index], rng) if rng.random() < 0.6 else _odd(rng)
        return value
    return _odd(rng)


def fuzzed_request(
    rng: random.Random, nonce: str
) -> tuple[str, str, bytes | None, dict[str, str | bytes]]:
    """method, path, raw body, headers of one fuzzed request."""
    tenant = rng.choice(TENANTS)
    conversation = Conversation(
        tenant, nonce, rng.choice(["openai", "anthropic"]),
        rng.choice(["header", "body", "user"]), 6, rng.randrange(10**9),
    )  # fmt: skip
    path, body, plain_headers = conversation.request(rng.randrange(6), nonce, rng)
    headers: dict[str, str | bytes] = dict(plain_headers)
    method = "POST"
    if rng.random() < 0.15:
        method, path = rng.choice(_PASS_THROUGH)
    roll = rng.random()
    if roll < 0.15:
        body["contextpilot"] = copy.deepcopy(rng.choice(_BAD_EXTENSIONS))
        raw: bytes | None = json.dumps(body).encode()
    elif roll < 0.6:
        raw = json.dumps(mutate(body, rng)).encode()
    elif roll < 0.67:
        raw = json.dumps(body).encode()[: rng.randrange(1, 200)]  # truncated
    elif roll < 0.72:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # not JSON
    elif roll < 0.77:  # lone surrogates in a message and in the system prompt
        text = json.dumps(body).replace("Find the facts", "Find \\ud800 the \\udfff facts")
        raw = text.replace("research agent", "research \\udbff agent").encode()
    elif roll < 0.81:
        depth = rng.choice([2_000, 50_000])  # nested deeper than any parser recursion
        raw = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    elif roll < 0.84:
        raw = json.dumps({**body, "messages": [], "max_tokens": 10**30}).encode()
    else:
        raw = json.dumps(body).encode()
    if rng.random() < 0.2:
        headers["x-contextpilot-session"] = rng.choice(_HOSTILE_SESSIONS)
    for name in ("authorization", "x-api-key"):
        headers.pop(name, None)
    keys = [KEYS["alice"], KEYS["bob"], "wrong-key", None, KEYS["bob"].upper()]
    key = rng.choices(keys, weights=[40, 40, 7, 7, 6])[0]
    if key is not None:
        header = rng.choice(["authorization", "x-api-key", "x-contextpilot-api-key"])
        scheme = rng.choices(["Bearer", "bearer", "Basic"], weights=[8, 1, 1])[0]
        headers[header] = f"{scheme} {key}" if header == "authorization" else key
    if rng.random() < 0.1:
        headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded"])
    headers[FAULT_HEADER] = _fault(rng)
    return method, path, raw, headers


def _fault(rng: random.Random) -> str:
    return rng.choices(list(FAULT_WEIGHTS), weights=list(FAULT_WEIGHTS.values()))[0]


# --------------------------------------------------------------------------------------------
# Sending and judging one request
# --------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What came back for one request (``status`` ``None``: nothing; ``problem``: what
    went wrong on the way, ``hang`` or a transport error's name)."""

    status: int | None
    headers: httpx.Headers | None
    body: bytes
    cut_short: bool
    problem: str | None


async def send(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    raw: bytes | None,
    headers: dict[str, str | bytes],
) -> Answer:
    status: int | None = None
    answer_headers: httpx.Headers | None = None
    chunks: list[bytes] = []
    raw_headers = {
        name.encode("ascii"): value if isinstance(value, bytes) else value.encode("latin-1")
        for name, value in headers.items()
    }
    try:
        async with client.stream(method, path, content=raw, headers=raw_headers) as response:
            status, answer_headers = response.status_code, response.headers
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
    except httpx.TimeoutException:
        return Answer(status, answer_headers, b"".join(chunks), False, "hang")
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        if status is not None:
            return Answer(status, answer_headers, b"".join(chunks), True, None)
        return Answer(None, None, b"", False, type(exc).__name__)
    except httpx.TransportError as exc:
        return Answer(None, None, b"", False, type(exc).__name__)
    return Answer(status, answer_headers, b"".join(chunks), False, None)


def echo_of(answer: Answer, path: str) -> dict[str, Any] | None:
    """The stand-in's echo in a whole 200 answer (``None``: none readable)."""
    text = answer.body.decode("utf-8", "replace")
    try:
        kind = answer.headers.get("content-type", "") if answer.headers is not None else ""
        if "text/event-stream" in kind:
            pieces = []
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("type") == "content_block_delta":
                    pieces.append(event["delta"]["text"])
                for choice in event.get("choices", ()):
                    pieces.append(choice["delta"].get("content") or "")
            echoed = "".join(pieces)
        else:
            document = json.loads(text)
            if path.startswith("/v1/chat/completions"):
                echoed = document["choices"][0]["message"]["content"]
            elif path.startswith("/v1/messages"):
                echoed = document["content"][0]["text"]
            else:
                echoed = document["echo"]
        found: dict[str, Any] = json.loads(echoed)
        return found
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def judge(answer: Answer, fault: str, nonce: str, path: str, planned_valid: bool) -> str:
    """The outcome of one request: a label; those in :data:`FAILURES` miss the target.

    ``planned_valid``: a valid request of the concurrent phase (a 4xx of the proxy is then a
    failure, and the whole answer must carry its own body nonce and the rid reported)."""
    if answer.problem == "hang":
        return "hang"
    if answer.status is None or answer.headers is None:
        return f"transport error {answer.problem}"
    status, headers = answer.status, answer.headers
    if headers.get("x-contextpilot-rid") == FORGED_RID:
        return "wrong answer"
    echoed = headers.get(ECHO_HEADER)
    if echoed is not None and echoed != nonce:
        return "wrong answer"
    from_upstream = echoed is not None
    if answer.cut_short:
        return "cut short, as asked" if from_upstream and fault in CUT_SHORT else "cut short"
    if not from_upstream:  # the proxy's own answer
        proper = {502: ("hangup", "hangup-once"), 504: ("stall",)}.get(status, ())
        if fault in proper:
            return f"{status} naming the upstream" if b"upstream" in answer.body else "proxy 5xx"
        if status >= 500:
            return "proxy 5xx"
        if status < 300 and path.startswith(("/v1/chat/completions", "/v1/messages")):
            return "wrong answer"  # a planned call's answer can only come from upstream
        return "refused a valid request" if planned_valid else f"proxy {status}"
    if fault in CUT_SHORT or fault in ("hangup", "stall"):
        return "unexpected whole answer"
    if fault.startswith("error-"):
        ok = status == int(fault[6:]) and nonce.encode() in answer.body
        return f"upstream {status} passed" if ok else "wrong answer"
    if status != 200:
        return "refused a valid request" if planned_valid else f"upstream {status}"
    found = echo_of(answer, path)
    if found is None:
        return "unreadable answer" if planned_valid else "upstream 200"
    if found.get("nonce") != nonce:
        return "wrong answer"
    if planned_valid and (
        found.get("body_nonce") != nonce or found.get("rid") != headers.get("x-contextpilot-rid")
    ):
        return "wrong answer"
    return "answered"


FAILURES = (
    "hang", "wrong answer", "proxy 5xx", "cut short", "refused a valid request",
    "unexpected whole answer", "unreadable answer",
)  # fmt: skip
"""Outcome labels that miss the target (with every ``transport error ...``)."""


def failed(label: str) -> bool:
    return label in FAILURES or label.startswith("transport error")


# --------------------------------------------------------------------------------------------
# The phases
# --------------------------------------------------------------------------------------------


@dataclass
class Sent:
    """What the concurrent phase sent, for the checks after it."""

    bodies: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """nonce -> (tenant, the body as sent)."""
    conversations: dict[str, set[str]] = field(default_factory=dict)
    """tenant -> the conversation ids its answers named (``x-contextpilot-conversation``)."""
    plans: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tenant, conversation id) -> requests answered with the proxy's report."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """The first three requests of each outcome that missed the target, as sent and as
    answered."""

    def keep(
        self,
        label: str,
        method: str,
        path: str,
        raw: bytes | None,
        headers: dict[str, str | bytes],
        answer: Answer,
    ) -> None:
        if failed(label) and sum(f["outcome"] == label for f in self.failures) < 3:
            self.failures.append(
                {
                    "outcome": label,
                    "request": f"{method} {path}",
                    "body_bytes": len(raw or b""),
                    "headers": {k: repr(v)[:200] for k, v in headers.items()},
                    "body": (raw or b"")[:1500].decode("utf-8", "replace"),
                    "status": answer.status,
                    "answer": answer.body[:300].decode("utf-8", "replace"),
                }
            )

    def note(self, tenant: str | None, answer: Answer) -> None:
        named = answer.headers.get("x-contextpilot-conversation") if answer.headers else None
        if tenant is not None and named is not None:
            conversation = unquote(named)
            self.conversations.setdefault(tenant, set()).add(conversation)
            self.plans[tenant, conversation] += 1


def _tenant_of_key(headers: dict[str, str | bytes]) -> str | None:
    for name in ("x-contextpilot-api-key", "authorization", "x-api-key"):
        value = headers.get(name)
        if isinstance(value, str):
            token = value.strip()
            if name == "authorization":
                scheme, _, token = token.partition(" ")
                token = token.strip() if scheme.lower() == "bearer" else ""
            return next((t for t, k in KEYS.items() if k == token), None)
    return None


async def fuzz_phase(url: str, count: int, timeout_s: float, seed: int, sent: Sent) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    numbers = iter(range(count))
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def worker(number: int) -> None:
            rng = random.Random(seed * 1_000 + number)
            for index in numbers:
                nonce = f"fuzz-{index}"
                method, path, raw, headers = fuzzed_request(rng, nonce)
                answer = await send(client, method, path, raw, headers)
                label = judge(answer, str(headers[FAULT_HEADER]), nonce, path, False)
                outcomes[label] += 1
                sent.note(_tenant_of_key(headers), answer)
                sent.keep(label, method, path, raw, headers, answer)

        await asyncio.gather(*(worker(n) for n in range(32)))
    return outcomes


async def concurrent_phase(
    url: str, count: int, timeout_s: float, seed: int, sent: Sent
) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    budget = [count]
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def worker(number: int) -> None:
            rng = random.Random(seed * 7_919 + number)
            pair, tenant = number // 2, TENANTS[number % 2]
            for index in range(10**9):
                # Even conversations: one id for both tenants of a pair of workers.
                shared = index % 2 == 0
                conversation_id = f"conv-{pair}-{index}" if shared else f"{tenant}-{pair}-{index}"
                conversation = Conversation(
                    tenant, conversation_id, "openai" if (pair + index) % 2 else "anthropic",
                    rng.choices(["header", "body", "user"], weights=[6, 2, 2])[0],
                    rng.randrange(3, 8), rng.randrange(10**9),
                )  # fmt: skip
                for step in range(conversation.steps):
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                    nonce = f"conc-{number}-{index}-{step}"
                    path, body, headers = conversation.request(step, nonce, rng)
                    fault = _fault(rng)
                    all_headers: dict[str, str | bytes] = {
                        **headers,
                        FAULT_HEADER: fault,
                        RECORD_HEADER: "1",
                    }
                    sent.bodies[nonce] = (tenant, body)
                    raw = json.dumps(body).encode()
                    answer = await send(client, "POST", path, raw, all_headers)
                    label = judge(answer, fault, nonce, path, True)
                    outcomes[label] += 1
                    sent.note(tenant, answer)
                    sent.keep(label, "POST", path, raw, all_headers, answer)

        await asyncio.gather(*(worker(n) for n in range(128)))
    return outcomes


async def memory_phase(
    url: str, count: int, pid: int, timeout_s: float
) -> tuple[list[tuple[int, float]], int]:
    """``count`` small valid requests, 64 at a time, conversations of four steps; the proxy's
    RSS after each tenth, and the requests not answered 200."""
    done = [0]
    unanswered = [0]
    rss: list[tuple[int, float]] = [(0, rss_mb(pid))]
    marks = [round(count * k / 10) for k in range(1, 11)]
    numbers = iter(range(count))
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def worker(number: int) -> None:
            rng = random.Random(number)
            conversation: Conversation | None = None
            for index in numbers:
                step = index // 64 % 4
                if conversation is None or step == 0:
                    conversation = Conversation(
                        TENANTS[number % 2], f"mem-{number}-{index}",
                        "openai" if index % 2 else "anthropic", "header", 4, index,
                    )  # fmt: skip
                path, body, headers = conversation.request(step, f"mem-{index}", rng)
                answer = await send(client, "POST", path, json.dumps(body).encode(), dict(headers))
                unanswered[0] += answer.status != 200 or answer.cut_short
                done[0] += 1
                while marks and done[0] >= marks[0]:
                    rss.append((marks.pop(0), rss_mb(pid)))

        await asyncio.gather(*(worker(n) for n in range(64)))
    return rss, unanswered[0]


# --------------------------------------------------------------------------------------------
# The checks after the concurrent phase
# --------------------------------------------------------------------------------------------

_POINTER_CALL = re.compile(r"\[Same .*? search\((.*?)\) above")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(part.get("text", part.get("content"))) for part in content
                         if isinstance(part, dict))  # fmt: skip
    return ""


def _calls_and_results(messages: list[Any], api: str) -> tuple[list[tuple[int, str, str]], dict]:
    """``([(message index, call id, query)], {call id: (message index, result text)})``."""
    calls: list[tuple[int, str, str]] = []
    results: dict[str, tuple[int, str]] = {}
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if api == "openai":
            for call in message.get("tool_calls") or ():
                query = json.loads(call["function"]["arguments"]).get("query", "")
                calls.append((index, call["id"], query))
            if message.get("role") == "tool":
                results[message["tool_call_id"]] = (index, _text(message.get("content")))
        elif isinstance(message.get("content"), list):
            for block in message["content"]:
                if block.get("type") == "tool_use":
                    calls.append((index, block["id"], block["input"].get("query", "")))
                elif block.get("type") == "tool_result":
                    results[block["tool_use_id"]] = (index, _text(block.get("content")))
    return calls, results


def forwarded_fault(
    sent_body: dict[str, Any], received: dict[str, Any], tenant: str, pointers: list[int]
) -> str | None:
    """Why a body the stand-in received is not the one its client sent (``None``: it is),
    ``"cross-tenant"`` where it holds another tenant's or conversation's text.

    The proxy may replace a tool result by a pointer naming an earlier call of the same body
    whose result (as the client sent it) holds the replaced text; nothing else may change but
    the fields it adds (``rid``, ``request_id``, ``session_id``, ``cache_salt``) and its body
    extension, which it strips. ``pointers[0]`` is increased by the pointers found."""
    api = "openai" if "system" not in sent_body else "anthropic"
    dumped = json.dumps(received.get("messages"), ensure_ascii=False)
    system = json.dumps(received.get("system"), ensure_ascii=False)
    tags = {m.group(0) for m in _TAG.finditer(dumped + system)}
    expected_tag = _TAG.search(json.dumps(sent_body["messages"], ensure_ascii=False))
    if tags - {expected_tag.group(0) if expected_tag else ""}:
        return "cross-tenant"
    others = [t for t in TENANTS if t != tenant]
    if any(re.search(rf"search\(\{{\"query\": \"{re.escape(o)}-", dumped) for o in others):
        return "cross-tenant"
    fields = {k: v for k, v in received.items() if k not in ("rid", "request_id", "session_id",
                                                             "cache_salt")}  # fmt: skip
    expected = {k: v for k, v in sent_body.items() if k != "contextpilot"}
    if {k: v for k, v in fields.items() if k != "messages"} != {
        k: v for k, v in expected.items() if k != "messages"
    }:
        return "altered fields"
    given, forwarded = sent_body["messages"], received.get("messages")
    if not isinstance(forwarded, list) or len(forwarded) != len(given):
        return "altered messages"
    calls, sent_results = _calls_and_results(given, api)
    for index, (mine, theirs) in enumerate(zip(given, forwarded)):
        if mine == theirs:
            continue
        if not isinstance(theirs, dict) or theirs.get("role") != mine.get("role"):
            return "altered messages"
        pointer = _POINTER_CALL.search(_text(theirs.get("content")))
        if pointer is None:
            return "altered messages"
        named = pointer.group(1)
        earlier = [
            call_id for position, call_id, query in calls
            if position < index and (named == json.dumps({"query": query})
                                     or named.endswith("\u2026") and json.dumps(
                                         {"query": query}).startswith(named[:-1]))
        ]  # fmt: skip
        if not earlier:
            return "cross-tenant" if any(o in named for o in others) else "pointer to nothing"
        replaced = [r for call_id, (pos, r) in sent_results.items() if pos == index]
        pointers[0] += 1
        whole = "[Same result as" in pointer.group(0) and replaced
        if whole and all(sent_results[c][1].strip() != replaced[0].strip() for c in earlier):
            return "pointer to other text"
    return None


def check_forwarded(record: Path, sent: Sent) -> dict[str, Any]:
    """Every recorded body against the one its client sent, and the tenants' salts and rid
    tags (one per tenant, none shared)."""
    faults: Counter[str] = Counter()
    salts: dict[str, set[Any]] = {t: set() for t in TENANTS}
    tags: dict[str, set[str]] = {t: set() for t in TENANTS}
    checked = 0
    pointers = [0]
    examples: list[str] = []
    with open(record, encoding="utf-8") as handle:
        for line in handle:
            entry = json.loads(line)
            mine = sent.bodies.get(entry["nonce"])
            if mine is None or not isinstance(entry["body"], dict):
                faults["unknown body"] += 1
                continue
            tenant, body = mine
            checked += 1
            fault = forwarded_fault(body, entry["body"], tenant, pointers)
            if fault is not None:
                faults[fault] += 1
                if len(examples) < 3:
                    examples.append(f"{entry['nonce']}: {fault}")
            salts[tenant].add(entry["body"].get("cache_salt"))
            tags[tenant].add(str(entry["body"].get("rid")).split(".")[0])
    own_salts = all(len(s) <= 1 and None not in s for s in salts.values())
    own_tags = all(len(t) <= 1 for t in tags.values())
    shared = salts["alice"] & salts["bob"] or tags["alice"] & tags["bob"]
    return {
        "bodies_checked": checked,
        "pointers_checked": pointers[0],
        "body_faults": dict(faults),
        "body_fault_examples": examples,
        "salts_and_rid_tags_per_tenant": own_salts and own_tags and not shared,
    }


def check_usage(url: str, sent: Sent) -> dict[str, Any]:
    """Each tenant's ``GET /v1/usage``: only its own conversations, with its plan counts."""
    leaks = 0
    plan_mismatches = 0
    listed = 0
    for tenant, key in KEYS.items():
        figures = httpx.get(
            f"{url}/v1/usage", headers={"authorization": f"Bearer {key}"}, timeout=30
        ).json()
        conversations = figures.get("conversations", {})
        leaks += len(set(conversations) - {tenant})
        mine = sent.conversations.get(tenant, set())
        for conversation_id, totals in conversations.get(tenant, {}).items():
            listed += 1
            if conversation_id not in mine:
                leaks += 1
            elif conversation_id.startswith(("conv-", f"{tenant}-", "user:conv-",
                                             f"user:{tenant}-")):  # fmt: skip
                plan_mismatches += totals.get("plans") != sent.plans[tenant, conversation_id]
    return {"usage_listed": listed, "usage_leaks": leaks, "usage_plan_mismatches": plan_mismatches}


# --------------------------------------------------------------------------------------------
# Processes and the run
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def _wait_ready(url: str, process: subprocess.Popen[bytes], headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url, timeout=1, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes], wait_s: float) -> tuple[int | None, float]:
    """SIGTERM ``process``; its exit code (``None``: killed after ``wait_s``) and seconds."""
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(wait_s)
        return process.returncode, time.perf_counter() - started
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None, time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-faults-") as directory:
        keys = Path(directory) / "keys.json"
        keys.write_text(json.dumps({"tenants": {t: {"keys": [k]} for t, k in KEYS.items()}}))
        record = Path(directory) / "received.jsonl"
        upstream_port, proxy_port = free_port(), free_port()
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        url = f"http://127.0.0.1:{proxy_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_API_KEY")}
        upstream_log = open(Path(directory) / "upstream.log", "w+b")  # noqa: SIM115
        proxy_log = open(Path(directory) / "proxy.log", "w+b")  # noqa: SIM115
        upstream = subprocess.Popen(
            [sys.executable, __file__, "--serve-upstream", str(upstream_port),
             "--record", str(record), "--stall", str(args.upstream_timeout * 2 + 1)],
            stdout=subprocess.DEVNULL, stderr=upstream_log, env=env,
        )  # fmt: skip
        try:
            _wait_ready(f"{upstream_url}/v1/models", upstream, {})
            proxy = subprocess.Popen(
                [sys.executable, "-m", "contextpilot_integrations.service.server",
                 "--port", str(proxy_port), "--upstream", f"{upstream_url}/v1",
                 "--upstream-timeout", str(args.upstream_timeout), "--api-keys", str(keys),
                 "--shutdown-timeout", "5", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=proxy_log, env=env,
            )  # fmt: skip
            try:
                _wait_ready(f"{url}/health", proxy, {})
                figures["rss_start_mb"] = rss_mb(proxy.pid)
                sent = Sent()
                started = time.perf_counter()
                fuzzed = asyncio.run(fuzz_phase(url, args.fuzzed, args.timeout, args.seed, sent))
                figures["fuzzed_s"] = time.perf_counter() - started
                figures["rss_after_fuzzed_mb"] = rss_mb(proxy.pid)
                record.write_text("")  # the concurrent phase's bodies only
                started = time.perf_counter()
                concurrent = asyncio.run(
                    concurrent_phase(url, args.concurrent, args.timeout, args.seed, sent)
                )
                figures["concurrent_s"] = time.perf_counter() - started
                figures["rss_after_concurrent_mb"] = rss_mb(proxy.pid)
                figures |= check_forwarded(record, sent)
                figures |= check_usage(url, sent)
                figures |= {"memory_rss_mb": [], "memory_unanswered": 0, "memory_s": 0.0}
                if args.memory:
                    started = time.perf_counter()
                    figures["memory_rss_mb"], figures["memory_unanswered"] = asyncio.run(
                        memory_phase(url, args.memory, proxy.pid, args.timeout)
                    )
                    figures["memory_s"] = time.perf_counter() - started
                health_started = time.perf_counter()
                healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
                figures["health_s"] = time.perf_counter() - health_started
                figures["healthy_after"] = healthy and figures["health_s"] < 1.0
                figures["rss_end_mb"] = rss_mb(proxy.pid)
            finally:
                exit_code, stop_s = _stop(proxy, 30)
        finally:
            _stop(upstream, 10)
        for name, log in (("proxy", proxy_log), ("upstream", upstream_log)):
            log.seek(0)
            figures[f"{name}_log_tail"] = log.read().decode(errors="replace")[-2000:]
            log.close()
    both = fuzzed + concurrent
    figures |= {
        "failure_examples": sent.failures,
        "fuzzed_requests": sum(fuzzed.values()),
        "concurrent_requests": sum(concurrent.values()),
        "fuzzed_outcomes": dict(sorted(fuzzed.items())),
        "concurrent_outcomes": dict(sorted(concurrent.items())),
        "hangs": both["hang"],
        "lost": sum(n for label, n in both.items() if failed(label) and label != "wrong answer"),
        "wrong_answers": both["wrong answer"],
        "proxy_server_errors": both["proxy 5xx"],
        "cross_tenant": figures["body_faults"].get("cross-tenant", 0) + figures["usage_leaks"],
        "stopped_by_sigterm": exit_code in (0, -signal.SIGTERM),
        "sigterm_s": stop_s,
    }
    return figures


def missed(figures: dict[str, Any]) -> list[str]:
    """The targets the figures miss (empty: all met)."""
    misses = [
        name
        for name in ("lost", "wrong_answers", "proxy_server_errors", "cross_tenant")
        if figures[name]
    ]
    if sum(figures["body_faults"].values()) or figures["usage_plan_mismatches"]:
        misses.append("forwarded bodies and usage as sent")
    if not figures["salts_and_rid_tags_per_tenant"]:
        misses.append("salts and rid tags per tenant")
    if figures["memory_unanswered"]:
        misses.append("memory phase answered")
    if not figures["healthy_after"]:
        misses.append("healthy after")
    if not figures["stopped_by_sigterm"]:
        misses.append("stopped by SIGTERM")
    return misses


def report(figures: dict[str, Any]) -> None:
    misses = missed(figures)
    print(
        f"{figures['fuzzed_requests']} fuzzed requests in {figures['fuzzed_s']:.1f} s, "
        f"{figures['concurrent_requests']} concurrent in {figures['concurrent_s']:.1f} s; "
        f"faults drawn with weights {FAULT_WEIGHTS}"
    )
    rows = [
        ("requests lost (hangs, proxy 5xx, cut short, refused, ...)", figures["lost"], "0"),
        ("  of which hangs", figures["hangs"], "0"),
        ("  of which the proxy's own 5xx", figures["proxy_server_errors"], "0"),
        ("answers with another request's answer", figures["wrong_answers"], "0"),
        ("cross-tenant (bodies received, /v1/usage listings)", figures["cross_tenant"], "0"),
        (f"bodies received checked against those sent ({figures['bodies_checked']}, "
         f"{figures['pointers_checked']} pointers)",
         sum(figures["body_faults"].values()), "0 differ"),
        (f"/v1/usage conversations listed ({figures['usage_listed']}), plans miscounted",
         figures["usage_plan_mismatches"], "0"),
        ("one cache_salt and rid tag per tenant, none shared",
         figures["salts_and_rid_tags_per_tenant"], "True"),
        ("/health after the run (s)", f"{figures['health_s']:.3f}", "< 1"),
        ("stopped by SIGTERM (s)",
         f"{figures['stopped_by_sigterm']} ({figures['sigterm_s']:.1f})", "True"),
        ("proxy RSS: start / after fuzzed / after concurrent / end (MiB)",
         f"{figures['rss_start_mb']:.0f} / {figures['rss_after_fuzzed_mb']:.0f} / "
         f"{figures['rss_after_concurrent_mb']:.0f} / {figures['rss_end_mb']:.0f}", ""),
    ]  # fmt: skip
    if figures["memory_rss_mb"]:
        rows.append((f"memory phase: requests not answered 200 ({figures['memory_s']:.0f} s)",
                     figures["memory_unanswered"], "0"))  # fmt: skip
    for after, mb in figures["memory_rss_mb"]:
        rows.append((f"  proxy RSS after {after:,} of them (MiB)", f"{mb:.0f}", ""))
    width = max(len(str(r[0])) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>22}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value!s:>22}  {target}")
    print(f"fuzzed outcomes {figures['fuzzed_outcomes']}")
    print(f"concurrent outcomes {figures['concurrent_outcomes']}")
    if figures["body_fault_examples"]:
        print(f"bodies that differ, e.g. {figures['body_fault_examples']}")
    for example in figures["failure_examples"]:
        print(f"failed: {json.dumps(example)[:2500]}")
    if misses:
        print(f"MISSES: {', '.join(misses)}")
        for name in ("proxy", "upstream"):
            if figures[f"{name}_log_tail"]:
                print(f"{name} stderr (tail):\n{figures[f'{name}_log_tail']}")
    else:
        print("meets every target")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzzed", type=int, default=10_000)
    parser.add_argument("--concurrent", type=int, default=10_000)
    parser.add_argument(
        "--memory", type=int, default=0, help="requests of the memory phase (default 0: none)"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds: longer is a hang")
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=1.0,
        help="the proxy's --upstream-timeout (seconds; a stalled answer waits longer)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--stall", type=float, default=5.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.stall, args.record)
        return 0
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        report(figures)
    return 1 if missed(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
