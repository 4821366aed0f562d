"""An ASGI app served by uvicorn on a thread of this process, on 127.0.0.1: the proxies the
benchmark runs in process (and the stand-ins in front of which they run), so a run reads their
own figures after it. The client and the server then share the interpreter, which adds to the
server's latency, never takes from it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

__all__ = ["STARTUP_S", "bound_socket", "served_app"]

STARTUP_S = 30.0


def bound_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, so its URL is known before the app served
    on it is made (proxy peers name each other)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def served_app(
    app: Callable[..., Any],
    *,
    sock: socket.socket | None = None,
    lifespan: Literal["on", "off"] = "on",
) -> Iterator[str]:
    """Serve ``app`` on ``sock`` (default: :func:`bound_socket`) until the block exits; yields
    its root URL ``http://127.0.0.1:<port>``. ``lifespan``: ``"on"`` for an app whose startup
    starts something (the service's engine links), ``"off"`` for a bare ASGI callable.

    Raises:
        RuntimeError: it did not start within :data:`STARTUP_S`.
    """
    import uvicorn

    sock = sock or bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"{app!r:.80} did not start within {STARTUP_S:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_S)
        sock.close()
