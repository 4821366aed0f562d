"""An ASGI app served by uvicorn in a thread of the test process, on a free 127.0.0.1 port.

The stand-in servers of the tests (an OpenAI-compatible engine, the hosted APIs) keep their
state in the test process, so a test reads what they received without any IPC. The socket is
bound before uvicorn starts (port 0: the kernel picks a free one), so no other process can take
the port between choosing and binding it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

START_TIMEOUT_S = 10.0


@contextmanager
def serve_in_thread(
    app: Callable[..., Any], *, lifespan: str = "off", start_timeout_s: float = START_TIMEOUT_S
) -> Iterator[str]:
    """Serve ``app`` (uvicorn, warnings only; ``lifespan`` "off" or "on": an app whose startup
    starts engine links wants "on") until the block exits.

    Yields the base URL ``http://127.0.0.1:<port>`` (no trailing slash, no path). On exit the
    server is asked to stop, its thread is joined (up to 10 s) and the socket closed.

    Raises:
        RuntimeError: the server had not started after ``start_timeout_s`` seconds.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test server for {app!r} did not start within {start_timeout_s} s"
                )
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        if thread.is_alive():
            thread.join(timeout=10)
        sock.close()
