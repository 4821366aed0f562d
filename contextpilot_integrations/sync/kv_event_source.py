"""The engine's own KV-cache events as a cache-state source: a subscriber feeding a mirror.

Wiring: ``KVEventSubscriber(on_batch=mirror.apply_batch, on_resync=mirror.resync)`` and
``CacheMirror(on_evict=...)``; :meth:`KVEventSource.record` registers the request's token
ids with the mirror for attribution by token matching (the rid sent as ``session_id`` is
attributed without it where the engine echoes it).
"""

from __future__ import annotations

from typing import Any

from contextpilot_integrations.sync.block_mirror import DEFAULT_MAX_BLOCKS
from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.cache_state_source import (
    EvictCallback,
    SentRequest,
    SessionCallback,
)
from contextpilot_integrations.sync.subscriber import KVEventSubscriber


class KVEventSource:
    """Follows an engine's cache through its KV events and evicts through ``on_evict``.

    Args:
        endpoint, replay_endpoint, topic, dp_size: as for :class:`KVEventSubscriber`.
        on_evict: e.g. ``ContextIndex.evict``.
        page_size: as for :class:`CacheMirror` (None: learnt from the events).
        max_requests, max_blocks: as for :class:`CacheMirror`.
        replay_timeout_s: as for :class:`KVEventSubscriber`.
        on_session: as for :class:`CacheMirror` (each echoed ``session_id``).
    """

    def __init__(
        self,
        endpoint: str,
        on_evict: EvictCallback | None = None,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_size: int = 1,
        page_size: int | None = None,
        max_requests: int = 100_000,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        replay_timeout_s: float = 2.0,
        on_session: SessionCallback | None = None,
    ) -> None:
        self.mirror = CacheMirror(
            on_evict,
            page_size=page_size,
            max_requests=max_requests,
            max_blocks=max_blocks,
            on_session=on_session,
        )
        self.subscriber = KVEventSubscriber(
            endpoint,
            replay_endpoint,
            topic,
            on_batch=self.mirror.apply_batch,
            on_resync=self.mirror.resync,
            dp_size=dp_size,
            replay_timeout_s=replay_timeout_s,
        )

    def record(self, request: SentRequest) -> list[str]:
        """Register the request's token ids for attribution, in its namespace (its
        ``cache_salt`` and LoRA adapter; nothing to do without token ids).

        Returns:
            always empty: evictions arrive with the engine's events.
        """
        if request.token_ids is not None:
            self.mirror.register_request(
                request.rid,
                request.token_ids,
                cache_salt=request.cache_salt,
                lora_name=request.lora_name,
            )
        return []

    def touch(self, rid: str) -> bool:
        """Cache hits are the engine's business (its LRU, seen through its events): nothing
        to do; returns whether ``rid`` is believed cached."""
        return self.mirror.is_cached(rid)

    def forget(self, rid: str) -> bool:
        """Stop tracking ``rid`` without ``on_evict`` (e.g. the index dropped it by itself);
        False if it was not tracked."""
        return self.mirror.forget_request(rid)

    def start(self) -> None:
        """Start the subscriber thread (the engine may start later)."""
        if not self.subscriber.running:
            self.subscriber.start()

    def stop(self) -> None:
        """Stop the subscriber thread (idempotent)."""
        self.subscriber.stop()

    def stats(self) -> dict[str, Any]:
        """``{"subscriber": ..., "mirror": ...}`` counters."""
        return {"subscriber": self.subscriber.stats(), "mirror": self.mirror.stats()}
