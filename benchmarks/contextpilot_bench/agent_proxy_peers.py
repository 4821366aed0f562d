"""The plain LangChain agent's prompts sent through proxy processes that plan as one
(``contextpilot-server --upstream URL --peer ... --peer-self ...``; docs/DESIGN.md, "Proxy
peers"), calls spread round-robin over them as a balancer would.

:func:`send_through_peers` serves the processes (the real apps, uvicorn on threads of this
process: :mod:`~contextpilot_bench.served_app`) in front of a recording stand-in upstream,
sends the baseline's recorded prompts to them over HTTP in call order, call ``i`` to process
``i mod n``, the conversation named by the ``x-contextpilot-session`` header as the in-process
``proxy`` row names it (:mod:`~contextpilot_bench.agent_proxy`), and keeps the messages of each
body the upstream received. A call that reaches a process that does not own its conversation
takes the hop to the owner, so the figures include the rule, the mark and the hop.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
from collections.abc import MutableMapping
from contextlib import ExitStack
from typing import Any

import httpx

from contextpilot_bench.agent_proxy import MODEL
from contextpilot_bench.agent_replay import AgentRun
from contextpilot_bench.served_app import bound_socket, served_app

__all__ = ["send_through_peers"]

_ANSWER = json.dumps(
    {
        "id": "chatcmpl-recorded",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()

_TIMEOUT_S = 60.0


class _RecordingUpstream:
    """A bare ASGI upstream that keeps each chat body's messages by its ``rid`` and answers
    every call with one short completion."""

    def __init__(self) -> None:
        self.messages: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = json.loads(b"".join(chunks))
        with self._lock:
            self.messages[body["rid"]] = body["messages"]
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(_ANSWER)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _ANSWER})


def send_through_peers(run: AgentRun, processes: int, method: str) -> AgentRun:
    """``run``'s prompts as ``processes`` proxy peers plan them, call ``i`` sent to process
    ``i mod processes``: the run named ``method``, with ``run``'s tool outputs.

    Raises:
        ValueError: a proxy answered a call with an error (named with the call's position).
    """
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.peer_config import PeerConfig
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    upstream = _RecordingUpstream()
    out = AgentRun(method, originals=dict(run.originals))
    sockets = [bound_socket() for _ in range(processes)]
    urls = tuple(f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets)
    secret = secrets.token_hex(16)
    with ExitStack() as stack:
        upstream_url = stack.enter_context(served_app(upstream, lifespan="off"))
        for sock, url in zip(sockets, urls, strict=True):
            peers = PeerConfig(urls, url, secret)
            config = ServiceConfig(proxy=ProxyConfig(f"{upstream_url}/v1", peers=peers))
            stack.enter_context(served_app(create_app(config), sock=sock))
        client = stack.enter_context(httpx.Client(timeout=_TIMEOUT_S))
        for position, prompt in enumerate(run.prompts):
            body = {"model": MODEL, "messages": [dict(m) for m in prompt.messages]}
            response = client.post(
                f"{urls[position % processes]}/v1/chat/completions",
                content=json.dumps(body, ensure_ascii=False).encode("utf-8"),
                headers={"content-type": "application/json",
                         "x-contextpilot-session": prompt.session},
            )  # fmt: skip
            if response.status_code != 200:
                raise ValueError(
                    f"{method} call {position}: the proxy answered {response.status_code}: "
                    f"{response.text[:300]}"
                )
            sent = upstream.messages[response.headers["x-contextpilot-rid"]]
            out.prompts.append(dataclasses.replace(prompt, messages=tuple(sent)))
    return out
