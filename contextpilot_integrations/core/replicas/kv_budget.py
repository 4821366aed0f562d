"""What a replica's KV cache can still hold of the requests planned there.

A replica's engine reports an eviction only once it happened, after the requests that caused
it were served; a router that plans a window while the previous window's calls still wait
for the engine believes every one of them cached, and aligns the next window to prefixes the
calls ahead of it will have pushed out by the time it is served. With the replica's KV
capacity known (``ReplicaSpec.kv_capacity_tokens``), :class:`KvBudget` keeps the requests
planned there, least recently planned first, and gives back those that no longer fit once a
call's plan is recorded: the router drops them from that replica's index then, ahead of the
engine's own events (docs/DESIGN.md, "Replicas and routing"). Shared prefixes are counted
once: a request's blocks are a path of prefixes (its blocks in prompt order), and a prefix
held by several requests counts while any holds it. The rest of a prompt (the question, the
template) counts as the request's own (at least one token, so the budget bounds the
requests it keeps: docs/DESIGN.md, "Bounded"). Less believed reuse, never more: the budget
only drops.

Not thread-safe: the fleet's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KvBudget"]


class KvBudget:
    """The requests a replica's KV cache of ``capacity_tokens`` can hold (module docstring).

    Raises:
        ValueError: ``capacity_tokens`` is not an int > 0.
    """

    def __init__(self, capacity_tokens: int) -> None:
        if (
            isinstance(capacity_tokens, bool)
            or not isinstance(capacity_tokens, int)
            or capacity_tokens < 1
        ):
            raise ValueError(f"kv_capacity_tokens must be an int > 0, got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self.dropped = 0
        # rid -> (its prefixes' keys, its own tokens), least recently planned first
        self._requests: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._prefixes: dict[int, list[int]] = {}  # prefix key -> [last block's tokens, holders]

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, rid: object) -> bool:
        return rid in self._requests

    def add(self, rid: str, blocks: Sequence[tuple[int, int]], prompt_tokens: int) -> list[str]:
        """``rid`` was planned here with ``blocks`` (``(block id, tokens)`` in prompt order)
        in a prompt of ``prompt_tokens``; returns the requests, least recently planned first,
        that no longer fit (never ``rid`` itself), now dropped from the budget."""
        self.discard(rid)
        keys = []
        path = 0
        for block, tokens in blocks:
            path = hash((path, block))  # the prefix up to this block; ints hash alike everywhere
            keys.append(path)
            held = self._prefixes.get(path)
            if held is None:
                self._prefixes[path] = [tokens, 1]
                self.used_tokens += tokens
            else:
                held[1] += 1
        # At least one token of its own: the budget bounds how many requests it keeps too.
        own = max(1, prompt_tokens - sum(tokens for _, tokens in blocks))
        self._requests[rid] = (tuple(keys), own)
        self.used_tokens += own
        dropped = []
        while self.used_tokens > self.capacity_tokens and len(self._requests) > 1:
            oldest = next(iter(self._requests))
            self.discard(oldest)
            dropped.append(oldest)
        self.dropped += len(dropped)
        return dropped

    def discard(self, rid: str) -> bool:
        """``rid`` is no longer held (the engine evicted it, or it went elsewhere); False if
        it was not here."""
        entry = self._requests.pop(rid, None)
        if entry is None:
            return False
        keys, own = entry
        self.used_tokens -= own
        for key in keys:
            held = self._prefixes[key]
            held[1] -= 1
            if held[1] == 0:
                del self._prefixes[key]
                self.used_tokens -= held[0]
        return True
