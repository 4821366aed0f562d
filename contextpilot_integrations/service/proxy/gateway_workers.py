"""Which of a gateway's workers each replica is, read from the gateway's own answers, and how a
call is sent to the worker of the replica it was planned for (docs/DESIGN.md, "The proxy",
"The smg gateway").

SMG names the worker each answer came from in ``x-smg-routed-worker-id`` (the worker's URL),
under every policy, and under ``--policy consistent_hashing`` it sends a request carrying
``x-smg-target-worker: I`` to the ``I``-th of its workers (0-based, in its own registration
order, which need not be the order of ``--worker-urls``). :class:`GatewayWorkers` keeps:

- :meth:`~GatewayWorkers.replica_at`: the replica whose ``base_url`` names a worker URL (None:
  none of the fleet's);
- :meth:`~GatewayWorkers.calibrate`: each replica's worker index, learnt once before it is
  used: one tiny request per index, twice, and targeting is on only when each index's two
  answers name the same replica and the indexes name every replica once (a gateway that
  ignores the header, under ``round_robin`` say, fails this and is never targeted);
- :meth:`~GatewayWorkers.headers`: the target header of a replica while targeting is on;
- :meth:`~GatewayWorkers.check`: a targeted call whose answer names another replica, or that
  the gateway refused for want of that worker (a 503 ``no_available_workers``: the worker is
  down or out of its list, which also shifts the indexes), turns targeting off: calls go with
  the routing key alone again (a client's retry of the refused call with them), and the
  router moves calls that landed elsewhere from the answers and the KV events as before;
- :meth:`~GatewayWorkers.recalibrate`: once targeting that was on has turned off, a fresh
  calibration after a back-off (:data:`RECALIBRATE_AFTER_S`, doubled after each try up to
  :data:`RECALIBRATE_MAX_S`), and another while it fails; one that succeeds turns targeting on
  again with the indexes it learnt (a restarted worker rejoins the gateway's list). Each try
  costs what the first calibration did, two one-token calls per index. A gateway never
  targeted (it ignores the index, or never answered) is not tried again.

Thread-safe: the state is swapped whole under a lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import aiohttp

from contextpilot_integrations.core.replicas.routing_config import ReplicaSpec
from contextpilot_integrations.service.proxy.endpoint_url import same_endpoint
from contextpilot_integrations.service.proxy.upstream import Upstream

__all__ = [
    "ROUTED_WORKER_HEADER",
    "SMG_ROUTING_KEY_HEADER",
    "TARGET_WORKER_HEADER",
    "GatewayWorkers",
    "upstream_probe",
]

logger = logging.getLogger(__name__)

ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
"""SMG's answer header naming the worker (its URL) the request went to."""

TARGET_WORKER_HEADER = "x-smg-target-worker"
"""SMG's request header naming the worker (its 0-based index) under ``consistent_hashing``."""

SMG_ROUTING_KEY_HEADER = "x-smg-routing-key"
"""SMG's request header that ``consistent_hashing`` hashes onto its ring of workers when no
:data:`TARGET_WORKER_HEADER` is given."""

ERROR_CODE_HEADER = "x-smg-error-code"
"""SMG's answer header naming why it refused a request."""

NO_WORKER_CODE = "no_available_workers"
"""The :data:`ERROR_CODE_HEADER` of a request whose target worker is not available (a 503)."""

PROBES_PER_INDEX = 2
"""Requests per worker index in :meth:`GatewayWorkers.calibrate`: two in a row tell a gateway
that honours the index from one that alternates its workers."""

RETRY_S = 2.0
"""Seconds between calibration tries while the gateway is not answering yet."""

MAX_TRIES = 30
"""Calibration tries before targeting is given up (the gateway never answered)."""

PROBE_TIMEOUT_S = 60.0
"""Longest wait for one calibration request's answer."""

RECALIBRATE_AFTER_S = 30.0
"""Seconds from targeting turning off to the first recalibration."""

RECALIBRATE_MAX_S = 900.0
"""The longest back-off between recalibrations (each one doubles it, up to this)."""

State = Literal["pending", "on", "off"]

Probe = Callable[[int], Awaitable[str | None]]
"""``(worker index) -> the worker URL the gateway's answer named`` (None: it named none);
raises ``OSError`` or ``asyncio.TimeoutError`` while the gateway cannot be reached."""


