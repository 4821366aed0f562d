"""Models of a gateway's routing policies, for the embedded multi-replica benchmark.

A gateway in front of ``N`` engine replicas picks a replica per request from the prompt as it is
given. These are models of the Shepherd Model Gateway's policies (PyPI ``smg``; source
``lightseekorg/smg``, read at commit ``73da68c``: ``model_gateway/src/policies/round_robin.rs``,
``cache_aware.rs``, ``prefix_hash.rs``, ``worker/hash_ring.rs``, ``crates/kv_index/src/
string_tree.rs``; the defaults of ``smg launch`` from ``bindings/python/src/smg/router_args.py``
and ``docs/concepts/routing/cache-aware.md``; docs/DESIGN.md, "The smg gateway"). Each policy
sees the request's text and the replicas' loads (:class:`InFlight`) and returns a replica index
in ``range(N)``: :class:`RoundRobin` (request ``i`` to replica ``i mod N``), :class:`CacheAware`
(SMG's ``cache_aware`` over HTTP, its approximate string tree) and :class:`PrefixHash` (SMG's
``prefix_hash``, a consistent-hash ring on the prompt's head); each class's docstring gives the
rule it follows.

Load (:class:`InFlight`): SMG counts a replica's requests in flight. A replay sends requests one
after another, so the model keeps the last ``concurrency`` routed requests in flight (a closed
loop of that many clients whose requests finish in the order they were sent).

Not thread-safe: one benchmark run drives one policy.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GATEWAY_POLICIES",
    "CacheAware",
    "GatewayPolicy",
    "GatewayRequest",
    "InFlight",
    "PrefixHash",
    "RoundRobin",
    "new_policy",
]

GATEWAY_POLICIES = ("round_robin", "cache_aware", "prefix_hash")
"""The modelled SMG policies, by their ``--policy`` names."""

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
PREFIX_TOKENS = 256
LOAD_FACTOR = 1.25
VIRTUAL_NODES = 150


@dataclass(frozen=True)
class GatewayRequest:
    """What a gateway sees of one request.

    Attributes:
        text: the prompt as sent (``"".join(segments)``), what ``cache_aware`` matches on.
        head: the prompt's first :data:`PREFIX_TOKENS` tokens (their text, or their token ids
            as a tuple with a tokenizer), what ``prefix_hash`` hashes.
    """

    text: str
    head: str | tuple[int, ...]


class InFlight:
    """The replicas' loads as a gateway counts them: requests in flight.

    Args:
        replicas: how many (>= 1).
        concurrency: the most requests in flight (>= 1); routing one more completes the oldest.
    """

    def __init__(self, replicas: int, concurrency: int) -> None:
        if replicas < 1 or concurrency < 1:
            raise ValueError(f"replicas and concurrency must be >= 1: {replicas}, {concurrency}")
        self.loads = [0] * replicas
        self._flying: deque[int] = deque()
        self._concurrency = concurrency

    def routed(self, replica: int) -> None:
        """A request went to ``replica``; the oldest one in flight completes if there are too
        many."""
        self._flying.append(replica)
        self.loads[replica] += 1
        if len(self._flying) > self._concurrency:
            self.loads[self._flying.popleft()] -= 1


class GatewayPolicy:
    """A routing policy: :meth:`route` one request given the loads."""

    name = ""

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas

    def route(self, request: GatewayRequest, loads: Sequence[int]) -> int:
        """The replica index for ``request`` (mutates the policy's state)."""
        raise NotImplementedError


class RoundRobin(GatewayPolicy):
    """Request ``i`` to replica ``i mod N``."""

    name = "round_robin"

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = 0

    def route(self, request: GatewayRequest, loads: Sequence[int]) -> int:
        replica, self._next = self._next, (self._next + 1) % self.replicas
        return replica


class _Node:
    __slots__ = ("children", "owner", "tenants", "text")

    def __init__(self, text: str, tenants: dict[int, None], owner: int | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.tenants = tenants  # replicas this node was routed to, in the order they came
        self.owner = owner  # SMG's cached "last_tenant": the first one, while it holds it


class CacheAware(GatewayPolicy):
    """SMG's ``cache_aware`` policy over HTTP: its *approximate string tree*, no KV events.

    One radix tree over the characters of every prompt it routed, each node tagged with the
    replicas ("tenants") it was routed to. Per request: when the fleet is *imbalanced*, that is
    ``max_load - min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold *
    min_load``, it goes to the least loaded replica; otherwise the tree gives the longest prefix
    of the prompt routed before (matched characters / prompt characters = the match rate) and
    its owner (the replica the deepest matched node was first routed to, while it still holds
    it), and the request goes to that owner when the match rate exceeds ``cache_threshold``,
    else to the least loaded replica. Ties of load go to the replica that was sent fewer
    requests, then the first. The prompt is then inserted for the chosen replica.

    Defaults as ``smg launch``: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
    ``balance_rel_threshold`` 1.5 (the Rust ``CacheAwareConfig::default`` has 0.5, 32 and 1.1,
    but the launcher's own defaults are the ones a user gets). SMG trims the tree to
    ``max_tree_size`` (2**26 characters per replica) every 60 s; the workloads here are far
    smaller, so nothing is trimmed (not modelled). SMG touches a node's access time on one match
    in eight (for its LRU trim only, which does not run here).

    Args:
        replicas: how many.
        cache_threshold: the match rate a request must exceed to follow its prefix.
        balance_abs_threshold, balance_rel_threshold: the imbalance rule.
    """

    name = "cache_aware"

    def __init__(
        self,
        replicas: int,
        *,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        super().__init__(replicas)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._root = _Node("", dict.fromkeys(range(replicas)), None)
        self._processed = [0] * replicas
        self.pinned = 0  # requests that followed their prefix
        self.balanced = 0  # requests sent to the least loaded replica by the imbalance rule

    def route(self, request: GatewayRequest, loads: Sequence[int]) -> int:
        least = min(range(self.replicas), key=lambda r: (loads[r], self._processed[r], r))
        text = request.text
        if self._imbalanced(loads):
            replica = least
            self.balanced += 1
        else:
            matched, owner = self.match(text)
            rate = matched / len(text) if text else 0.0
            if rate > self.cache_threshold and owner is not None:
                replica = owner
                self.pinned += 1
            else:
                replica = least
        self._insert(text, replica)
        self._processed[replica] += 1
        return replica

    def match(self, text: str) -> tuple[int, int | None]:
        """``(matched characters, owner)``: the longest routed prefix of ``text`` and the
        replica owning the node where it ends (None when nothing matched). Does not mutate."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            shared = _shared_prefix(child.text, text, pos)
            pos += shared
            node = child
            if shared < len(child.text):
                break
        if node is self._root:
            return 0, None
        return pos, _owner(node)

    def _imbalanced(self, loads: Sequence[int]) -> bool:
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def _insert(self, text: str, replica: int) -> None:
        """Add ``text`` to the tree for ``replica``: every node on its path is tagged with it;
        a node the path leaves midway is split (both halves keep its tags and owner)."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], {replica: None}, replica)
                return
            shared = _shared_prefix(child.text, text, pos)
            if shared < len(child.text):
                upper = _Node(child.text[:shared], dict(child.tenants), child.owner)
                child.text = child.text[shared:]
                upper.children[child.text[0]] = child
                node.children[text[pos]] = upper
                child = upper
            child.tenants.setdefault(replica, None)
            node, pos = child, pos + shared


def _owner(node: _Node) -> int | None:
    if node.owner is not None and node.owner in node.tenants:
        return node.owner
    return next(iter(node.tenants), None)


def _shared_prefix(key: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``key`` and ``text[pos:]`` (slice compares, in C)."""
    n = min(len(key), len(text) - pos)
    if key[:n] == text[pos : pos + n]:
        return n
    low, high = 0, n  # key[:low] matches, key[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        if key[low:mid] == text[pos + low : pos + mid]:
            low = mid
        else:
            high = mid
    return low


def _position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class PrefixHash(GatewayPolicy):
    """SMG's ``prefix_hash`` policy: a consistent-hash ring on the prompt's head, with a
    bounded load.

    The hash of the first ``prefix_tokens`` (256) tokens of the prompt is looked up on a
    consistent-hash ring (150 virtual nodes per replica); that replica is taken while its load
    is at most ``load_factor`` (1.25) times ``(total load + 1) / N`` (an idle fleet always
    passes), else the least loaded replica within that bound. SMG hashes token ids with xxh3
    and places ring nodes with blake3; here both are blake2b (of the head's text, or of its
    token ids with a tokenizer): the same rule with other hash values.

    Args:
        replicas: how many.
        load_factor: a replica takes a request while its load is at most this times the mean.
    """

    name = "prefix_hash"

    def __init__(self, replicas: int, *, load_factor: float = LOAD_FACTOR) -> None:
        super().__init__(replicas)
        self.load_factor = load_factor
        ring = sorted(
            (_position(f"replica-{r}#{v}".encode()), r)
            for r in range(replicas)
            for v in range(VIRTUAL_NODES)
        )
        self._positions = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def ring_replica(self, head: str | tuple[int, ...]) -> int:
        """The replica the ring gives ``head`` (no load rule)."""
        data = head.encode() if isinstance(head, str) else struct.pack(f"<{len(head)}I", *head)
        key = f"{_position(data):016x}".encode()  # SMG hashes the hex form of the head's hash
        at = bisect_left(self._positions, _position(key))
        return self._owners[at % len(self._owners)]

    def route(self, request: GatewayRequest, loads: Sequence[int]) -> int:
        replica = self.ring_replica(request.head)
        total = sum(loads)
        if total == 0:
            return replica
        bound = self.load_factor * (total + 1) / self.replicas
        if loads[replica] <= bound:
            return replica
        fits = [r for r in range(self.replicas) if loads[r] <= bound]
        return min(fits, key=lambda r: (loads[r], r)) if fits else replica


def new_policy(name: str, replicas: int) -> GatewayPolicy:
    """The policy called ``name`` (:data:`GATEWAY_POLICIES`) with SMG's defaults.

    Raises:
        ValueError: an unknown name.
    """
    if name == "round_robin":
        return RoundRobin(replicas)
    if name == "cache_aware":
        return CacheAware(replicas)
    if name == "prefix_hash":
        return PrefixHash(replicas)
    raise ValueError(f"unknown gateway policy {name!r}; choose from {list(GATEWAY_POLICIES)}")
