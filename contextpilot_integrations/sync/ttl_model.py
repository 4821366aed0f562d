"""A time-to-live model of a hosted API's prompt cache (OpenAI, Anthropic).

Hosted APIs cache a prompt prefix for a while after its last use and say nothing when it goes:

- OpenAI, "Prompt caching" guide: prompts from a minimum length are cached (hits in 128-token
  steps); with ``prompt_cache_retention="in_memory"`` (the default) cached prefixes stay active
  after 5 to 10 minutes of inactivity, at most an hour; ``"24h"`` keeps them longer, up to a
  day, without a stated lower bound.
- Anthropic, "Prompt caching" docs: the cache has a 5-minute lifetime (1 hour with
  ``"ttl": "1h"``), refreshed at no cost each time the cached content is read; the prefix up
  to a breakpoint must hold a minimum per model.

The minimums are :mod:`contextpilot_integrations.llm_call.provider_minimums`.

So a request is modelled as cached from its last use until ``ttl_s`` later; a request whose
prompt is below ``min_cached_tokens`` is never cached and is evicted at once. A read reported
back (``ContextPilot.record_usage`` with cached tokens, through the engine link's ``touch``)
refreshes the lifetime; a response that shows nothing was cached evicts the request there
(``record_usage`` with ``cache_write_tokens=0``). Expiry runs on each :meth:`TTLModel.record`
and, after :meth:`TTLModel.start`, on a timer thread. The presets take the shorter documented
lifetime: believing a prefix cached when it is not costs a reordering that buys nothing, the
opposite costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.llm_call.provider_minimums import (
    OPENAI_MIN_CACHED_TOKENS,
    anthropic_min_cacheable_tokens,
)
from contextpilot_integrations.sync.cache_state_source import (
    EvictCallback,
    SentRequest,
    notify_evicted,
)

logger = logging.getLogger(__name__)


class TTLModel:
    """Requests expire ``ttl_s`` seconds after their last use.

    Args:
        ttl_s: seconds a cached prompt survives without use.
        on_evict: called with each expired rid, e.g. ``ContextIndex.evict``.
        min_cached_tokens: prompts shorter than this are never cached (evicted at once).
        max_requests: bound on held requests; beyond it the least recently used expires early.
        check_interval_s: period of the timer thread started by :meth:`start`.
        clock: monotonic seconds; replaceable to drive expiry in tests.

    Raises:
        ValueError: a non-positive ``ttl_s``, ``max_requests`` or ``check_interval_s``, or a
            negative ``min_cached_tokens``.
    """

    def __init__(
        self,
        ttl_s: float,
        on_evict: EvictCallback | None = None,
        *,
        min_cached_tokens: int = 0,
        max_requests: int = 100_000,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        if min_cached_tokens < 0:
            raise ValueError(f"min_cached_tokens must be >= 0, got {min_cached_tokens!r}")
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests!r}")
        if check_interval_s <= 0:
            raise ValueError(f"check_interval_s must be positive, got {check_interval_s!r}")
        self.ttl_s = ttl_s
        self.min_cached_tokens = min_cached_tokens
        self._on_evict = on_evict
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # rid -> time of its last use, least recently used first; the bound expires early.
        self._last_use: LRU[str, float] = LRU(max_requests)
        self._counters = {"recorded": 0, "expired": 0, "too_short": 0, "evict_callback_errors": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def openai(cls, on_evict: EvictCallback | None = None, **kwargs: object) -> TTLModel:
        """OpenAI prompt caching: 5 minutes (the short end of 5-10, for either retention),
        :data:`~contextpilot_integrations.llm_call.provider_minimums.OPENAI_MIN_CACHED_TOKENS`."""
        minimum = OPENAI_MIN_CACHED_TOKENS
        return cls(300.0, on_evict, **{"min_cached_tokens": minimum, **kwargs})  # type: ignore[arg-type]

    @classmethod
    def anthropic(
        cls,
        on_evict: EvictCallback | None = None,
        *,
        one_hour: bool = False,
        model: str | None = None,
        **kwargs: object,
    ) -> TTLModel:
        """Anthropic prompt caching: 5 minutes (1 hour with ``one_hour``), refreshed by reads;
        the minimum cacheable length of ``model`` (``anthropic_min_cacheable_tokens``;
        ``min_cached_tokens=`` overrides it)."""
        ttl = 3600.0 if one_hour else 300.0
        minimum = anthropic_min_cacheable_tokens(model)
        return cls(ttl, on_evict, **{"min_cached_tokens": minimum, **kwargs})  # type: ignore[arg-type]

    def record(self, request: SentRequest) -> list[str]:
        """The request was sent (a use): hold it until ``ttl_s`` from now, then expire others.

        Returns:
            the rids evicted by this call (expired ones, and ``request.rid`` itself when its
            prompt is below ``min_cached_tokens``).
        """
        with self._lock:
            now = self._clock()
            self._counters["recorded"] += 1
            evicted = self._expire_locked(now)
            if request.prompt_tokens < self.min_cached_tokens:
                self._counters["too_short"] += 1
                self._last_use.pop(request.rid, None)
                evicted.append(request.rid)
            else:
                evicted.extend(rid for rid, _ in self._last_use.put(request.rid, now))
        self._notify(evicted)
        return evicted

    def touch(self, rid: str) -> bool:
        """A cache hit on ``rid`` refreshes its lifetime; False if it is not held (expired)."""
        with self._lock:
            if rid not in self._last_use:
                return False
            self._last_use.put(rid, self._clock())
            return True

    def forget(self, rid: str) -> bool:
        """Drop ``rid`` without calling ``on_evict``; False if it is not held."""
        with self._lock:
            return self._last_use.pop(rid, None) is not None

    def expire(self) -> list[str]:
        """Evict every request unused for ``ttl_s`` or more; returns them, oldest first."""
        with self._lock:
            evicted = self._expire_locked(self._clock())
        self._notify(evicted)
        return evicted

    def held_requests(self) -> list[str]:
        """The rids believed cached, least recently used first."""
        with self._lock:
            return list(self._last_use)

    def start(self) -> None:
        """Run :meth:`expire` every ``check_interval_s`` on a daemon thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ttl-model-expiry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the timer thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stats(self) -> dict[str, float | int]:
        """``requests`` held, ``recorded``, ``expired``, ``too_short``, ``ttl_s``."""
        with self._lock:
            return {**self._counters, "requests": len(self._last_use), "ttl_s": self.ttl_s}

    def _expire_locked(self, now: float) -> list[str]:
        evicted: list[str] = []
        while (oldest := self._last_use.oldest()) is not None and now - oldest[1] >= self.ttl_s:
            evicted.append(self._last_use.pop_oldest()[0])
        self._counters["expired"] += len(evicted)
        return evicted

    def _run(self) -> None:
        while not self._stop.wait(self._check_interval_s):
            self.expire()

    def _notify(self, evicted: list[str]) -> None:
        errors = notify_evicted(self._on_evict, evicted)
        if errors:
            with self._lock:
                self._counters["evict_callback_errors"] += errors
