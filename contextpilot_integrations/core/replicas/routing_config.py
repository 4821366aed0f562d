"""The configuration of a router over several engine replicas: the replicas and the rule.

A mapping (a config file, CLI flags) such as::

    {"replicas": [
        {"name": "a", "base_url": "http://127.0.0.1:8001/v1",
         "cache_sync": {"kind": "kv-events", "endpoint": "ipc:///run/a.ipc", "topic": "kv-events"}},
        {"name": "b", "base_url": "http://127.0.0.1:8002/v1",
         "cache_sync": {"kind": "kv-events", "endpoint": "tcp://10.0.0.2:5557", "dp_size": 2}}],
     "mode": "gateway", "load": "recent-tokens", "max_imbalance": 1.25, "load_window": 1024}

is validated into :class:`RouterConfig` (:meth:`RouterConfig.from_mapping`) and taken by
:meth:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter.from_config`.
Each replica's ``cache_sync`` is the mapping the router's ``link_factory`` builds its engine
link from (``EngineLink(cache_sync)``,
:class:`~contextpilot_integrations.sync.configuration.CacheSyncConfig`): its own KV-event
endpoints (the data-parallel ranks of one engine are one replica, ``dp_size``), or a capacity
model; it is validated when the replica's engine link is built (the ``sync`` extra).

Plain Python (no framework): the core stays importable without the extras.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["MAX_CAPACITY_TOKENS", "LoadKind", "ReplicaSpec", "RouterConfig", "RoutingMode"]

RoutingMode = Literal["gateway", "direct"]
"""How a plan reaches its replica: ``"gateway"``: through a gateway that routes on the plan's
``routing_key`` (a header); ``"direct"``: the app calls the replica's ``base_url`` itself."""

LoadKind = Literal["recent-tokens", "recent-requests", "in-flight-tokens", "in-flight-requests"]
"""What counts as a replica's load (:class:`~.replica_load.LoadBoard`): the prompt tokens or the
number of requests routed there, among the last ``load_window`` routed (``recent-``) or still in
flight (``in-flight-``: until their usage is recorded or they are evicted, or
``in_flight_timeout_s``)."""

_MAX_NAME = 128

MAX_CAPACITY_TOKENS = 10**12
"""The largest KV capacity believed, given or learnt from an engine: a larger count is not an
engine's KV cache."""


@dataclass(frozen=True)
class ReplicaSpec:
    """One engine replica.

    Attributes:
        name: unique among the router's replicas (letters, digits, ``-``, ``_``, ``.``; at
            most 128 characters): how plans and statistics name it.
        base_url: its own OpenAI-compatible base URL (``http://host:port/v1``), which plans
            carry in the ``"direct"`` mode; None: not known.
        cache_sync: how its prefix cache is followed: the mapping its engine link is built from
            (``EngineLink(cache_sync)``), its own KV-event endpoints; None: its index's own LRU
            bound only.
        kv_capacity_tokens: its engine's KV cache in tokens, or None: its index then holds at
            most that many block tokens (shared prefixes once), dropping the least recently
            planned requests when a new one is planned, ahead of the engine's own evictions
            (docs/DESIGN.md, "Replicas and routing"). Without it a router that plans while
            earlier calls still wait believes them all cached.

    Raises:
        TypeError / ValueError: a bad field (the message names it).
    """

    name: str
    base_url: str | None = None
    cache_sync: Mapping[str, Any] | None = field(default=None, hash=False)
    kv_capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
            raise ValueError(
                f"replica name must be a str of 1 to {_MAX_NAME} characters, got {name!r:.80}"
            )
        if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name):
            raise ValueError(f"replica name may hold letters, digits, '-', '_', '.': {name!r}")
        if self.base_url is not None and (not isinstance(self.base_url, str) or not self.base_url):
            raise ValueError(f"replica {name!r}: base_url must be a non-empty str or None")
        if self.cache_sync is not None and not isinstance(self.cache_sync, Mapping):
            raise TypeError(f"replica {name!r}: cache_sync must be a mapping or None")
        capacity = self.kv_capacity_tokens
        if capacity is not None and (
            isinstance(capacity, bool)
            or not isinstance(capacity, int)
            or not 0 < capacity <= MAX_CAPACITY_TOKENS
        ):
            raise ValueError(
                f"replica {name!r}: kv_capacity_tokens must be an int > 0 (at most "
                f"{MAX_CAPACITY_TOKENS} tokens) or null, got {capacity!r:.80}"
            )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> ReplicaSpec:
        """``{"name": ..., "base_url": ..., "cache_sync": {...}, "kv_capacity_tokens": N}``.

        Raises:
            TypeError / ValueError: not a mapping, an unknown key, or a bad field.
        """
        if not isinstance(settings, Mapping):
            raise TypeError(f"a replica must be a mapping, got {type(settings).__name__}")
        unknown = sorted(set(settings) - {"name", "base_url", "cache_sync", "kv_capacity_tokens"})
        if unknown:
            raise ValueError(f"unknown replica setting(s) {unknown}")
        if "name" not in settings:
            raise ValueError("a replica needs 'name'")
        return cls(
            settings["name"],
            settings.get("base_url"),
            settings.get("cache_sync"),
            settings.get("kv_capacity_tokens"),
        )


