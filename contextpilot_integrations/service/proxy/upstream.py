"""The proxy's HTTP client to its upstream: one pooled ``httpx.AsyncClient``, the upstream URL
of a path, and the headers a forwarded request carries.

Headers (docs/DESIGN.md, "The proxy"): hop-by-hop headers, ``host`` and ``content-length`` are
dropped (httpx sets its own); the client's credentials (``authorization``, ``x-api-key``,
:data:`TENANT_KEY_HEADER`) are dropped too unless ``pass_client_key``, and the proxy's own
upstream key takes their place; the client's ``x-contextpilot-*`` headers are the proxy's and
stay here. Answers lose their hop-by-hop headers and the upstream's ``x-contextpilot-*`` ones:
those names are the proxy's report and the service's boot id, which an upstream (another
ContextPilot service, or any server that sets them) would otherwise duplicate or forge.

The pooled client keeps no cookies: it serves every tenant, so a ``Set-Cookie`` of one answer
(passed to that client as it is) must never go out with another tenant's request; a client's
own ``cookie`` header is forwarded as sent.

The client is made on first use inside the running event loop and closed by
:meth:`Upstream.aclose` (the app's lifespan): a pool serves one loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig

__all__ = ["TENANT_KEY_HEADER", "Upstream", "answer_headers"]

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


class Upstream:
    """The upstream of one proxy.

    Args:
        config: the upstream's URL (not None), kind, credentials and limits.
        transport: an httpx transport to use instead of the network (tests of the client).
    """

    def __init__(
        self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        base = config.upstream_url
        if base is None:  # a direct fleet: one Upstream per replica URL
            raise ValueError("an Upstream needs config.upstream_url, got None")
        self._base = base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def client(self) -> httpx.AsyncClient:
        """The pooled client (made on first use, in the running event loop)."""
        if self._client is None:
            limits = httpx.Limits(
                max_connections=self.config.max_connections,
                max_keepalive_connections=self.config.max_connections,
            )
            timeout = httpx.Timeout(
                connect=self.config.connect_timeout_s,
                read=self.config.read_timeout_s,
                write=self.config.read_timeout_s,
                pool=None,
            )
            self._client = httpx.AsyncClient(
                limits=limits,
                timeout=timeout,
                transport=self._transport,
                follow_redirects=False,
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
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
        out: list[tuple[str, str]] = []
        for raw_name, raw_value in given:
            name = raw_name.decode("latin-1").lower()
            if name in _REQUEST_DROPPED or (identity and name == "accept-encoding"):
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
            await client.aclose()


def answer_headers(given: Mapping[str, str] | httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The upstream answer's headers as the client gets them (hop-by-hop and
    ``x-contextpilot-*`` ones dropped: module docstring)."""
    items = given.multi_items() if isinstance(given, httpx.Headers) else given.items()
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in items
        if name.lower() not in _HOP_BY_HOP and not name.lower().startswith(_OWN_PREFIX)
    ]
