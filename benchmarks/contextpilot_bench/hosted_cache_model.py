"""Models of the hosted APIs' prompt caches, driven in virtual time: what a request reads,
writes and pays for.

Both models see a prompt as its content blocks in order, each ``(unit id, tokens)``; a cached
prefix is named by a chained hash of the units up to a block boundary, so two prompts share a
cache entry only when they are block for block identical up to it. Time is the caller's (the
benchmark's arrival times, in seconds); nothing sleeps.

:class:`AnthropicCacheModel` (Anthropic's "Prompt caching" docs, see
:mod:`contextpilot_integrations.llm_call.hosted_cache`): an entry is written only at an explicit
breakpoint whose prefix holds at least the minimum cacheable length; a request reads the
longest live entry at a block boundary up to :data:`~.hosted_cache.ANTHROPIC_LOOKBACK_BLOCKS`
blocks before one of its breakpoints, and writes every later breakpoint's prefix; billing:
``cache_read_input_tokens`` (the read prefix), ``cache_creation_input_tokens`` (from there to the
last breakpoint), ``input_tokens`` (the rest). An entry lives ``ttl_s`` from its last write or
read. More than :data:`~.hosted_cache.ANTHROPIC_MAX_BREAKPOINTS` breakpoints is refused (HTTP 400
there): :class:`TooManyBreakpoints`.

:class:`OpenAICacheModel` (OpenAI's "Prompt caching" guide): every prompt of at least 1,024
tokens is cached whole, at every block boundary; a hit is the longest live cached prefix on the
machine the request is routed to, rounded down to 1,024 + a multiple of 128 tokens. Routing:
a hash of the first ~256 tokens' blocks and the ``prompt_cache_key``; a route that received
``overflow_per_minute`` requests in the last minute sends the next ones to further machines
(the guide: "approximately 15 requests per minute"). Writes are not reported (``None``).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    ANTHROPIC_LOOKBACK_BLOCKS,
    ANTHROPIC_MAX_BREAKPOINTS,
)
from contextpilot_integrations.llm_call.openai_cache_key import OPENAI_CACHE_STEP_TOKENS
from contextpilot_integrations.llm_call.provider_minimums import OPENAI_MIN_CACHED_TOKENS

__all__ = [
    "AnthropicCacheModel",
    "HostedUsage",
    "OpenAICacheModel",
    "TooManyBreakpoints",
    "prefix_hashes",
]

Unit = tuple[int, int]
"""A content block: ``(unit id, tokens)``."""


class TooManyBreakpoints(ValueError):
    """A request carried more breakpoints than Anthropic accepts (the API answers 400)."""


@dataclass(frozen=True, slots=True)
class HostedUsage:
    """What a request was billed for, in tokens.

    Attributes:
        prompt_tokens: the whole prompt.
        cache_read_tokens: served from the cache.
        cache_write_tokens: written to the cache (``None``: the provider does not report it).
        input_tokens: the rest, at the base price.
    """

    prompt_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int | None
    input_tokens: int

    def response(self) -> dict[str, object]:
        """The provider's own usage form (what ``engine_fields.read_usage`` parses)."""
        if self.cache_write_tokens is None:
            return {
                "usage": {
                    "prompt_tokens": self.prompt_tokens,
                    "prompt_tokens_details": {"cached_tokens": self.cache_read_tokens},
                }
            }
        return {
            "usage": {
                "input_tokens": self.input_tokens,
                "cache_read_input_tokens": self.cache_read_tokens,
                "cache_creation_input_tokens": self.cache_write_tokens,
            }
        }


def prefix_hashes(units: Sequence[Unit], salt: str = "") -> list[bytes]:
    """``hashes[i]``: a 128-bit name of the prompt's blocks ``0..i`` (chained, so equal names
    mean equal block sequences)."""
    out: list[bytes] = []
    state = hashlib.blake2b(salt.encode("utf-8"), digest_size=16).digest()
    for unit, tokens in units:
        state = hashlib.blake2b(
            state + unit.to_bytes(8, "big") + tokens.to_bytes(4, "big"), digest_size=16
        ).digest()
        out.append(state)
    return out