@dataclass(frozen=True)
class RouterConfig:
    """The replicas and the routing rule.

    Attributes:
        replicas: at least one, names unique.
        mode: :data:`RoutingMode`.
        load: :data:`LoadKind`.
        max_imbalance: the bounded-imbalance factor (>= 1): a request is never sent to a
            replica whose load exceeds ``max_imbalance`` times the least loaded replica's by
            more than the request's own cost
            (:func:`~contextpilot_integrations.core.replicas.replica_load.pick_replica`).
        load_window: requests the load remembers (>= 1): the recent window, or the most
            tracked in flight.
        in_flight_timeout_s: how long an in-flight request counts without a report (> 0).
        key_prefix: the start of the routing keys (gateway mode); None: ``"cp-"`` and six
            random hex digits, new per router, so a gateway's pins from an earlier process
            (SMG keeps idle keys for hours) are never reused.

    Raises:
        TypeError / ValueError: a bad field (the message names it).
    """

    replicas: tuple[ReplicaSpec, ...]
    mode: RoutingMode = "gateway"
    load: LoadKind = "recent-tokens"
    max_imbalance: float = 1.25
    load_window: int = 1024
    in_flight_timeout_s: float = 120.0
    key_prefix: str | None = None

    def __post_init__(self) -> None:
        replicas = tuple(
            r if isinstance(r, ReplicaSpec) else ReplicaSpec.from_mapping(r)
            for r in _sequence("replicas", self.replicas)
        )
        object.__setattr__(self, "replicas", replicas)
        check_replicas(replicas)
        if self.mode not in get_args(RoutingMode):
            raise ValueError(f"mode must be one of {get_args(RoutingMode)}, got {self.mode!r}")
        if self.load not in get_args(LoadKind):
            raise ValueError(f"load must be one of {get_args(LoadKind)}, got {self.load!r}")
        factor = self.max_imbalance
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ValueError(f"max_imbalance must be a number >= 1, got {factor!r}")
        if not math.isfinite(factor):
            raise ValueError(f"max_imbalance must be finite, got {factor!r}")
        window = self.load_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"load_window must be an int >= 1, got {window!r}")
        timeout = self.in_flight_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"in_flight_timeout_s must be a number > 0, got {timeout!r}")
        prefix = self.key_prefix
        if prefix is not None and (not isinstance(prefix, str) or not prefix or len(prefix) > 64):
            raise ValueError(f"key_prefix must be a str of 1 to 64 characters or None: {prefix!r}")

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> RouterConfig:
        """Validate ``settings`` (the module docstring's shape).

        Raises:
            TypeError / ValueError: an unknown key, a missing ``replicas``, or a bad field.
        """
        if not isinstance(settings, Mapping):
            raise TypeError(f"router config must be a mapping, got {type(settings).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"unknown router setting(s) {unknown}; known: {sorted(known)}")
        if "replicas" not in settings:
            raise ValueError("router config needs 'replicas'")
        return cls(**dict(settings))


def check_replicas(replicas: Sequence[ReplicaSpec]) -> None:
    """Raise ValueError unless there is at least one replica and the names are unique."""
    if not replicas:
        raise ValueError("a router needs at least one replica")
    names = [r.name for r in replicas]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"replica names must be unique, repeated: {repeated}")


def _sequence(name: str, value: object) -> Sequence[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
    return value
