"""The endpoint an http(s) base URL names, for refusing one endpoint listed twice (replicas,
peers; docs/DESIGN.md, "The proxy").

Only spellings that certainly name the same endpoint are taken as one: scheme and host in any
case, the scheme's default port written out (``:80`` for http, ``:443`` for https) or not, a
trailing ``/``, a ``/v1`` suffix (the proxy adds ``/v1`` itself). Names are never resolved:
``localhost`` and ``127.0.0.1`` may be one host or not (another network namespace, a hosts
file), so they stay two endpoints.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["same_endpoint"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def same_endpoint(url: str) -> str:
    """``url`` as the endpoint it names (module docstring): equal for two URLs exactly when
    they are spellings of one endpoint.

    Raises:
        ValueError: a port that is not a number in 0..65535.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    port = parts.port
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@{host}" if user else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc = f"{netloc}:{port}"
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{scheme}://{netloc}{path.rstrip('/')}"
