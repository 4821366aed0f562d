"""Choosing the cache-state source by configuration.

A mapping (from a config file, CLI flags or environment) such as::

    {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5557",
     "replay_endpoint": "tcp://127.0.0.1:5558"}
    {"kind": "capacity", "capacity_tokens": 200000}
    {"kind": "ttl", "provider": "anthropic"}            # or "openai", or "ttl_s": 600
    {"kind": "ttl", "provider": "anthropic", "model": "claude-haiku-4-5"}  # its minimum

is validated into :class:`CacheSyncConfig` and built by :func:`build_cache_state_source` into a
:class:`~contextpilot_integrations.sync.cache_state_source.CacheStateSource` that reports evictions
through ``on_evict`` (e.g. ``ContextIndex.evict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from contextpilot_integrations.llm_call.provider_minimums import (
    OPENAI_MIN_CACHED_TOKENS,
    anthropic_min_cacheable_tokens,
)
from contextpilot_integrations.sync.block_mirror import DEFAULT_MAX_BLOCKS
from contextpilot_integrations.sync.cache_state_source import (
    CacheStateSource,
    EvictCallback,
    SessionCallback,
)
from contextpilot_integrations.sync.capacity_model import CapacityModel
from contextpilot_integrations.sync.kv_event_source import KVEventSource
from contextpilot_integrations.sync.ttl_model import TTLModel

_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
_PROVIDER_TTL_S = {"openai": 300.0, "anthropic": 300.0, "anthropic-1h": 3600.0}
_PROVIDER_MIN_TOKENS = {"openai": OPENAI_MIN_CACHED_TOKENS}


class CacheSyncConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which source follows the engine's cache, and its settings.

    ``kind="kv-events"`` needs ``endpoint``; ``kind="capacity"`` needs ``capacity_tokens``;
    ``kind="ttl"`` needs ``provider`` ("openai", "anthropic", "anthropic-1h") or ``ttl_s``;
    ``model`` picks an Anthropic model's minimum cacheable length
    (:func:`~contextpilot_integrations.llm_call.provider_minimums.anthropic_min_cacheable_tokens`),
    and ``min_cached_tokens`` overrides the minimum either way. ``engine_grace_s``: seconds the
    KV-event publisher may stay unconnected before the engine counts as unreachable (and a
    resync after a restore may wait for every rank: then it finishes with the ranks that
    joined, and counts a failure). ``max_blocks``: the KV-event mirror's bound on blocks per
    rank (:class:`~contextpilot_integrations.sync.cache_mirror.CacheMirror`).
    """

    kind: Literal["kv-events", "capacity", "ttl"]
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1
    page_size: int | None = None
    replay_timeout_s: float = 2.0
    capacity_tokens: int | None = None
    provider: Literal["openai", "anthropic", "anthropic-1h"] | None = None
    ttl_s: float | None = None
    model: str | None = None
    min_cached_tokens: int | None = None
    max_requests: int = 100_000
    max_blocks: int = DEFAULT_MAX_BLOCKS
    engine_grace_s: float = 5.0

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> CacheSyncConfig:
        """Validate ``settings``.

        Raises:
            ValueError: an unknown key, a wrong type or value, or a setting the kind needs is
                missing; the message names the field.
        """
        if not isinstance(settings, Mapping):
            raise ValueError(
                f"cache_sync must be a mapping such as {{'kind': 'kv-events', ...}}, "
                f"got {type(settings).__name__}: {settings!r:.80}"
            )
        try:
            config = msgspec.convert(dict(settings), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid cache sync config: {exc}") from exc
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ValueError naming the field when a setting the kind needs is missing."""
        if self.kind == "kv-events" and not self.endpoint:
            raise ValueError("cache sync kind 'kv-events' needs 'endpoint', got None")
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            # The ZMQ transports engines publish on; anything else would fail only when the
            # link starts, with zmq's error naming no setting.
            if value is not None and not value.startswith(_ZMQ_TRANSPORTS):
                raise ValueError(
                    f"{name} must be a ZMQ endpoint (tcp://host:port, ipc://path or "
                    f"inproc://name), got {value!r:.120}"
                )
        if self.kind == "capacity" and (self.capacity_tokens is None or self.capacity_tokens <= 0):
            raise ValueError(
                f"cache sync kind 'capacity' needs 'capacity_tokens' > 0, "
                f"got {self.capacity_tokens!r}"
            )
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks!r}")
        if not self.engine_grace_s > 0:
            raise ValueError(f"engine_grace_s must be > 0, got {self.engine_grace_s!r}")
        if self.kind == "ttl" and self.provider is None and self.ttl_s is None:
            raise ValueError("cache sync kind 'ttl' needs 'provider' or 'ttl_s', got neither")


def build_cache_state_source(
    config: CacheSyncConfig | Mapping[str, Any],
    on_evict: EvictCallback | None,
    *,
    on_session: SessionCallback | None = None,
) -> CacheStateSource:
    """Build the configured source (not started: call ``start()``); ``on_session`` is called
    with each rid the engine echoes on a stored block (KV events only).

    Raises:
        ValueError: as :meth:`CacheSyncConfig.from_mapping`.
    """
    if not isinstance(config, CacheSyncConfig):
        config = CacheSyncConfig.from_mapping(config)
    else:
        config.validate()
    if config.kind == "kv-events":
        assert config.endpoint is not None
        return KVEventSource(
            config.endpoint,
            on_evict,
            replay_endpoint=config.replay_endpoint,
            topic=config.topic,
            dp_size=config.dp_size,
            page_size=config.page_size,
            max_requests=config.max_requests,
            max_blocks=config.max_blocks,
            replay_timeout_s=config.replay_timeout_s,
            on_session=on_session,
        )
    if config.kind == "capacity":
        assert config.capacity_tokens is not None
        return CapacityModel(config.capacity_tokens, on_evict)
    ttl_s = config.ttl_s if config.ttl_s is not None else _PROVIDER_TTL_S[config.provider or ""]
    min_tokens = config.min_cached_tokens
    if min_tokens is None and config.provider in ("anthropic", "anthropic-1h"):
        min_tokens = anthropic_min_cacheable_tokens(config.model)
    if min_tokens is None:
        min_tokens = _PROVIDER_MIN_TOKENS.get(config.provider or "", 0)
    return TTLModel(ttl_s, on_evict, min_cached_tokens=min_tokens, max_requests=config.max_requests)
