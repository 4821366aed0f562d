"""The settings of the proxy's replica fleet (:class:`FleetConfig`), checked when made.

A proxy in front of several engine replicas hosts the replica router (docs/DESIGN.md, "The
proxy", "Replicas and routing"). The fleet is a mapping (a config file, CLI flags) such as::

    {"mode": "direct",
     "replicas": [
        {"name": "a", "base_url": "http://127.0.0.1:8001/v1",
         "cache_sync": {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5557",
                        "topic": "kv-events"}},
        {"name": "b", "base_url": "http://127.0.0.1:8002/v1",
         "cache_sync": {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5559",
                        "topic": "kv-events"}}],
     "load": "recent-tokens", "max_imbalance": 1.25, "retry_down_s": 5.0,
     "ordered": true, "max_in_flight": 4, "window_hold_ms": 10000, "target_workers": false}

``"direct"``: the proxy forwards each call to its replica's ``base_url`` (every replica needs
one). ``"gateway"``: the proxy's ``upstream_url`` is a gateway (smg) that routes on the
routing key header; the replicas are listed for their KV events (``base_url`` optional). The
routing rule is :class:`~contextpilot_integrations.core.replicas.routing_config.RouterConfig`'s;
the load defaults to its ``"recent-tokens"``. ``"in-flight-tokens"`` works too (the proxy ends
each call's load when its answer is over), but a call's load ends only after its client has
the answer, so a client that sends its next call at once can find the replica still counted
busy and, with a smaller call, not eligible (docs/DESIGN.md, "The proxy"). ``retry_down_s`` is
how long a replica that refused a connection is left out before it is tried again.
``ordered`` and ``max_in_flight`` hold the calls with documents at the proxy's door to each
replica (:mod:`.replica_order`): sent in the order their plans were handed out, each once the
previous one started its answer, and at most ``max_in_flight`` out at once per replica. Both
are off by default: an answer that is not streamed starts only when it is whole, so ordered
calls of such a client run one at a time per replica, and a cap holds calls back from an
engine that would batch them; they pay under bursts of calls that share documents behind a
gateway that spills busy keys (docs/DESIGN.md, "The proxy"). ``window_hold_ms`` (needs the
door and a planning window, ``--window-ms``; 0, the default, holds nothing) keeps a planning
window open past its length, at most this many milliseconds more, while every replica up has
calls waiting at its door: the calls it gathers would wait there anyway, and planned together
they share more. ``target_workers`` (gateway mode
only, off by default) sends each call to its replica's worker by SMG's worker-index header,
each replica's index learnt from the gateway's answers before it is used
(:mod:`.gateway_workers`).

A replica's ``kv_capacity_tokens``: ``"auto"`` (the default, the key left out): the proxy asks
the replica's engine (its ``base_url``) when it starts (:mod:`.kv_capacity`), and goes without
where the engine does not say (a replica without ``base_url`` left at the default is not
asked; one that says ``"auto"`` is refused); an int: that many tokens, at most
:data:`MAX_CAPACITY_TOKENS` as a learnt one; ``null``: not known, nothing asked
(docs/DESIGN.md, "Replicas and routing", "The proxy").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from contextpilot_integrations.core.replicas.routing_config import (
    MAX_CAPACITY_TOKENS,
    LoadKind,
    RouterConfig,
)
from contextpilot_integrations.core.window.planning_window import MAX_WINDOW_MS
from contextpilot_integrations.service.proxy.endpoint_url import same_endpoint
from contextpilot_integrations.service.proxy.replica_order import DEFAULT_MAX_IN_FLIGHT
from contextpilot_integrations.sync.configuration import CacheSyncConfig

__all__ = ["FleetConfig"]

_OWN_KEYS = frozenset(
    {"retry_down_s", "ordered", "max_in_flight", "window_hold_ms", "target_workers"}
)

AUTO = "auto"
"""A replica's ``kv_capacity_tokens`` that the proxy learns from its engine."""


