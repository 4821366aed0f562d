"""Helpers of the routing tests: OpenAI-compatible servers on 127.0.0.1 that record what they
were sent (headers, bodies), KV-event endpoints, and waiting for a condition."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class RecordingServer:
    """A chat-completions endpoint that answers every POST and records it."""

    def __init__(self) -> None:
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.requests.append(
                    {
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": body,
                    }
                )
                answer = json.dumps(
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model", "test-model"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "answer"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 100,
                            "completion_tokens": 1,
                            "total_tokens": 101,
                            "prompt_tokens_details": {"cached_tokens": 40},
                        },
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def header(self, name: str) -> list[str | None]:
        """The value of header ``name`` in each request, in order."""
        return [r["headers"].get(name.lower()) for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def recording_server() -> Iterator[Callable[[], RecordingServer]]:
    """``recording_server()``: a new running :class:`RecordingServer` (closed after the test)."""
    servers: list[RecordingServer] = []

    def make() -> RecordingServer:
        servers.append(RecordingServer())
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def ipc_endpoints(tmp_path: Path) -> Callable[[str], tuple[str, str]]:
    """``ipc_endpoints(name)``: a PUB and a replay endpoint of one replica, under tmp_path."""

    def make(name: str) -> tuple[str, str]:
        return f"ipc://{tmp_path}/{name}-events.ipc", f"ipc://{tmp_path}/{name}-replay.ipc"

    return make


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """``wait_for(condition, timeout_s=10)``: poll until true, else fail the test."""

    def wait(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout_s} s")
            time.sleep(0.01)

    return wait
