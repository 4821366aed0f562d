"""The common shape of every source of cache state: what the app tells it, what it calls back.

Three sources follow what an engine's prefix cache holds, and all end in the same call,
``on_evict(rid)`` (wired to ``ContextIndex.evict``):

- :class:`~contextpilot_integrations.sync.kv_event_source.KVEventSource`: the engine's own
  KV-cache events (SGLang, vLLM);
- :class:`~contextpilot_integrations.sync.capacity_model.CapacityModel`: a token budget with
  LRU, for engines that publish nothing;
- :class:`~contextpilot_integrations.sync.ttl_model.TTLModel`: a time-to-live, for hosted APIs
  with prompt caching (OpenAI, Anthropic).

The user picks one by configuration (:mod:`contextpilot_integrations.sync.configuration`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from contextpilot_integrations.core.plan import Plan

logger = logging.getLogger(__name__)

EvictCallback = Callable[[str], object]
"""``on_evict(rid)``; its return value (``ContextIndex.evict`` returns a bool) is ignored."""

SessionCallback = Callable[[str], object]
"""``on_session(rid)``: the engine stored blocks for the request whose rid it echoed as
``session_id`` (the request reached this engine); its return value is ignored."""


@dataclass(frozen=True)
class SentRequest:
    """What a cache-state source needs to know about a request sent to the engine.

    Attributes:
        rid: the request id the plan issued (sent as ``rid`` / ``request_id`` / ``session_id``).
        blocks: the prompt's context blocks in prompt order, as ``(block_id, tokens)``.
        token_ids: the prompt's token ids (engine tokenizer), for token-matching attribution
            of KV events; None when not known.
        cache_salt: the request's ``cache_salt`` (its tenant's cache namespace), or None.
        lora_name: the LoRA adapter the request was served with, or None.
    """

    rid: str
    blocks: tuple[tuple[int, int], ...] = ()
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty str, got {self.rid!r}")
        for block in self.blocks:
            if len(block) != 2 or block[1] < 0:
                raise ValueError(f"blocks must hold (block_id, tokens >= 0) pairs, got {block!r}")

    @property
    def prompt_tokens(self) -> int:
        """Token count: ``len(token_ids)`` when known, else the sum of the block tokens."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return sum(tokens for _, tokens in self.blocks)

    @classmethod
    def from_plan(cls, plan: Plan, token_ids: Sequence[int] | None = None) -> SentRequest:
        """From a :class:`~contextpilot_integrations.core.plan.Plan`: its rid, its shown
        blocks in prompt order (a shown placement always has a ``block_id``) and its
        ``cache_salt``."""
        blocks = tuple((b.block_id, b.tokens) for b in plan.blocks if b.block_id is not None)
        tokens = tuple(token_ids) if token_ids is not None else None
        return cls(plan.rid, blocks, tokens, cache_salt=plan.cache_salt)


@runtime_checkable
class CacheStateSource(Protocol):
    """A follower of an engine's cache that reports evictions through ``on_evict(rid)``."""

    def record(self, request: SentRequest) -> list[str]:
        """The request was sent; returns the rids evicted right away (may be empty)."""
        ...

    def touch(self, rid: str) -> bool:
        """The engine served ``rid`` from its cache; False when ``rid`` is not held."""
        ...

    def forget(self, rid: str) -> bool:
        """Stop following ``rid`` without calling ``on_evict``; False when it was not held."""
        ...

    def start(self) -> None:
        """Start background work (a subscriber thread, an expiry timer), if any."""
        ...

    def stop(self) -> None:
        """Stop background work; idempotent."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring."""
        ...


def notify_evicted(
    on_evict: EvictCallback | None, rids: Iterable[str], name: str = "on_evict"
) -> int:
    """Call ``on_evict`` (or another per-rid callback, ``name`` in the log) for each rid; an
    exception is logged, never raised (docs/DESIGN.md, "Never break a request"). Returns the
    number of calls that raised."""
    if on_evict is None:
        return 0
    errors = 0
    for rid in rids:
        try:
            on_evict(rid)
        except Exception:
            errors += 1
            logger.exception("%s(%r) failed", name, rid)
    return errors
