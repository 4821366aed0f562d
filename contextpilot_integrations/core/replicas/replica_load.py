"""Load per engine replica, the bounded-imbalance rule, and a batch's partition across replicas.

The router (:mod:`.routing`) sends each request to the replica whose cache holds the longest
prefix of it, but never to one that is too busy (the rule of SGLang's cache-aware router and
of SMG's ``prefix_hash`` load factor, here with the prefix found by alignment):

    a replica is *eligible* for a request of cost ``c`` while
    ``load[replica] <= max_imbalance * min(load) + c``

(the least loaded replica always is; ``c``, the request's own cost, lets an idle fleet take a
first request anywhere). Among the eligible replicas the longest aligned prefix wins, then the
least loaded, then the one routed the fewest prompt tokens so far (an idle fleet, as in-flight
loads often are between calls, still spreads new work), then the first in the router's order
(:func:`pick_replica`): deterministic.

A batch is split by the top of its prefix tree (:func:`partition_batch`): requests with the
same first block go together, each group to the replica where its members' prefixes are cached
most, warm groups first, then the larger. A batch is balanced as a whole: no replica's load
after it may exceed ``max_imbalance`` times the fleet's mean load after it by more than one
request's cost (checked member by member; the least loaded replica can always take the next
one), and a group that would break that spills its later members (in prefix order, so
neighbours stay together) to the next replica. (Checked against the least loaded replica member
by member, as single requests are, a batch planned on an idle fleet could keep no group
together.)

:class:`LoadBoard` counts the load (:data:`~.routing_config.LoadKind`): prompt tokens or
requests, routed recently or in flight. Not thread-safe: the router holds its lock around every
call.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from contextpilot_integrations.core.replicas.routing_config import LoadKind

__all__ = [
    "BatchItem",
    "LoadBoard",
    "batch_items",
    "eligible",
    "interleave",
    "partition_batch",
    "pick_replica",
]


class _Entry:
    __slots__ = ("replica", "cost", "tokens", "at")

    def __init__(self, replica: str, cost: int, tokens: int, at: float) -> None:
        self.replica = replica
        self.cost = cost
        self.tokens = tokens
        self.at = at


class LoadBoard:
    """What each replica is busy with, as the router counts it.

    Args:
        kind: ``"recent-*"``: the last ``window`` routed requests (fleet-wide) count, done or
            not: needs no completion report, and balances what a run sends; ``"in-flight-*"``:
            a routed request counts until :meth:`complete` (the router calls it when its usage
            is recorded or it is evicted) or ``timeout_s`` after it was routed, at most
            ``window`` of them. ``*-tokens``: a request weighs its prompt tokens; ``*-requests``:
            one.
        window: see ``kind`` (>= 1).
        timeout_s: see ``kind``.
        clock: seconds (tests inject one).
    """

    def __init__(
        self,
        kind: LoadKind = "recent-tokens",
        *,
        window: int = 1024,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind = kind
        self._recent = kind.startswith("recent")
        self._by_tokens = kind.endswith("tokens")
        self.window = window
        self.timeout_s = timeout_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # in routing order
        self._load: dict[str, int] = {}
        self._routed: dict[str, list[int]] = {}  # replica -> [requests, prompt tokens], all time

    def cost(self, tokens: int) -> int:
        """What a request of ``tokens`` prompt tokens weighs (its tokens, or 1)."""
        return max(1, tokens) if self._by_tokens else 1

    def loads(self, replicas: Sequence[str]) -> dict[str, int]:
        """The load of each of ``replicas`` now."""
        self._expire()
        return {name: self._load.get(name, 0) for name in replicas}

    def add(self, rid: str, replica: str, tokens: int) -> None:
        """``rid`` (``tokens`` prompt tokens) was routed to ``replica``."""
        self._remove(rid)
        entry = _Entry(replica, self.cost(tokens), tokens, self._clock())
        self._entries[rid] = entry
        self._load[replica] = self._load.get(replica, 0) + entry.cost
        routed = self._routed.setdefault(replica, [0, 0])
        routed[0] += 1
        routed[1] += tokens
        while len(self._entries) > self.window:
            self._remove(next(iter(self._entries)))

    def cancel(self, rid: str) -> None:
        """``rid`` was not sent after all (its plan failed): as if never routed."""
        entry = self._remove(rid)
        if entry is not None:
            routed = self._routed[entry.replica]
            routed[0] -= 1
            routed[1] -= entry.tokens

    def complete(self, rid: str) -> None:
        """``rid`` finished (in flight only; a recent request counts on regardless)."""
        if not self._recent:
            self._remove(rid)

    def move(self, rid: str, replica: str) -> None:
        """``rid`` went to ``replica`` instead (a gateway sent it there)."""
        entry = self._entries.get(rid)
        if entry is None or entry.replica == replica:
            return
        self._load[entry.replica] -= entry.cost
        self._load[replica] = self._load.get(replica, 0) + entry.cost
        before, after = self._routed[entry.replica], self._routed.setdefault(replica, [0, 0])
        before[0], before[1] = before[0] - 1, before[1] - entry.tokens
        after[0], after[1] = after[0] + 1, after[1] + entry.tokens
        entry.replica = replica

    def forget_replica(self, replica: str) -> None:
        """Drop what ``replica`` is counted busy with (it went down or was removed); what was
        routed there stays in :meth:`routed`."""
        for rid in [rid for rid, entry in self._entries.items() if entry.replica == replica]:
            self._remove(rid)
        self._load.pop(replica, None)

    def routed(self, replica: str) -> tuple[int, int]:
        """``(requests, prompt tokens)`` routed to ``replica`` so far."""
        requests, tokens = self._routed.get(replica, (0, 0))
        return requests, tokens

    def _remove(self, rid: str) -> _Entry | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._load[entry.replica] -= entry.cost
        return entry

    def _expire(self) -> None:
        if self._recent:
            return
        deadline = self._clock() - self.timeout_s
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if entry.at > deadline:
                break
            self._remove(rid)


def eligible(load: int, least: int, cost: int, max_imbalance: float) -> bool:
    """The bounded-imbalance rule (module docstring): may a replica at ``load`` take a request
    of ``cost`` while the least loaded replica is at ``least``?"""
    return load <= max_imbalance * least + cost


def pick_replica(
    candidates: Sequence[str],
    scores: Mapping[str, int],
    loads: Mapping[str, int],
    cost: int,
    max_imbalance: float,
    routed: Mapping[str, int] | None = None,
) -> str:
    """The eligible replica with the highest score (the request's cached prefix there, in
    tokens), then the least loaded, then the least ``routed`` (prompt tokens routed there so
    far; None: not considered), then the first of ``candidates``.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no replica to route to")
    least = min(loads[name] for name in candidates)
    best = max(
        (
            (scores.get(name, 0), -loads[name], -(routed or {}).get(name, 0), -position, name)
            for position, name in enumerate(candidates)
            if eligible(loads[name], least, cost, max_imbalance)
        ),
    )
    return best[-1]


