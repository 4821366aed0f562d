"""What ``GET /health`` knows of the replicas that send no KV events: each one's own
``GET /health``, asked in the background (docs/DESIGN.md, "The proxy").

A replica with a KV-event link is reported down by its link; one without is otherwise known
to be down only once a call it was sent is refused. So each ``GET /health`` of the proxy starts,
for each such replica whose last answer is older than :data:`FRESH_S`, one probe of the engine's
own ``GET /health`` (its base URL less ``/v1``; vLLM and SGLang serve it), bounded by
:data:`PROBE_TIMEOUT_S`, and never more than one at a time per replica. The proxy's answer does
not wait for it: it reports the last answers (a replica not answered yet counts as up). A
replica whose engine did not answer in time, refused the connection or answered a 5xx counts as
down there until it answers again; routing is left to the router (a refused call still routes
around a replica at once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp

from contextpilot_integrations.service.proxy.upstream import engine_root

__all__ = ["FRESH_S", "PROBE_TIMEOUT_S", "ReplicaProbes"]

logger = logging.getLogger(__name__)

FRESH_S = 1.0
"""Seconds a replica's answer stands before the proxy's next ``GET /health`` asks again."""

PROBE_TIMEOUT_S = 2.0
"""Longest wait for a replica's ``GET /health`` answer (connect and read together)."""


class ReplicaProbes:
    """The background probes of the replicas without KV events (module docstring).

    Args:
        base_urls: each probed replica's base URL, by name.
        clock: monotonic seconds.
    """

    def __init__(
        self, base_urls: Mapping[str, str], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._urls = {name: f"{engine_root(url)}/health" for name, url in base_urls.items()}
        self._clock = clock
        self._asked_at: dict[str, float] = {}
        self._down: set[str] = set()
        self._probes: dict[str, asyncio.Task[None]] = {}  # on the event loop
        self._client: aiohttp.ClientSession | None = None

    def refresh(self) -> None:
        """Start a probe of each replica whose last answer is stale and none is under way (on
        the event loop; returns at once)."""
        now = self._clock()
        for name, url in self._urls.items():
            if name in self._probes or now - self._asked_at.get(name, -FRESH_S) < FRESH_S:
                continue
            self._asked_at[name] = now
            task = asyncio.ensure_future(self._probe(name, url))
            self._probes[name] = task
            task.add_done_callback(functools.partial(self._ended, name))

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        self._probes.pop(name, None)

    def down(self) -> set[str]:
        """The replicas whose last probe found them down."""
        return set(self._down)

    async def _probe(self, name: str, url: str) -> None:
        if self._client is None:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            self._client = aiohttp.ClientSession(timeout=timeout)
        try:
            async with self._client.get(url) as answer:
                up = answer.status < 500
        except Exception:  # refused, reset, timed out: it does not answer
            up = False
        if up:
            self._down.discard(name)
        elif name not in self._down:
            self._down.add(name)
            logger.warning("replica %s does not answer GET %s: /health counts it down", name, url)

    async def aclose(self) -> None:
        """Stop the probes under way and close the client."""
        for task in list(self._probes.values()):
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None