class GatewayWorkers:
    """The fleet's replicas as the gateway's workers (module docstring).

    Args:
        replicas: the fleet's replicas; those without a ``base_url`` cannot be recognised.
        enabled: whether to target workers at all (the fleet's ``target_workers``); off,
            :meth:`calibrate` does nothing and :meth:`headers` is always empty.
    """

    def __init__(self, replicas: Sequence[ReplicaSpec], *, enabled: bool) -> None:
        self._by_url = {
            same_endpoint(spec.base_url): spec.name
            for spec in replicas
            if spec.base_url is not None
        }
        self._names = [spec.name for spec in replicas]
        self.enabled = enabled
        self._lock = threading.Lock()
        self._state: State = "pending" if enabled else "off"
        self._index: dict[str, int] = {}
        self._reason = "" if enabled else "not enabled"
        self.misrouted = 0
        self.recalibrations = 0
        self._off_signal: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    @property
    def state(self) -> State:
        """``pending`` (not calibrated yet), ``on`` or ``off``."""
        return self._state

    def replica_at(self, worker_url: str) -> str | None:
        """The replica the gateway's worker ``worker_url`` is, or None (also for a URL that
        names no endpoint, such as one with a port past 65535)."""
        try:
            return self._by_url.get(same_endpoint(worker_url))
        except ValueError:
            return None

    def headers(self, replica: str) -> list[tuple[str, str]]:
        """The target header that sends a call to ``replica``'s worker (empty unless on)."""
        index = self._index.get(replica) if self._state == "on" else None
        return [] if index is None else [(TARGET_WORKER_HEADER, str(index))]

    def check(self, planned: str, targeted: bool, answer_headers: Mapping[str, str]) -> str | None:
        """The replica a call planned for ``planned`` reached, as its answer's
        :data:`ROUTED_WORKER_HEADER` names it (None: not named, or not one of the fleet's). A
        ``targeted`` call that reached another replica turns targeting off."""
        url = answer_headers.get(ROUTED_WORKER_HEADER)
        landed = self.replica_at(url) if url else None
        if landed is not None and targeted and landed != planned:
            self._turn_off(
                f"a call sent to replica {planned!r}'s worker reached replica {landed!r}"
            )
        elif targeted and answer_headers.get(ERROR_CODE_HEADER) == NO_WORKER_CODE:
            # The worker is out of the gateway's list (down, or its circuit breaker open):
            # the gateway would have routed the call elsewhere without the index.
            self._turn_off(f"the gateway had no worker for replica {planned!r}'s index")
        return landed

    async def calibrate(self, probe: Probe) -> None:
        """Learn each replica's worker index (module docstring); tries again every
        :data:`RETRY_S` seconds while the gateway cannot be reached, until it decides."""
        if self._state != "pending":
            return
        reason: str | None = f"the gateway did not answer {MAX_TRIES} calibration tries"
        found: dict[int, str | None] = {}
        for _ in range(MAX_TRIES):
            try:
                found = await self._probe_all(probe)
            except (OSError, asyncio.TimeoutError) as exc:
                logger.info("gateway not ready for calibration (%s): trying again", exc)
                await asyncio.sleep(RETRY_S)
                continue
            except Exception as exc:  # never leaves the proxy's lifespan with an error
                reason = f"calibration failed ({exc!r:.200})"
                break
            reason = self._verdict(found)
            break
        with self._lock:
            if self._state != "pending":
                return
            if reason is None:
                self._index = {r: i for i, r in found.items() if r is not None}
                self._state = "on"
                logger.info("gateway workers calibrated: %s", self._index)
            else:
                self._state, self._reason = "off", reason
                logger.warning("gateway workers not targeted: %s", reason)

    async def recalibrate(self, probe: Probe) -> None:
        """Runs while the proxy does (cancelled at its shutdown): each time targeting that was
        on turns off, calibrates afresh after the back-off, and again while that fails
        (module docstring). Returns at once if targeting is not on after :meth:`calibrate`."""
        if self._state != "on":
            return
        turned_off = asyncio.Event()
        self._off_signal = (asyncio.get_running_loop(), turned_off)
        try:
            while True:
                turned_off.clear()
                if self._state == "on":  # else a recalibration failed: the next one is due
                    await turned_off.wait()
                delay = min(RECALIBRATE_MAX_S, RECALIBRATE_AFTER_S * 2.0**self.recalibrations)
                await asyncio.sleep(delay)
                self.recalibrations += 1
                await self._recalibrate_once(probe)
        finally:
            self._off_signal = None

    def stats(self) -> dict[str, Any]:
        """``state``, ``workers`` (replica -> worker index), ``reason`` it is off,
        ``misrouted`` (targeted calls that reached another replica, or that the gateway
        refused for want of the worker) and ``recalibrations`` (tries after it turned off)."""
        with self._lock:
            return {
                "state": self._state,
                "workers": dict(self._index),
                "reason": self._reason,
                "misrouted": self.misrouted,
                "recalibrations": self.recalibrations,
            }

    # ------------------------------------------------------------------ internals
    async def _probe_all(self, probe: Probe) -> dict[int, str | None]:
        """index -> the replica both its probes reached (None: they disagreed or named none)."""
        found: dict[int, str | None] = {}
        for index in range(len(self._names)):
            landed = [await probe(index) for _ in range(PROBES_PER_INDEX)]
            names = {self.replica_at(url) if url else None for url in landed}
            found[index] = names.pop() if len(names) == 1 else None
        return found

    def _verdict(self, found: Mapping[int, str | None]) -> str | None:
        """Why ``found`` cannot be used (None: every index names its own replica)."""
        if any(replica is None for replica in found.values()):
            return (
                f"the gateway did not send each worker index to one named replica ({dict(found)}"
                f"; is it SMG with --policy consistent_hashing?)"
            )
        if sorted(found.values()) != sorted(self._names):  # type: ignore[type-var]
            return f"the worker indexes do not name each replica once ({dict(found)})"
        return None

    async def _recalibrate_once(self, probe: Probe) -> None:
        """One fresh calibration while targeting is off: on again if it succeeds."""
        try:
            found = await self._probe_all(probe)
        except (OSError, asyncio.TimeoutError) as exc:
            reason: str | None = f"recalibration: the gateway did not answer ({exc})"
        except Exception as exc:  # never ends the recalibrating task with an error
            reason = f"recalibration failed ({exc!r:.200})"
        else:
            reason = self._verdict(found)
        with self._lock:
            if reason is None:
                self._index = {r: i for i, r in found.items() if r is not None}
                self._state, self._reason = "on", ""
            else:
                self._reason = reason
        if reason is None:
            logger.info("gateway workers recalibrated, targeted again: %s", self._index)
        else:
            logger.warning("gateway workers still not targeted: %s", reason)

    def _turn_off(self, reason: str) -> None:
        with self._lock:
            self.misrouted += 1
            if self._state != "on":
                return
            self._state, self._reason = "off", reason
        logger.warning("gateway workers no longer targeted: %s", reason)
        signal = self._off_signal
        if signal is not None:  # told on the recalibrating task's loop, from any thread
            loop, turned_off = signal
            loop.call_soon_threadsafe(turned_off.set)


