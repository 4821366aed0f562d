"""The settings of the proxy mode (:class:`ProxyConfig`), checked when made.

The upstream is the engine or hosted API the proxy forwards to. Its credentials come from the
proxy's configuration (``api_key``), or, with ``pass_client_key``, from each client request
(its ``Authorization`` and ``x-api-key`` headers forwarded as they are). How they relate to the
service's tenant keys is in docs/DESIGN.md, "The proxy".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from contextpilot_integrations.service.proxy.fleet_config import FleetConfig
from contextpilot_integrations.service.proxy.peer_config import PeerConfig

__all__ = ["UPSTREAM_KINDS", "ProxyConfig", "UpstreamKind", "detect_kind"]

UpstreamKind = Literal["openai-compatible", "openai", "anthropic"]
UPSTREAM_KINDS: tuple[UpstreamKind, ...] = ("openai-compatible", "openai", "anthropic")

_HOSTED: dict[str, UpstreamKind] = {"api.openai.com": "openai", "api.anthropic.com": "anthropic"}


def detect_kind(url: str) -> UpstreamKind:
    """The kind of upstream ``url`` names: ``"openai"`` for api.openai.com, ``"anthropic"``
    for api.anthropic.com, else ``"openai-compatible"`` (SGLang, vLLM, a gateway)."""
    host = (urlsplit(url).hostname or "").lower()
    return _HOSTED.get(host, "openai-compatible")


@dataclass(frozen=True)
class ProxyConfig:
    """Where and how the proxy forwards.

    Attributes:
        upstream_url: the upstream's base URL, ``http(s)://host[:port][/prefix]``, with or
            without a trailing ``/v1`` (``/v1/chat/completions`` goes to
            ``<url>/v1/chat/completions``, or ``<url>/chat/completions`` when the URL ends
            in ``/v1``); with a ``"gateway"`` fleet, the gateway; ``None`` only with a
            ``"direct"`` fleet (each call goes to its replica's URL).
        kind: ``"openai-compatible"`` (SGLang, vLLM, a gateway: the engine's rid, session id
            and ``cache_salt`` fields are added to the body), ``"openai"`` (the hosted API: a
            ``prompt_cache_key`` per conversation), ``"anthropic"`` (the hosted API:
            ``cache_control`` breakpoints); ``None``: :func:`detect_kind` of the URL.
        api_key: the upstream's key, sent as ``Authorization: Bearer`` (``x-api-key`` to an
            ``"anthropic"`` upstream); ``None``: none.
        pass_client_key: forward the client's own ``Authorization`` and ``x-api-key`` headers
            instead of ``api_key``.
        connect_timeout_s: longest wait to connect to the upstream (a 502 after it).
        read_timeout_s: longest wait for the upstream's next bytes (``None``: no limit; a
            model may think for minutes before its first token).
        max_connections: connections kept to the upstream at most (a pool; one per replica
            in the ``"direct"`` mode); CLI ``--upstream-connections``.
        max_tenant_connections: the most of them one tenant's calls hold while they run
            (:class:`~.connection_gate.ConnectionGate`), so that one tenant never takes the
            last connections another tenant's call needs; ``None``: ``max_connections`` less a
            quarter of it, and less at least one where the pool has more than one (so a
            small pool still keeps a connection for the others). Applies with several
            tenants; calls of a service without tenant keys, or with one, may use the whole
            pool. CLI
            ``--upstream-tenant-connections``.
        pool_timeout_s: longest wait of a call for a free connection of the pool; past it
            the call is a 503 with ``Retry-After`` and nothing is sent. CLI
            ``--upstream-pool-timeout``.
        fleet: the engine replicas behind the proxy and the routing rule
            (:class:`~.fleet_config.FleetConfig`, or its mapping): the proxy hosts the replica
            router; ``None``: one upstream, no router.
        peers: the proxy processes that plan as one with this one
            (:class:`~.peer_config.PeerConfig`; docs/DESIGN.md, "Proxy peers"); ``None``:
            this process plans every call it gets.

    Raises:
        ValueError: a URL that is not http(s) with a host, an unknown ``kind``, an empty key,
            both ``api_key`` and ``pass_client_key``, a bound out of range, a bad fleet, or
            an upstream URL that does not fit the fleet's mode.
    """

    upstream_url: str | None
    kind: UpstreamKind | None = None
    api_key: str | None = None
    pass_client_key: bool = False
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = 600.0
    max_connections: int = 512
    max_tenant_connections: int | None = None
    pool_timeout_s: float = 10.0
    fleet: FleetConfig | None = None
    peers: PeerConfig | None = None

    def __post_init__(self) -> None:
        if self.peers is not None and not isinstance(self.peers, PeerConfig):
            raise ValueError(f"peers must be a PeerConfig or None, got {self.peers!r:.200}")
        fleet = self.fleet
        if fleet is not None and not isinstance(fleet, FleetConfig):
            fleet = FleetConfig.from_mapping(fleet)
            object.__setattr__(self, "fleet", fleet)
        if fleet is not None and fleet.direct:
            if self.upstream_url is not None:
                raise ValueError(
                    "upstream_url and a direct fleet exclude each other: each call goes to its "
                    "replica's base_url (give the fleet mode 'gateway' for a gateway at "
                    f"{self.upstream_url!r:.200})"
                )
            if self.kind not in (None, "openai-compatible"):
                raise ValueError(f"kind must be 'openai-compatible' for a fleet, got {self.kind!r}")
            object.__setattr__(self, "kind", "openai-compatible")
            self._check_bounds()
            return
        if self.upstream_url is None:
            raise ValueError(
                "upstream_url is needed (the engine, the gateway or the hosted API), got None"
            )
        parts = urlsplit(self.upstream_url) if isinstance(self.upstream_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"upstream_url must be an http(s) URL with a host, got {self.upstream_url!r:.200}"
            )
        if parts.query or parts.fragment:
            raise ValueError(
                f"upstream_url must have no query or fragment, got {self.upstream_url!r:.200}"
            )
        object.__setattr__(self, "upstream_url", self.upstream_url.rstrip("/"))
        if self.kind is None:
            object.__setattr__(self, "kind", detect_kind(self.upstream_url))
        elif self.kind not in UPSTREAM_KINDS:
            raise ValueError(f"kind must be one of {', '.join(UPSTREAM_KINDS)}, got {self.kind!r}")
        if fleet is not None and self.kind != "openai-compatible":
            raise ValueError(f"kind must be 'openai-compatible' for a fleet, got {self.kind!r}")
        self._check_bounds()

    def _check_bounds(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if self.api_key is not None and self.pass_client_key:
            raise ValueError(
                "api_key and pass_client_key exclude each other: the upstream gets either the "
                "proxy's key or the client's"
            )
        for name in ("connect_timeout_s", "read_timeout_s", "pool_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "read_timeout_s":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 and math.isfinite(value))
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise ValueError(
                f"max_connections must be a positive int, got {self.max_connections!r}"
            )
        cap = self.max_tenant_connections
        if cap is not None and (
            isinstance(cap, bool)
            or not isinstance(cap, int)
            or not 1 <= cap <= self.max_connections
        ):
            raise ValueError(
                f"max_tenant_connections must be an int from 1 to max_connections "
                f"({self.max_connections}) or None, got {cap!r}"
            )

    @property
    def tenant_connections(self) -> int:
        """``max_tenant_connections`` as set, or its default (Attributes)."""
        if self.max_tenant_connections is not None:
            return self.max_tenant_connections
        pool = self.max_connections
        return max(1, min(pool - 1, pool - pool // 4))

    @property
    def upstream_kind(self) -> UpstreamKind:
        """``kind`` as set (never ``None`` once made)."""
        assert self.kind is not None
        return self.kind

    def __repr__(self) -> str:  # never the key
        return (
            f"ProxyConfig(upstream_url={self.upstream_url!r}, kind={self.kind!r}, "
            f"api_key={'<set>' if self.api_key else None}, pass_client_key={self.pass_client_key}, "
            f"fleet={self.fleet!r}, peers={self.peers!r})"
        )
