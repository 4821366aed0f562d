"""One bounded least-recently-used mapping, used by every bounded table of the package.

docs/DESIGN.md, "Bounded": the index, the conversation store and every cache have a size limit and
drop least-recently-used entries first. :class:`LRU` is that mechanism, written once: the
context index's requests, the conversation store, the chunk cache, the popularity memory, the
LlamaIndex plan store, the capacity and TTL cache models all hold their entries in one.

Not thread-safe by itself: each owner already holds its own lock around a compound step
(look up, then update, then evict), so a second lock here would only cost time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, ItemsView, Iterable, Iterator, Sequence, ValuesView
from typing import Generic, TypeVar, overload

__all__ = ["LRU"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class LRU(Generic[K, V]):
    """A mapping bounded by entry count and, optionally, by a total weight.

    Args:
        max_entries: most entries kept (``None``: no count bound).
        max_weight: most total weight kept (``None``: no weight bound); needs ``weight``.
        weight: an entry's weight (``value -> int >= 0``), e.g. its tokens.

    Raises:
        ValueError: a bound that is not a positive int, or ``max_weight`` without ``weight``.

    :meth:`put` evicts the least recently used entries until both bounds hold again, except the
    entry just put (an entry heavier than the whole bound is kept alone). Reading with
    :meth:`get` or :meth:`touch` marks an entry used; :meth:`peek` and ``in`` do not.
    Iteration runs from the least to the most recently used.
    """

    __slots__ = ("_entries", "_total", "_weight", "max_entries", "max_weight")

    def __init__(
        self,
        max_entries: int | None = None,
        *,
        max_weight: int | None = None,
        weight: Callable[[V], int] | None = None,
    ) -> None:
        for name, bound in (("max_entries", max_entries), ("max_weight", max_weight)):
            if bound is not None and (
                isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
            ):
                raise ValueError(f"{name} must be a positive int or None, got {bound!r}")
        if max_weight is not None and weight is None:
            raise ValueError("max_weight needs a weight function")
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._weight = weight
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._total = 0

    # ------------------------------------------------------------------ reading
    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        """The value of ``key`` (marked as just used), or ``default``."""
        entries = self._entries
        if key not in entries:
            return default
        entries.move_to_end(key)
        return entries[key]

    @overload
    def peek(self, key: K) -> V | None: ...
    @overload
    def peek(self, key: K, default: D) -> V | D: ...
    def peek(self, key: K, default: object = None) -> object:
        """The value of ``key`` without marking it used, or ``default``."""
        return self._entries.get(key, default)

    def peek_many(self, keys: Iterable[K], default: D) -> list[V | D]:
        """:meth:`peek` of each of ``keys``."""
        get = self._entries.get
        return [get(key, default) for key in keys]

    def touch(self, key: K) -> bool:
        """Mark ``key`` as just used; False when it is not held."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def oldest(self) -> tuple[K, V] | None:
        """The least recently used entry, or ``None`` when empty."""
        for key, value in self._entries.items():
            return key, value
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def items(self) -> ItemsView[K, V]:
        """A view of the entries, least to most recently used (do not change the LRU while
        iterating it)."""
        return self._entries.items()

    def values(self) -> ValuesView[V]:
        """A view of the values, least to most recently used."""
        return self._entries.values()

    @property
    def total_weight(self) -> int:
        """Sum of the entries' weights (0 without a weight function)."""
        return self._total

    # ------------------------------------------------------------------ writing
    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Set ``key`` (as the most recently used) and apply the bounds.

        Returns:
            The entries evicted to make room, least recently used first (never ``key``).
        """
        entries = self._entries
        if key in entries:
            self._forget_weight(entries[key])
        entries[key] = value
        entries.move_to_end(key)
        if self._weight is not None:
            self._total += self._weight(value)
        return self._enforce()

    def put_many(self, items: Iterable[tuple[K, V]]) -> list[tuple[K, V]]:
        """:meth:`put` each item in turn, applying the bounds once at the end (the evicted
        entries never include the items put)."""
        entries, weight = self._entries, self._weight
        keys = []
        move_to_end = entries.move_to_end
        for key, value in items:
            if weight is not None:
                if key in entries:
                    self._total -= weight(entries[key])
                self._total += weight(value)
            entries[key] = value
            move_to_end(key)
            keys.append(key)
        return self._enforce_sparing(keys)

    def add_to_many(self: LRU[K, float], keys: Sequence[K], amount: float) -> list[tuple[K, float]]:
        """Add ``amount`` to the value of each of ``keys`` (distinct; one not held starts from
        0.0), marking it just used: :meth:`put_many` of the sums, in one pop and one set per
        key rather than a read, then a write, then a move (docs/DESIGN.md, "Hot path").
        Returns the entries evicted (never one of ``keys``)."""
        if self._weight is not None:
            return self.put_many([(key, self.peek(key, 0.0) + amount) for key in keys])
        entries = self._entries
        pop = entries.pop
        for key in keys:
            entries[key] = pop(key, 0.0) + amount
        return self._enforce_sparing(keys)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key``; its value, or ``default`` when it was not held."""
        if key not in self._entries:
            return default
        value = self._entries.pop(key)
        self._forget_weight(value)
        return value

    def pop_oldest(self) -> tuple[K, V]:
        """Remove and return the least recently used entry.

        Raises:
            KeyError: the mapping is empty.
        """
        if not self._entries:
            raise KeyError("pop_oldest() on an empty LRU")
        key, value = self._entries.popitem(last=False)
        self._forget_weight(value)
        return key, value

    def map_values(self, function: Callable[[V], V]) -> None:
        """Replace every value by ``function(value)``, in place: the order of use is kept
        (the weights are recomputed; no bound is applied)."""
        entries = self._entries
        for key in entries:
            entries[key] = function(entries[key])
        if self._weight is not None:
            self._total = sum(self._weight(value) for value in entries.values())

    def clear(self) -> None:
        """Remove every entry."""
        self._entries.clear()
        self._total = 0

    def reweigh(self, key: K, old_weight: int) -> list[tuple[K, V]]:
        """The value of ``key`` changed weight in place (it weighed ``old_weight``): update the
        total and apply the bounds; returns the evicted entries (never ``key``)."""
        if self._weight is None or key not in self._entries:
            return []
        self._total += self._weight(self._entries[key]) - old_weight
        return self._enforce(keep=key)

    # ------------------------------------------------------------------ internals
    def _forget_weight(self, value: V) -> None:
        if self._weight is not None:
            self._total -= self._weight(value)

    def _enforce_sparing(self, fresh: Iterable[K]) -> list[tuple[K, V]]:
        """Apply the bounds once after a batch of puts, evicting none of the ``fresh`` keys."""
        entries = self._entries
        evicted: list[tuple[K, V]] = []
        if not self._over_bounds():
            return evicted
        spared = max(len(set(fresh)), 1)
        while len(entries) > spared and self._over_bounds():
            key, value = entries.popitem(last=False)
            self._forget_weight(value)
            evicted.append((key, value))
        return evicted

    def _over_bounds(self) -> bool:
        return (self.max_entries is not None and len(self._entries) > self.max_entries) or (
            self.max_weight is not None and self._total > self.max_weight
        )

    def _enforce(self, keep: K | None = None) -> list[tuple[K, V]]:
        evicted: list[tuple[K, V]] = []
        entries = self._entries
        while len(entries) > 1 and (
            (self.max_entries is not None and len(entries) > self.max_entries)
            or (self.max_weight is not None and self._total > self.max_weight)
        ):
            key = next(iter(entries))
            if keep is not None and key == keep:
                entries.move_to_end(key)
                key = next(iter(entries))
            value = entries.pop(key)
            self._forget_weight(value)
            evicted.append((key, value))
        return evicted

    def __repr__(self) -> str:
        return (
            f"LRU({len(self._entries)} entries, max_entries={self.max_entries}, "
            f"max_weight={self.max_weight})"
        )
