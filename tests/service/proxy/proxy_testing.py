"""Helpers of the proxy tests: a proxy app served by uvicorn in a thread of the test process
(lifespan on, so the service starts and the upstream pool is closed at the end), an upstream
that hangs up on its first connections unanswered, and the conversations the tests send."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import openai
import uvicorn
from upstream_standin import SEARCH_RESULT

from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.service_config import ServiceConfig


@contextmanager
def serve_proxy(
    upstream_url: str | None,
    proxy: dict[str, Any] | None = None,
    *,
    sock: socket.socket | None = None,
    wrap: Callable[[Any], Any] | None = None,
    **service: Any,
) -> Iterator[str]:
    """A proxy in front of ``upstream_url`` (``proxy``: more :class:`ProxyConfig` fields,
    ``service``: :class:`ServiceConfig` fields) on ``sock`` (default: a new one on a free
    port; :func:`bound_socket`), its app served as ``wrap`` makes it (an ASGI app around
    it); yields its base URL."""
    config = ServiceConfig(proxy=ProxyConfig(upstream_url, **(proxy or {})), **service)
    app = create_app(config)
    if wrap is not None:
        app = wrap(app)
    sock = sock or bound_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the proxy did not start within 10 s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def bound_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, so its URL is known before the server on
    it is made (peers name each other)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (right now)."""
    return closed_port_urls(1)[0]


def closed_port_urls(count: int) -> list[str]:
    """``count`` distinct http URLs on 127.0.0.1 where nothing listens (right now): the
    ports are bound together, so no two are the same (a fleet refuses one engine twice)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


_CHAT_ANSWER = json.dumps(
    {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 0,
        "model": "raw",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "answered"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


@contextmanager
def hanging_up_upstream(unanswered: int, *, reset: bool) -> Iterator[tuple[str, list[int]]]:
    """An HTTP/1.1 upstream on 127.0.0.1 that reads each request and closes its first
    ``unanswered`` connections without a byte of answer (``reset``: with a TCP reset, else an
    orderly close), then answers every request with one chat completion (``Connection:
    close``). Yields ``(base URL, [connections accepted])``."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = [0]
    stop = threading.Event()

    def read_request(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return
            body += chunk

    def serve() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            with conn:
                read_request(conn)
                if accepted[0] <= unanswered:
                    if reset:  # SO_LINGER 0: close() sends a reset
                        conn.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    continue
                head = (
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(_CHAT_ANSWER)}\r\nconnection: close\r\n\r\n"
                )
                conn.sendall(head.encode() + _CHAT_ANSWER)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def dumped(messages: list[dict[str, Any]]) -> list[str]:
    """Each message as canonical JSON (what byte-identical history compares)."""
    return [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in messages]


def assert_replayed(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """The messages an upstream received on the earlier call lead the later call's, exactly."""
    assert dumped(after[: len(before)]) == dumped(before)


AGENT_SYSTEM = "You are a research agent. Use the search tool, then answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def agent_loop(clients: Sequence[openai.OpenAI], session: str | None) -> list[Any]:
    """A tool-using conversation against the stand-in's ``agent`` model, call ``i`` sent by
    ``clients[i]`` (``session``: the conversation header, or none); the raw responses
    (headers readable)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What does the cache keep?"}]},
    ]
    raws = []
    for client in clients:
        raw = client.chat.completions.with_raw_response.create(
            model="agent",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_headers={"x-contextpilot-session": session} if session else None,
        )
        raws.append(raw)
        message = raw.parse().choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": SEARCH_RESULT})
    return raws
