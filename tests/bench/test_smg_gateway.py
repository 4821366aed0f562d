"""The real ``smg launch`` in front of two stand-in OpenAI-compatible workers on 127.0.0.1: it
starts and registers them, forwards the body fields that carry a plan's rid (``session_id``,
``request_id``; so the engines' KV events name the request), routes on the routing-key header
(one key, one worker; the header itself is not passed on), and stops with its process group.
With ``--assignment-mode delegate`` under ``round_robin`` a new key goes to the next worker in
turn (``min_group`` was seen to pin two keys met one after the other to the same worker). The
stand-ins answer like vLLM (``/health``, ``/v1/models`` owned by vllm, a streamed chat
completion with usage). Skips without ``smg`` (``scripts/setup-smg-env.sh``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from contextpilot_bench.engine_client import EngineClient
from contextpilot_bench.smg_gateway import SmgGateway
from contextpilot_bench.testbed.process_group import process_group_members
from support.engine_marks import NEEDS_SMG

from contextpilot_integrations.llm_call.engine_fields import ROUTING_HEADER

pytestmark = NEEDS_SMG


class Worker:
    """A vLLM-like worker that records every chat request's headers and body."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/v1/models":
                    models = {"object": "list", "data": [{"id": "m", "object": "model",
                                                          "owned_by": "vllm"}]}  # fmt: skip
                    self._send(200, json.dumps(models).encode())
                else:
                    self._send(200, b"")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                worker.requests.append({"path": self.path, "headers": headers, "body": body})
                usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                         "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
                chunks = [
                    {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
                    {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                    {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [], "usage": usage},
                ]  # fmt: skip
                stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                self._send(200, stream.encode(), "text/event-stream")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started = [Worker(), Worker()]
    yield started
    for worker in started:
        worker.close()


def test_smg_forwards_the_rid_fields_and_pins_each_routing_key_to_one_worker(
    workers: list[Worker],
) -> None:
    with SmgGateway(
        [w.url for w in workers],
        policy="round_robin",
        routing_header=ROUTING_HEADER,
        assignment_mode="delegate",
    ) as gateway:
        pid = gateway.pid
        assert pid is not None and process_group_members(pid)
        with EngineClient(gateway.base_url, model="m") as client:
            for n in range(8):
                key = f"key-{n % 2}"
                answer = client.chat(
                    [{"role": "user", "content": f"q{n}"}],
                    rid=f"rid-{n}",
                    headers={ROUTING_HEADER: key},
                )
                assert (answer.prompt_tokens, answer.cached_tokens) == (10, 4)
            for n in range(4):  # no key: round_robin
                client.chat([{"role": "user", "content": f"free{n}"}], rid=f"free-{n}")
    assert process_group_members(pid) == []
    seen = [r for w in workers for r in w.requests]
    assert len(seen) == 12
    for request in seen:
        rid = request["body"]["session_id"]
        assert request["body"]["request_id"] == rid
    # The gateway routes on the header (and does not pass it on); the rid tells the key.
    keys_on = [
        {int(r["body"]["session_id"].removeprefix("rid-")) % 2 for r in w.requests
         if r["body"]["session_id"].startswith("rid-")}
        for w in workers
    ]  # fmt: skip
    assert keys_on == [{0}, {1}] or keys_on == [{1}, {0}]
    # Requests without a key follow the policy (round_robin): both workers get some.
    free = [sum(r["body"]["session_id"].startswith("free") for r in w.requests) for w in workers]
    assert sum(free) == 4 and min(free) >= 1


def test_a_gateway_that_cannot_start_reports_its_log() -> None:
    with pytest.raises(ValueError, match="policy"):
        SmgGateway(["http://127.0.0.1:1"], policy="no-such-policy")
    with pytest.raises(ValueError, match="worker"):
        SmgGateway([])
    gateway = SmgGateway(["http://127.0.0.1:1"], startup_timeout=2.0)
    with pytest.raises(TimeoutError, match="smg not healthy after 2 s"):
        gateway.start()
    assert not gateway.running
