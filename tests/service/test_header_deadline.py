"""A request whose headers trickle in is closed at the header deadline; an answer that streams
past it, on a reused connection too, is never cut (docs/DESIGN.md, "The service")."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from contextpilot_integrations.service.header_deadline import HeaderDeadlineProtocol

DEADLINE_S = 0.5


class _ShortDeadline(HeaderDeadlineProtocol):
    timeout_s = DEADLINE_S


async def _slow_stream(scope: Any, receive: Any, send: Any) -> None:
    """Three chunks, a deadline and a half apart in all: an answer longer than the deadline."""
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for part in (b"a", b"b"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
        await asyncio.sleep(DEADLINE_S * 0.75)
    await send({"type": "http.response.body", "body": b"c", "more_body": False})


@contextmanager
def _served(keep_alive_s: float = 5.0) -> Iterator[tuple[str, int]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        _slow_stream,
        log_level="error",
        lifespan="off",
        http=_ShortDeadline,
        timeout_keep_alive=keep_alive_s,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "did not start in 10 s"
            time.sleep(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_deadline() -> None:
    with _served() as address, socket.create_connection(address) as raw:
        started = time.monotonic()
        raw.settimeout(DEADLINE_S / 5)
        closed = False
        for byte in b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: " + b"y" * 1000:
            try:
                raw.sendall(bytes([byte]))
                closed = raw.recv(1) == b""  # b"": the server closed the connection
            except TimeoutError:
                continue  # still open, nothing said
            except OSError:
                closed = True
            if closed or time.monotonic() - started > 10 * DEADLINE_S:
                break
        held = time.monotonic() - started
    assert closed, f"still open after {held:.1f} s"
    assert DEADLINE_S * 0.9 <= held < 5 * DEADLINE_S


def test_an_answer_longer_than_the_deadline_is_whole_on_a_reused_connection() -> None:
    with _served() as (host, port), httpx.Client(base_url=f"http://{host}:{port}") as client:
        for _ in range(2):  # the second on the kept-alive connection
            assert client.get("/").text == "abc"


_REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def _answer(raw: socket.socket) -> bytes:
    """The body of one chunked answer read from ``raw``."""
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        chunk = raw.recv(65_536)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return b"".join(received.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[1::2])


def test_an_idle_kept_alive_connection_is_kept_alive_past_the_header_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="contextpilot_integrations.service.header_deadline")
    with _served(keep_alive_s=6 * DEADLINE_S) as address, socket.create_connection(address) as raw:
        raw.settimeout(5)
        raw.sendall(_REQUEST)
        assert _answer(raw) == b"abc"
        time.sleep(2 * DEADLINE_S)  # idle: the keep-alive's time, not the header deadline's
        raw.sendall(_REQUEST)
        assert _answer(raw) == b"abc"
    assert caplog.records == []


def test_headers_trickling_after_an_answer_are_cut_off_at_the_deadline() -> None:
    with _served(keep_alive_s=20 * DEADLINE_S) as address, socket.create_connection(address) as raw:
        raw.settimeout(5)
        raw.sendall(_REQUEST)
        assert _answer(raw) == b"abc"
        time.sleep(2 * DEADLINE_S)
        raw.sendall(b"GET / HTTP/1.1\r\n")  # the next request's first bytes, then no more
        started = time.monotonic()
        assert raw.recv(1) == b""  # the server closed the connection
        held = time.monotonic() - started
    assert DEADLINE_S * 0.9 <= held < 5 * DEADLINE_S