class _Entries:
    """Cached prefixes and when each expires (lazily dropped)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[bytes, float] = {}

    def live(self, name: bytes, now: float) -> bool:
        expiry = self._expiry.get(name)
        if expiry is None:
            return False
        if expiry <= now:
            del self._expiry[name]
            return False
        return True

    def put(self, name: bytes, now: float) -> None:
        self._expiry[name] = now + self.ttl_s

    def __len__(self) -> int:
        return len(self._expiry)


class AnthropicCacheModel:
    """Anthropic's prompt cache (see the module docstring).

    Args:
        ttl_s: an entry's lifetime after its last write or read (300 for ``"5m"``).
        min_tokens: the model's minimum cacheable prefix.
        lookback_blocks: block boundaries searched before each breakpoint.
    """

    def __init__(
        self, ttl_s: float, min_tokens: int, *, lookback_blocks: int = ANTHROPIC_LOOKBACK_BLOCKS
    ) -> None:
        self.min_tokens = min_tokens
        self.lookback_blocks = lookback_blocks
        self._entries = _Entries(ttl_s)

    def serve(self, now: float, units: Sequence[Unit], breakpoints: Sequence[int]) -> HostedUsage:
        """One request at time ``now``: blocks ``units``, breakpoints after the blocks at the
        given indices.

        Raises:
            TooManyBreakpoints: more than :data:`ANTHROPIC_MAX_BREAKPOINTS`.
        """
        if len(breakpoints) > ANTHROPIC_MAX_BREAKPOINTS:
            raise TooManyBreakpoints(
                f"{len(breakpoints)} cache_control breakpoints, at most {ANTHROPIC_MAX_BREAKPOINTS}"
            )
        names = prefix_hashes(units)
        cumulative = _cumulative(units)
        total = cumulative[-1] if cumulative else 0
        valid = sorted(b for b in set(breakpoints) if cumulative[b] >= self.min_tokens)
        read_at = -1
        for b in valid:
            for j in range(b, max(-1, b - self.lookback_blocks - 1), -1):
                if j > read_at and self._entries.live(names[j], now):
                    read_at = j
                    break
        read = cumulative[read_at] if read_at >= 0 else 0
        if read_at >= 0:
            self._entries.put(names[read_at], now)  # a read refreshes the lifetime
        written = 0
        for b in valid:
            if b > read_at:
                self._entries.put(names[b], now)
        if valid and valid[-1] > read_at:
            written = cumulative[valid[-1]] - read
        return HostedUsage(total, read, written, total - read - written)

    @property
    def entries(self) -> int:
        """Entries held (expired ones not yet dropped included)."""
        return len(self._entries)


class OpenAICacheModel:
    """OpenAI's automatic prompt cache (see the module docstring).

    Args:
        ttl_s: a cached prefix's lifetime after its last use (in-memory retention: 5-10 min).
        min_tokens: prompts shorter than this are not cached.
        step_tokens: hits are counted in these steps past ``min_tokens``.
        head_tokens: the routing hash covers the blocks that start within these first tokens.
        overflow_per_minute: requests a route takes per minute before the next overflow to
            another machine.
    """

    def __init__(
        self,
        ttl_s: float = 300.0,
        *,
        min_tokens: int = OPENAI_MIN_CACHED_TOKENS,
        step_tokens: int = OPENAI_CACHE_STEP_TOKENS,
        head_tokens: int = 256,
        overflow_per_minute: int = 15,
    ) -> None:
        self.min_tokens = min_tokens
        self.step_tokens = step_tokens
        self.head_tokens = head_tokens
        self.overflow_per_minute = overflow_per_minute
        self._entries = _Entries(ttl_s)
        self._recent: dict[bytes, deque[float]] = {}
        self.machines_used: set[bytes] = set()

    def serve(self, now: float, units: Sequence[Unit], cache_key: str | None) -> HostedUsage:
        """One request at time ``now`` with ``prompt_cache_key`` ``cache_key`` (or none)."""
        cumulative = _cumulative(units)
        total = cumulative[-1] if cumulative else 0
        machine = self._route(now, units, cumulative, cache_key)
        names = prefix_hashes(units, salt=machine.hex())
        hit = 0
        for j in range(len(units) - 1, -1, -1):
            if self._entries.live(names[j], now):
                hit = cumulative[j]
                break
        cached = 0
        if hit >= self.min_tokens:
            cached = hit - (hit - self.min_tokens) % self.step_tokens
        if total >= self.min_tokens:
            for j, name in enumerate(names):
                if cumulative[j] >= self.min_tokens:
                    self._entries.put(name, now)
        return HostedUsage(total, cached, None, total - cached)

    def _route(
        self, now: float, units: Sequence[Unit], cumulative: Sequence[int], key: str | None
    ) -> bytes:
        start = 0
        head: list[int] = []
        for (unit, _), end in zip(units, cumulative):
            if start >= self.head_tokens:
                break
            head.append(unit)
            start = end
        digest = hashlib.blake2b((key or "").encode("utf-8") + b"\x00", digest_size=16)
        for unit in head:
            digest.update(unit.to_bytes(8, "big"))
        route = digest.digest()
        recent = self._recent.setdefault(route, deque())
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        overflow = len(recent) // self.overflow_per_minute
        recent.append(now)
        machine = hashlib.blake2b(route + overflow.to_bytes(4, "big"), digest_size=16).digest()
        self.machines_used.add(machine)
        return machine


def _cumulative(units: Sequence[Unit]) -> list[int]:
    out: list[int] = []
    total = 0
    for _, tokens in units:
        total += tokens
        out.append(total)
    return out
