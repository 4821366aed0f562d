"""Recency-weighted popularity of blocks, remembered after the engine evicts them.

The online rest order (:mod:`.alignment`, ``rest_order="popularity"``) puts blocks likely to be
retrieved again early, so later requests can share a longer prefix. A block's score gains 1
each time a planned request holds it and halves every ``half_life`` planned requests, so blocks
that keep being retrieved stay ahead of blocks that were popular once. Measured in
``benchmarks/micro/bench_ordering.py``: a half-life of 30 requests beat both no memory and
unbounded counts on MultiHop-RAG and MTRAG online.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from contextpilot_integrations.core.lru import LRU

__all__ = ["CooccurrenceMemory", "PopularityMemory"]


class PopularityMemory:
    """Decayed request counts per block id.

    Args:
        capacity: blocks remembered (least recently seen dropped first); 0 remembers nothing.
        half_life: planned requests after which a score halves.

    Scores are kept in growing units (each occurrence adds ``2 ** (t / half_life)`` for its
    request number ``t``, and a read divides by the current unit), so ``add`` costs one power
    per request, not one per block; the units are rebased before they overflow. ``O(k)`` for
    ``k`` blocks; thread-safe.
    """

    _REBASE_AT = 1e150  # a unit this large is folded back into the scores

    def __init__(self, capacity: int, half_life: float = 30.0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"popularity_memory must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.half_life = half_life
        self._clock = 0
        self._base = 0  # request number at which the unit is 1
        self._unit = 1.0  # 2 ** ((clock - base) / half_life)
        self._scores: LRU[int, float] = LRU(max(capacity, 1))
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[int]) -> None:
        """One more planned request holds ``blocks`` (distinct ids, as an indexed context's)."""
        if self.capacity == 0:
            return
        with self._lock:
            self._clock += 1
            self._unit = 2.0 ** ((self._clock - self._base) / self.half_life)
            if self._unit > self._REBASE_AT:
                self._rebase()
            self._scores.add_to_many(blocks, self._unit)

    def get(self, block: int) -> float:
        """The block's decayed score (0.0 when not remembered)."""
        return self._scores.peek(block, 0.0) / self._unit

    def get_many(self, blocks: Sequence[int]) -> list[float]:
        """:meth:`get` of each of ``blocks``."""
        with self._lock:
            unit = self._unit
            return [score / unit for score in self._scores.peek_many(blocks, 0.0)]

    def _rebase(self) -> None:
        unit = self._unit
        self._scores.map_values(lambda score: score / unit)
        self._base, self._unit = self._clock, 1.0


class _BitSets(dict[int, int]):
    """Block -> bit set of the recent requests holding it; a block none holds reads 0 (and is
    not added)."""

    def __missing__(self, block: int) -> int:
        return 0


class CooccurrenceMemory:
    """Which recent requests held each block: the co-occurrence the online rest order reads.

    A later request can share a prompt prefix only with a request that holds all of that
    prefix's blocks, so the block most worth placing next is the one the most recent requests
    holding the prefix so far also held (a conditional frequency, the online counterpart of
    the frequency tree of :mod:`.clustering`). The memory keeps, for the last ``horizon``
    planned requests, each block's holders as a bit set (:attr:`held_by`): request number
    ``n`` is bit ``n % horizon``, which no other remembered request shares, so the requests
    holding a whole prefix are one ``&`` of ints and their count one ``bit_count``, where a
    set of numbers would cost a hash probe per holder (docs/DESIGN.md, "Hot path").

    Args:
        horizon: recent requests remembered (>= 0; 0 remembers nothing).

    ``add`` costs ``O(k)`` int operations of ``horizon`` bits; thread-safe.
    """

    def __init__(self, horizon: int) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
            raise ValueError(f"cooccurrence_memory must be an int >= 0, got {horizon!r}")
        self.horizon = horizon
        self._lock = threading.Lock()
        self._clock = 0
        self._requests: LRU[int, tuple[int, ...]] = LRU(max(horizon, 1))
        self._masks = _BitSets()
        self._every_bit = (1 << horizon) - 1
        # The recent requests holding a block as a bit set (0: none; the class docstring says
        # which bit is which request): what :func:`.alignment.align` intersects. The map's own
        # look-up, so reading every block of a request runs no Python step per block
        # (docs/DESIGN.md, "Hot path").
        self.held_by: Callable[[int], int] = self._masks.__getitem__

    def add(self, blocks: Sequence[int]) -> None:
        """One more planned request holds ``blocks``."""
        if self.horizon == 0:
            return
        with self._lock:
            self._clock += 1
            number = self._clock
            held = tuple(blocks)
            masks = self._masks
            # The request leaving the horizon held the bit the new one takes: clear it first.
            for old, old_blocks in self._requests.put(number, held):
                keep = self._every_bit ^ (1 << (old % self.horizon))
                for block in old_blocks:
                    mask = masks.get(block)
                    if mask is not None:
                        mask &= keep
                        if mask:
                            masks[block] = mask
                        else:
                            del masks[block]
            bit = 1 << (number % self.horizon)
            for block in held:
                masks[block] = masks.get(block, 0) | bit

    def __len__(self) -> int:
        """Recent requests remembered."""
        return len(self._requests)

    def future_reuse(
        self, blocks: Sequence[int], tokens: Sequence[int], lifetime: int, depth: int
    ) -> float:
        """Tokens a prompt starting with ``blocks`` can expect later requests to reuse: for each
        leading prefix, its tokens times the chance that one of the next ``lifetime`` requests
        holds it all (each recent request held it with the frequency seen here)."""
        remembered = len(self._requests)
        if remembered == 0 or lifetime <= 0:
            return 0.0
        masks = self._masks
        together = -1  # every bit: the holders of the empty prefix
        value = 0.0
        for block, count in zip(blocks[:depth], tokens[:depth]):
            together &= masks.get(block, 0)
            if not together:
                break
            frequency = together.bit_count() / remembered
            value += count * (1.0 - (1.0 - frequency) ** lifetime)
        return value

    def holders(self, block: int) -> frozenset[int]:
        """The numbers (1 for the first request added) of the recent requests holding
        ``block``."""
        with self._lock:
            mask, clock, horizon = self._masks.get(block, 0), self._clock, self.horizon
        numbers = []
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            numbers.append(clock - (clock - slot) % horizon)
            mask ^= low
        return frozenset(numbers)
