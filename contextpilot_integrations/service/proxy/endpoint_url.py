"""The endpoint an http(s) base URL names, for refusing one endpoint listed twice (replicas,
peers; docs/DESIGN.md, "The proxy").

Only spellings that certainly name the same endpoint are taken as one: scheme and host in any
case, a host name's trailing ``.``, an IP address in any of its spellings (``[::1]`` and
``[0:0:0:0:0:0:0:1]``; an IPv4-mapped IPv6 address and its IPv4 address), user information
or none, the scheme's default port written out (``:80`` for http, ``:443`` for https) or not,
a trailing ``/``, a ``/v1`` suffix (the proxy adds ``/v1`` itself). A path with ``.`` or
``..`` segments (plain or percent-encoded) is refused rather than resolved: the proxy appends
its own path to the URL, and a peer or engine may answer such a path with a 404. Names are
never resolved: ``localhost`` and ``127.0.0.1`` may be one host or not (another network
namespace, a hosts file), so they stay two endpoints.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote, urlsplit

__all__ = ["same_endpoint"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def same_endpoint(url: str) -> str:
    """``url`` as the endpoint it names (module docstring): equal for two URLs exactly when
    they are spellings of one endpoint.

    Raises:
        ValueError: a port that is not a number in 0..65535, or a path with ``.`` or ``..``
            segments.
    """
    parts = urlsplit(url)
    if any(unquote(segment) in (".", "..") for segment in parts.path.split("/")):
        raise ValueError(f"the path {parts.path!r} has '.' or '..' segments")
    scheme = parts.scheme.lower()
    host = _host(parts.hostname or "")
    port = parts.port
    netloc = host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc = f"{netloc}:{port}"
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{scheme}://{netloc}{path.rstrip('/')}"


def _host(host: str) -> str:
    """A URL's lower-cased ``host`` as one spelling: an IP address in its canonical form
    (IPv6 in brackets, an IPv4-mapped IPv6 address as its IPv4 address), a name without
    its trailing ``.``."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.rstrip(".")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return f"[{address.compressed}]" if address.version == 6 else address.compressed