@dataclass(frozen=True)
class FleetConfig:
    """The replicas behind the proxy and the routing rule.

    Attributes:
        router: the replicas, ``mode`` (``"direct"`` or ``"gateway"``), ``load``,
            ``max_imbalance``, ``load_window``, ``in_flight_timeout_s``, ``key_prefix``.
        retry_down_s: seconds a replica that refused a connection is routed around before it
            is tried again (> 0).
        ordered: send each replica's calls with documents in the order their plans were
            handed out, each once the previous one started its answer.
        max_in_flight: most calls with documents out at once per replica (>= 1); ``None``
            (default): no cap.
        window_hold_ms: the most a planning window is held open past its length while every
            replica up has calls waiting at its door (milliseconds, in [0,
            :data:`~contextpilot_integrations.core.window.planning_window.MAX_WINDOW_MS`]; 0,
            the default, holds nothing; more needs ``ordered`` or ``max_in_flight``, without
            which no call ever waits at the door).
        target_workers: behind a gateway, send each call to its replica's worker by the
            gateway's target header, each replica's worker index learnt from the gateway's
            answers first (:mod:`.gateway_workers`); off by default.
        learn_kv_capacity: the replicas whose KV capacity the proxy asks of their engine
            when it starts (their ``kv_capacity_tokens`` ``"auto"``; :mod:`.kv_capacity`).

    Raises:
        ValueError: a bad field, named (``fleet.replicas[1].base_url ...``).
    """

    router: RouterConfig
    retry_down_s: float = 5.0
    ordered: bool = False
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT
    window_hold_ms: float = 0.0
    target_workers: bool = False
    learn_kv_capacity: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.router, RouterConfig):
            raise ValueError(
                f"fleet.router must be a RouterConfig, got {type(self.router).__name__}"
            )
        retry = self.retry_down_s
        if (
            isinstance(retry, bool)
            or not isinstance(retry, (int, float))
            or not (retry > 0 and math.isfinite(retry))
        ):
            raise ValueError(f"fleet.retry_down_s must be a positive number, got {retry!r}")
        if not isinstance(self.ordered, bool):
            raise ValueError(f"fleet.ordered must be true or false, got {self.ordered!r}")
        if not isinstance(self.target_workers, bool):
            raise ValueError(
                f"fleet.target_workers must be true or false, got {self.target_workers!r}"
            )
        if self.target_workers and self.router.mode != "gateway":
            raise ValueError("fleet.target_workers needs the gateway mode (--upstream a gateway)")
        cap = self.max_in_flight
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"fleet.max_in_flight must be an int >= 1 or null, got {cap!r}")
        hold = self.window_hold_ms
        if (
            isinstance(hold, bool)
            or not isinstance(hold, (int, float))
            or not 0 <= hold <= MAX_WINDOW_MS
        ):
            raise ValueError(
                f"fleet.window_hold_ms must be a number of milliseconds in [0, "
                f"{MAX_WINDOW_MS:g}], got {hold!r:.80}"
            )
        if hold > 0 and not self.ordered and cap is None:
            raise ValueError(
                f"fleet.window_hold_ms {hold!r} holds a window while calls wait at the "
                "replicas' door, and without fleet.ordered or fleet.max_in_flight none ever "
                "waits: give one of them too"
            )
        learn = self.learn_kv_capacity
        if not isinstance(learn, (set, frozenset)):
            raise ValueError(
                f"fleet.learn_kv_capacity must be a set of replica names, got {learn!r:.80}"
            )
        names = {spec.name for spec in self.router.replicas}
        unknown_names = sorted(set(learn) - names)
        if unknown_names:
            raise ValueError(f"fleet.learn_kv_capacity names no replica: {unknown_names}")
        both = sorted(
            s.name for s in self.router.replicas if s.name in learn and s.kv_capacity_tokens
        )
        if both:
            raise ValueError(f"fleet: replica(s) {both} have kv_capacity_tokens and learn it")
        object.__setattr__(self, "learn_kv_capacity", frozenset(learn))
        # Each replica its own cache_sync object: its engine link is found by it.
        copied = tuple(
            dataclasses.replace(s, cache_sync=dict(s.cache_sync))
            if isinstance(s.cache_sync, Mapping)
            else s
            for s in self.router.replicas
        )
        object.__setattr__(self, "router", dataclasses.replace(self.router, replicas=copied))
        endpoints: dict[str, str] = {}
        urls: dict[str, str] = {}
        for i, spec in enumerate(self.router.replicas):
            where = f"fleet.replicas[{i}]"
            url = spec.base_url
            if url is not None:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(
                        f"{where}.base_url must be an http(s) URL with a host, got {url!r:.200}"
                    )
                if parts.query or parts.fragment:
                    raise ValueError(f"{where}.base_url must have no query or fragment: {url!r}")
                try:
                    endpoint = same_endpoint(url)
                except ValueError as exc:
                    raise ValueError(f"{where}.base_url {url!r:.200}: {exc}") from None
                other = urls.setdefault(endpoint, spec.name)
                if other != spec.name:
                    given = next(s.base_url for s in self.router.replicas if s.name == other)
                    raise ValueError(
                        f"{where}.base_url {url!r:.200} is also replica {other!r}'s "
                        f"({given!r:.200}): each replica is its own engine (one engine listed "
                        "twice would count its cache twice)"
                    )
            elif self.router.mode == "direct":
                raise ValueError(
                    f"{where}.base_url is needed in the direct mode (the proxy forwards there)"
                )
            if spec.cache_sync is not None:
                try:
                    sync = CacheSyncConfig.from_mapping(spec.cache_sync)
                except ValueError as exc:
                    raise ValueError(f"{where}.cache_sync: {exc}") from None
                if sync.endpoint is not None:
                    other = endpoints.setdefault(sync.endpoint, spec.name)
                    if other != spec.name:
                        raise ValueError(
                            f"{where}.cache_sync.endpoint {sync.endpoint!r} is also replica "
                            f"{other!r}'s: each replica publishes its own KV events"
                        )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> FleetConfig:
        """The module docstring's mapping, validated.

        Raises:
            ValueError: an unknown key or a bad field, named.
        """
        if not isinstance(settings, Mapping):
            raise ValueError(f"fleet must be a mapping, got {type(settings).__name__}")
        own = {k: v for k, v in settings.items() if k in _OWN_KEYS}
        rule = {k: v for k, v in settings.items() if k not in _OWN_KEYS}
        replicas = rule.get("replicas")
        learnt: list[int] = []
        if isinstance(replicas, list):
            replicas = list(replicas)
            for i, replica in enumerate(replicas):
                if not isinstance(replica, Mapping):
                    raise ValueError(
                        f"fleet.replicas[{i}] must be a mapping, got {type(replica).__name__}"
                    )
                capacity = replica.get("kv_capacity_tokens", AUTO)
                field = f"fleet.replicas[{i}].kv_capacity_tokens"
                if not _capacity_shape(capacity):
                    raise ValueError(
                        f"{field} must be an int > 0 (at most {MAX_CAPACITY_TOKENS} "
                        f'tokens), "{AUTO}" or null, got {capacity!r:.80}'
                    )
                if capacity == AUTO:
                    if replica.get("base_url") is not None:
                        learnt.append(i)
                    elif "kv_capacity_tokens" in replica:
                        raise ValueError(
                            f'{field} "{AUTO}" asks the replica\'s engine, but '
                            f"fleet.replicas[{i}] has no base_url to ask it at"
                        )
                    replicas[i] = {**replica, "kv_capacity_tokens": None}
            rule["replicas"] = replicas
        unknown = sorted(set(rule) - set(RouterConfig.__dataclass_fields__))
        if unknown:  # named with every key a fleet takes, the proxy's own ones included
            known = sorted(set(RouterConfig.__dataclass_fields__) | _OWN_KEYS)
            raise ValueError(f"fleet: unknown setting(s) {unknown}; known: {known}")
        try:
            router = RouterConfig.from_mapping(rule)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"fleet: {exc}") from None
        learn = frozenset(router.replicas[i].name for i in learnt)
        return cls(router, **own, learn_kv_capacity=learn)

    @property
    def direct(self) -> bool:
        """Whether the proxy forwards to the replicas themselves (not to a gateway)."""
        return self.router.mode == "direct"

    @property
    def load(self) -> LoadKind:
        """What counts as a replica's load."""
        return self.router.load


def _capacity_shape(capacity: Any) -> bool:
    """Whether a replica's ``kv_capacity_tokens`` is one the fleet takes: ``"auto"``,
    ``None`` or an int > 0 of at most :data:`MAX_CAPACITY_TOKENS` (a bool is no int)."""
    if capacity is None or capacity == AUTO:
        return True
    return (
        isinstance(capacity, int)
        and not isinstance(capacity, bool)
        and 0 < capacity <= MAX_CAPACITY_TOKENS
    )
