"""Calls sent over HTTP to proxy processes served in this process, spread round-robin over
them as a balancer would: several that plan as one (``contextpilot-server --upstream URL
--peer ... --peer-self ...``; docs/DESIGN.md, "Proxy peers"), or several that know nothing of
each other (the contrast), or one.

:func:`send_through_proxies` serves the processes (the real apps, uvicorn on threads of this
process: :mod:`~contextpilot_bench.served_app`) in front of a recording stand-in upstream,
sends the calls in order, call ``i`` to process ``i mod n``, and returns the messages of each
body the upstream received. A call that reaches a process that does not own it takes the hop
to its owner, so the figures include the rule, the mark and the hop. The stand-in answers
every call with :data:`ANSWER_TEXT`.

:func:`send_through_peers` does it for an agent run's recorded prompts (the conversation named
by the ``x-contextpilot-session`` header as the in-process ``proxy`` row names it,
:mod:`~contextpilot_bench.agent_proxy`).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx

from contextpilot_bench.agent_proxy import MODEL
from contextpilot_bench.agent_replay import AgentRun
from contextpilot_bench.served_app import bound_socket, served_app

__all__ = ["ANSWER_TEXT", "ProxyCall", "send_through_peers", "send_through_proxies"]

ANSWER_TEXT = "ok"
"""The stand-in upstream's answer to every call."""

_ANSWER = json.dumps(
    {
        "id": "chatcmpl-recorded",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ANSWER_TEXT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()

_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProxyCall:
    """One chat call: its JSON body and its conversation header (``None``: none sent)."""

    body: Mapping[str, Any]
    session: str | None = None


class _RecordingUpstream:
    """A bare ASGI upstream that keeps each chat body's messages by its ``rid`` and answers
    every call with :data:`ANSWER_TEXT`."""

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


def send_through_proxies(
    calls: Sequence[ProxyCall], processes: int, *, peers: bool
) -> list[list[Any]]:
    """The messages each of ``calls`` went upstream with, call ``i`` sent to process ``i mod
    processes`` (``peers``: the processes plan as one; else each alone).

    Raises:
        ValueError: a proxy answered a call with an error (named with the call's position).
    """
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.peer_config import PeerConfig
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    upstream = _RecordingUpstream()
    sockets = [bound_socket() for _ in range(processes)]
    urls = tuple(f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets)
    secret = secrets.token_hex(16)
    sent: list[list[Any]] = []
    with ExitStack() as stack:
        upstream_url = stack.enter_context(served_app(upstream, lifespan="off"))
        for sock, url in zip(sockets, urls, strict=True):
            group = PeerConfig(urls, url, secret) if peers and processes > 1 else None
            config = ServiceConfig(proxy=ProxyConfig(f"{upstream_url}/v1", peers=group))
            stack.enter_context(served_app(create_app(config), sock=sock))
        client = stack.enter_context(httpx.Client(timeout=_TIMEOUT_S))
        for position, call in enumerate(calls):
            headers = {"content-type": "application/json"}
            if call.session is not None:
                headers["x-contextpilot-session"] = call.session
            response = client.post(
                f"{urls[position % processes]}/v1/chat/completions",
                content=json.dumps(call.body, ensure_ascii=False).encode("utf-8"),
                headers=headers,
            )
            if response.status_code != 200:
                raise ValueError(
                    f"call {position} to proxy {position % processes} of {processes}: answered "
                    f"{response.status_code}: {response.text[:300]}"
                )
            sent.append(upstream.messages.pop(response.headers["x-contextpilot-rid"]))
    return sent


def send_through_peers(run: AgentRun, processes: int, method: str) -> AgentRun:
    """``run``'s prompts as ``processes`` proxy peers plan them, call ``i`` sent to process
    ``i mod processes``: the run named ``method``, with ``run``'s tool outputs.

    Raises:
        ValueError: a proxy answered a call with an error.
    """
    calls = [
        ProxyCall({"model": MODEL, "messages": [dict(m) for m in p.messages]}, p.session)
        for p in run.prompts
    ]
    sent = send_through_proxies(calls, processes, peers=True)
    prompts = [
        dataclasses.replace(prompt, messages=tuple(messages))
        for prompt, messages in zip(run.prompts, sent, strict=True)
    ]
    return AgentRun(method, prompts, dict(run.originals))
