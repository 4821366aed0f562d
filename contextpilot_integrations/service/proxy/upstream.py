"""The proxy's HTTP client to its upstream: one pooled ``aiohttp.ClientSession``, the upstream
URL of a path, and the headers a forwarded request carries.

*Why aiohttp.* Its pool hands out an idle connection in constant time; httpcore's (under
``httpx.AsyncClient``) checks every pooled connection, a system call each, on every request
and every release, so its cost on the event loop grows with the requests in flight, which an
engine's long answers keep many of (docs/DESIGN.md, "The proxy").

Headers (docs/DESIGN.md, "The proxy"): hop-by-hop headers (the standard ones and those a
``Connection`` header names), ``host`` and ``content-length`` are dropped (the client sets its
own); the client's credentials (``authorization``, ``x-api-key``, :data:`TENANT_KEY_HEADER`) are
dropped too unless ``pass_client_key``, and the proxy's own upstream key takes their place; the
client's ``x-contextpilot-*`` headers are the proxy's and stay here. Answers lose their
hop-by-hop headers and the upstream's ``x-contextpilot-*`` ones: those names are the proxy's
report and the service's boot id, which an upstream (another ContextPilot service, or any server
that sets them) would otherwise duplicate or forge. The upstream's ``date`` and ``server`` go
too: the proxy's server (uvicorn) writes its own, and an answer should carry one of each.

The pooled client keeps no cookies: it serves every tenant, so a ``Set-Cookie`` of one answer
(passed to that client as it is) must never go out with another tenant's request; a client's
own ``cookie`` header is forwarded as sent. It follows no redirects (a ``3xx`` goes back to the
client as it is), reads answers raw (no decompression: the bytes pass as the upstream sent
them) and keeps an idle connection :data:`KEEPALIVE_S` at most.

A call holds a slot of the pool's :class:`~.connection_gate.ConnectionGate` while it runs
(:mod:`.forwarding`): the gate shares the pool's connections fairly between tenants.

The client is made on first use inside the running event loop and closed by
:meth:`Upstream.aclose` (the app's lifespan): a pool serves one loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp

from contextpilot_integrations.service.proxy.connection_gate import ConnectionGate
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig

__all__ = ["KEEPALIVE_S", "TENANT_KEY_HEADER", "Upstream", "answer_headers", "engine_root"]

TENANT_KEY_HEADER = "x-contextpilot-api-key"
"""A request header that carries the tenant key apart from the upstream's credentials."""

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_CREDENTIALS = frozenset({"authorization", "x-api-key", TENANT_KEY_HEADER})
_REQUEST_DROPPED = _HOP_BY_HOP | {"host", "content-length"}
_OWN_PREFIX = "x-contextpilot-"
_OWN_PREFIX_BYTES = _OWN_PREFIX.encode("ascii")
_HOP_BY_HOP_BYTES = frozenset(name.encode("ascii") for name in _HOP_BY_HOP)
_ANSWER_DROPPED = _HOP_BY_HOP_BYTES | {b"date", b"server"}

KEEPALIVE_S = 4.0
"""How long an idle pooled connection is kept: under uvicorn's default keep-alive of 5 s, after
which that server closes one, so the proxy seldom sends on a connection the upstream is closing
(that race is retried once: :mod:`.forwarding`)."""

_MAX_HEADER_BYTES = 65_536
"""The longest answer header line read (aiohttp's default, 8,190 bytes, would refuse an
upstream's long header that other clients accept)."""


class Upstream:
    """The upstream of one proxy.

    Args:
        config: the upstream's URL (not None), kind, credentials and limits.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._client: aiohttp.ClientSession | None = None
        base = config.upstream_url
        if base is None:  # a direct fleet: one Upstream per replica URL
            raise ValueError("an Upstream needs config.upstream_url, got None")
        self._base = engine_root(base)
        self.gate = ConnectionGate(
            config.max_connections, config.tenant_connections, config.pool_timeout_s
        )
        """The fair admission to the pool's connections."""

    @property
    def client(self) -> aiohttp.ClientSession:
        """The pooled client (made on first use, in the running event loop)."""
        if self._client is None:
            connector = aiohttp.TCPConnector(
                limit=self.config.max_connections,
                limit_per_host=0,
                keepalive_timeout=KEEPALIVE_S,
            )
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=None,  # the wait for a pooled connection: the gate's
                sock_connect=self.config.connect_timeout_s,
                sock_read=self.config.read_timeout_s,
            )
            self._client = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                max_line_size=_MAX_HEADER_BYTES,
                max_field_size=_MAX_HEADER_BYTES,
            )
        return self._client

    def url(self, path: str, query: bytes = b"") -> str:
        """The upstream URL of the proxy's ``path`` (``/v1/...``) and raw query string."""
        url = self._base + path
        return f"{url}?{query.decode('latin-1')}" if query else url

    def request_headers(
        self, given: Iterable[tuple[bytes, bytes]], *, identity: bool = False
    ) -> list[tuple[str, str]]:
        """The headers to send upstream for a client request's ``given`` raw headers.

        Args:
            given: the client's headers as the ASGI scope has them.
            identity: ask for an uncompressed answer (the proxy reads its usage).
        """
        keep_credentials = self.config.pass_client_key
        given = list(given)
        named = _connection_named(given)
        out: list[tuple[str, str]] = []
        for raw_name, raw_value in given:
            name = raw_name.decode("latin-1").lower()
            if name in _REQUEST_DROPPED or (identity and name == "accept-encoding"):
                continue
            if name.encode("latin-1") in named:  # hop-by-hop by the client's own say
                continue
            if name in _CREDENTIALS and (not keep_credentials or name == TENANT_KEY_HEADER):
                continue
            if name.startswith(_OWN_PREFIX):  # the proxy's own request headers
                continue
            out.append((name, raw_value.decode("latin-1")))
        key = self.config.api_key
        if key is not None:
            if self.config.upstream_kind == "anthropic":
                out.append(("x-api-key", key))
            else:
                out.append(("authorization", f"Bearer {key}"))
        if identity:
            out.append(("accept-encoding", "identity"))
        return out

    async def aclose(self) -> None:
        """Close the pool (the next use makes a new one)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def engine_root(base_url: str) -> str:
    """The engine's own root of an OpenAI-style ``base_url``: less a trailing ``/`` and
    ``/v1`` (the proxy appends ``/v1/...`` paths, and the engine serves ``/health`` there)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def answer_headers(given: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream answer's raw headers as the client gets them (names lower-cased;
    hop-by-hop, ``date``, ``server`` and ``x-contextpilot-*`` ones dropped: module
    docstring)."""
    given = list(given)
    named = _connection_named(given)
    out: list[tuple[bytes, bytes]] = []
    for raw_name, value in given:
        name = raw_name.lower()
        if (
            name not in _ANSWER_DROPPED
            and name not in named
            and not name.startswith(_OWN_PREFIX_BYTES)
        ):
            out.append((name, value))
    return out


def _connection_named(given: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names a ``Connection`` header lists (lower-cased): hop-by-hop for this one
    connection, so a proxy removes them before forwarding (RFC 9110, section 7.6.1)."""
    return frozenset(
        token.strip().lower()
        for raw_name, value in given
        if raw_name.lower() == b"connection"
        for token in value.split(b",")
        if token.strip()
    )
