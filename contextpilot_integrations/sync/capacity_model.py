"""A capacity model of an engine's prefix cache, for engines that publish no KV-cache events.

The engine is modelled as a prefix cache of ``capacity_tokens`` tokens holding the prompts of
the most recently used requests. A request's prompt is its sequence of context blocks
(``(block_id, tokens)`` in prompt order); prompts that start with the same blocks share those
blocks' tokens, as in a radix cache (SGLang ``RadixCache``, vLLM prefix caching), so a shared
prefix is counted once. When the tokens held exceed the budget, the least recently used
request is evicted (``on_evict(rid)``) and the blocks no other held request uses are freed,
which is what a radix cache's leaf-first LRU does at block granularity.

The model never sees the engine: it is a stand-in, right only as far as the budget matches the
engine's real KV capacity for this workload (docs/DESIGN.md, "Bounded": bounded, LRU without
engine feedback).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.sync.cache_state_source import (
    EvictCallback,
    SentRequest,
    notify_evicted,
)

logger = logging.getLogger(__name__)


class CapacityModel:
    """Token-budget LRU over requests with shared block prefixes counted once.

    Args:
        capacity_tokens: the cache's size in tokens (e.g. the engine's KV pool size minus what
            running requests need).
        on_evict: called with each evicted rid, e.g. ``ContextIndex.evict``; exceptions are
            logged and counted.

    Raises:
        ValueError: ``capacity_tokens`` is not positive.
    """

    def __init__(self, capacity_tokens: int, on_evict: EvictCallback | None = None) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self._on_evict = on_evict
        self._lock = threading.Lock()
        # (parent node id or -1, block id) -> node id; node id -> [tokens, references].
        self._node_ids: dict[tuple[int, int], int] = {}
        self._nodes: dict[int, list[int]] = {}
        self._node_keys: dict[int, tuple[int, int]] = {}
        self._next_node = 0
        # rid -> its path of node ids, least recently used first. No bound of the LRU's own: the
        # budget counts shared nodes once, which no per-entry weight can express.
        self._paths: LRU[str, list[int]] = LRU()
        self._used_tokens = 0
        self._counters = {"recorded": 0, "evicted": 0, "evict_callback_errors": 0}

    def record(self, request: SentRequest) -> list[str]:
        """The request went to the engine: hold its prompt blocks as most recently used, then
        evict least recently used requests while over budget (a request larger than the
        whole budget is evicted too: the engine cannot hold it either).

        Returns:
            the rids evicted, oldest first.
        """
        evicted: list[str] = []
        with self._lock:
            self._counters["recorded"] += 1
            previous = self._paths.pop(request.rid)
            if previous is not None:
                self._release(previous)
            self._paths.put(request.rid, self._acquire(request.blocks))
            while self._used_tokens > self.capacity_tokens and self._paths:
                rid, path = self._paths.pop_oldest()
                self._release(path)
                evicted.append(rid)
            self._counters["evicted"] += len(evicted)
        self._notify(evicted)
        return evicted

    def touch(self, rid: str) -> bool:
        """Mark ``rid`` as just used (a cache hit); False if it is not held."""
        with self._lock:
            return self._paths.touch(rid)

    def forget(self, rid: str) -> bool:
        """Release ``rid`` without calling ``on_evict``; False if it is not held."""
        with self._lock:
            path = self._paths.pop(rid, None)
            if path is None:
                return False
            self._release(path)
            return True

    def held_requests(self) -> list[str]:
        """The rids held, least recently used first."""
        with self._lock:
            return list(self._paths)

    def start(self) -> None:
        """Nothing runs in the background; present for the ``CacheStateSource`` protocol."""

    def stop(self) -> None:
        """See :meth:`start`."""

    def stats(self) -> dict[str, int]:
        """``used_tokens``, ``capacity_tokens``, ``requests``, ``recorded``, ``evicted``."""
        with self._lock:
            return {
                **self._counters,
                "used_tokens": self._used_tokens,
                "capacity_tokens": self.capacity_tokens,
                "requests": len(self._paths),
            }

    def _acquire(self, blocks: Sequence[tuple[int, int]]) -> list[int]:
        path: list[int] = []
        parent = -1
        for block_id, tokens in blocks:
            key = (parent, block_id)
            node = self._node_ids.get(key)
            if node is None:
                node = self._next_node
                self._next_node += 1
                self._node_ids[key] = node
                self._node_keys[node] = key
                self._nodes[node] = [tokens, 0]
                self._used_tokens += tokens
            self._nodes[node][1] += 1
            path.append(node)
            parent = node
        return path

    def _release(self, path: list[int]) -> None:
        for node in path:
            entry = self._nodes[node]
            entry[1] -= 1
            if entry[1] == 0:
                self._used_tokens -= entry[0]
                del self._nodes[node]
                del self._node_ids[self._node_keys.pop(node)]

    def _notify(self, evicted: list[str]) -> None:
        errors = notify_evicted(self._on_evict, evicted)
        if errors:
            with self._lock:
                self._counters["evict_callback_errors"] += errors