def upstream_probe(upstream: Upstream) -> Probe:
    """The :data:`Probe` of the gateway ``upstream``: a chat call of one token of answer to a
    one-character prompt, for the first model its ``GET /v1/models`` lists, with the proxy's
    upstream credentials; a failed call or an error status raises ``OSError`` (not ready)."""
    models: list[str] = []
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    sent = upstream.request_headers(())

    async def probe(index: int) -> str | None:
        try:
            if not models:
                async with upstream.client.get(
                    upstream.url("/v1/models"), headers=sent, timeout=timeout
                ) as response:
                    listed = (await response.json()).get("data") if response.ok else None
                if not listed or not isinstance(listed[0], dict) or "id" not in listed[0]:
                    raise OSError(f"GET /v1/models lists no model (status {response.status})")
                models.append(str(listed[0]["id"]))
            body = {
                "model": models[0],
                "messages": [{"role": "user", "content": "."}],
                "max_tokens": 1,
            }
            headers = [*sent, ("content-type", "application/json")]
            headers.append((TARGET_WORKER_HEADER, str(index)))
            async with upstream.client.post(
                upstream.url("/v1/chat/completions"),
                data=json.dumps(body).encode(),
                headers=headers,
                timeout=timeout,
            ) as response:
                await response.read()
                if not response.ok:
                    raise OSError(f"a calibration call got status {response.status}")
                return response.headers.get(ROUTED_WORKER_HEADER)
        except (aiohttp.ClientError, ValueError) as exc:
            raise OSError(str(exc) or type(exc).__name__) from exc

    return probe
