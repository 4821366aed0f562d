"""Whether the engine's KV-event publisher can be reached, watched from the ZMQ socket monitor.

A ZMQ SUB socket connects in the background and retries forever without an error, so a
subscriber pointed at an engine that is down (or at the wrong port) simply receives nothing;
an idle engine looks the same. The service needs to tell them apart to count the failure and
warn (DESIGN.md invariant 5), so this module opens its own SUB socket per endpoint (no
subscription: the publisher sends it nothing) and reads the socket monitor's
``EVENT_CONNECTED`` / ``EVENT_DISCONNECTED`` (libzmq ``zmq_socket_monitor``; pyzmq
``Socket.get_monitor_socket``). A TCP or IPC connection established means the publisher is
bound and reachable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

LinkCallback = Callable[[str], object]
"""``callback(endpoint)``."""


class EngineLinkMonitor:
    """Watches each endpoint's connection state on a background thread.

    Args:
        endpoints: the publisher endpoints (``tcp://host:port`` or ``ipc://path``), e.g.
            ``KVEventSubscriber.endpoints``.
        on_unreachable: called once per outage, when an endpoint has not been connected for
            ``grace_s`` seconds (from start, or from a disconnection).
        on_reachable: called when an endpoint reported unreachable connects again.
        grace_s: how long a connection may take before the endpoint counts as unreachable.
        poll_interval_s: longest wait between checks of the stop flag.

    Raises:
        ValueError: no endpoints, or a non-positive ``grace_s`` / ``poll_interval_s``.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        on_unreachable: LinkCallback | None = None,
        on_reachable: LinkCallback | None = None,
        grace_s: float = 5.0,
        poll_interval_s: float = 0.1,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints must name at least one publisher endpoint, got none")
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s!r}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s!r}")
        self.endpoints = list(endpoints)
        self._on_unreachable = on_unreachable
        self._on_reachable = on_reachable
        self._grace_s = grace_s
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._connected = dict.fromkeys(self.endpoints, False)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True when every endpoint is connected right now."""
        return all(self._connected.values())

    def start(self) -> EngineLinkMonitor:
        """Start watching (idempotent); returns self."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="engine-link-monitor", daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its sockets (idempotent)."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        self._thread = None

    # ----------------------------------------------------------------------------------------
    # Thread
    # ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        sockets: list[zmq.Socket] = []
        monitors: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()
        try:
            for endpoint in self.endpoints:
                sub = context.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                sub.connect(endpoint)
                sockets.append(sub)
                monitors[monitor] = endpoint
                poller.register(monitor, zmq.POLLIN)
        except zmq.ZMQError:
            logger.exception("engine link monitor could not watch %s", self.endpoints)
            self._ready.set()
            self._close(context, sockets, monitors)
            return
        self._ready.set()
        down_since = dict.fromkeys(self.endpoints, time.monotonic())
        reported = dict.fromkeys(self.endpoints, False)
        try:
            while not self._stop.is_set():
                for monitor, _ in poller.poll(self._poll_ms):
                    endpoint = monitors[monitor]
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        self._connected[endpoint] = True
                        if reported[endpoint]:
                            reported[endpoint] = False
                            self._call(self._on_reachable, endpoint)
                    elif event == zmq.EVENT_DISCONNECTED:
                        self._connected[endpoint] = False
                        down_since[endpoint] = time.monotonic()
                now = time.monotonic()
                for endpoint, connected in self._connected.items():
                    if connected or reported[endpoint]:
                        continue
                    if now - down_since[endpoint] >= self._grace_s:
                        reported[endpoint] = True
                        self._call(self._on_unreachable, endpoint)
        finally:
            self._close(context, sockets, monitors)

    @staticmethod
    def _call(callback: LinkCallback | None, endpoint: str) -> None:
        if callback is None:
            return
        try:
            callback(endpoint)
        except Exception:
            logger.exception("engine link callback failed for %s", endpoint)

    @staticmethod
    def _close(
        context: zmq.Context, sockets: list[zmq.Socket], monitors: dict[zmq.Socket, str]
    ) -> None:
        for sub in sockets:
            sub.disable_monitor()
        for monitor in monitors:
            monitor.close(linger=0)
        for sub in sockets:
            sub.close(linger=0)
        context.term()