@dataclass(frozen=True)
class BatchItem:
    """One request of a batch, as :func:`partition_batch` sees it.

    Attributes:
        group: the top of its prefix tree (its first block); equal groups go together.
        order: sorts the group's members so that those sharing more leading blocks are
            neighbours (the router uses its blocks by batch frequency).
        cost: its cost (:meth:`LoadBoard.cost`).
        scores: replica -> its prefix cached there (tokens).
    """

    group: Hashable
    order: tuple[int, ...]
    cost: int
    scores: Mapping[str, int]


def partition_batch(
    items: Sequence[BatchItem],
    candidates: Sequence[str],
    loads: Mapping[str, int],
    max_imbalance: float,
) -> list[str]:
    """The replica of each item (module docstring).

    Groups go warmest first (the most tokens cached on one replica), then the largest (cost),
    then by their first item. A group is ranked over the replicas by the tokens its members
    have cached there, then by load, then by ``candidates`` order; its members (by ``order``)
    stay on the first replica of that ranking with room for them (its load after them at most
    ``max_imbalance`` times the mean load after the whole batch, plus the largest item's
    cost), then move on to the next one with room. Loads count the batch as it is assigned.

    Returns:
        one replica name per item, in item order.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no replica to route to")
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item.group, []).append(i)
    position = {name: p for p, name in enumerate(candidates)}

    def score(members: list[int], name: str) -> int:
        return sum(items[i].scores.get(name, 0) for i in members)

    def urgency(members: list[int]) -> tuple[int, int, int]:
        warmth = max(score(members, name) for name in candidates)
        return (-warmth, -sum(items[i].cost for i in members), members[0])

    load = {name: loads[name] for name in candidates}
    total = sum(load.values()) + sum(item.cost for item in items)
    room = max_imbalance * total / len(candidates) + max((i.cost for i in items), default=0)
    out = [""] * len(items)
    for members in sorted(groups.values(), key=urgency):
        ranking = sorted(candidates, key=lambda n: (-score(members, n), load[n], position[n]))
        current: str | None = None
        for i in sorted(members, key=lambda i: (items[i].order, i)):
            cost = items[i].cost
            if current is None or load[current] + cost > room:
                # The least loaded replica is at most at the mean: it always has room.
                least = min(candidates, key=lambda n: (load[n], position[n]))
                current = next((n for n in ranking if load[n] + cost <= room), least)
            out[i] = current
            load[current] += cost
    return out


def batch_items(
    measured: Sequence[tuple[Sequence[int], Sequence[int], int]],
    prefixes: Sequence[Sequence[int]],
    scores: Sequence[Mapping[str, int]],
    cost: Callable[[int], int],
) -> list[BatchItem]:
    """The :class:`BatchItem` of each request of a batch.

    Args:
        measured: per request, its distinct block ids, their tokens and its prompt tokens.
        prefixes: per request, its longest cached prefix on any replica (block ids).
        scores: per request, replica -> tokens of that prefix there.
        cost: prompt tokens -> cost (:meth:`LoadBoard.cost`).

    A request's group is the first block of its cached prefix, else its block most frequent
    in the batch (more tokens, then the smaller id, on a tie): the first block alignment would
    give it. Its order is its blocks by batch frequency, the same way.
    """
    frequency = Counter(b for ids, _, _ in measured for b in ids)
    items = []
    for i, ((ids, tokens, prompt), prefix, score) in enumerate(zip(measured, prefixes, scores)):
        weight = dict(zip(ids, tokens))
        by_frequency = sorted(ids, key=lambda b: (-frequency[b], -weight[b], b))
        group: Hashable = prefix[0] if prefix else (by_frequency[0] if ids else ("alone", i))
        items.append(BatchItem(group, tuple(by_frequency), cost(prompt), score))
    return items


def interleave(schedules: Sequence[Sequence[int]]) -> Iterator[int]:
    """One from each schedule in turn, each in its own order (replicas serve in parallel)."""
    longest = max((len(s) for s in schedules), default=0)
    for step in range(longest):
        for schedule in schedules:
            if step < len(schedule):
                yield schedule[step]
