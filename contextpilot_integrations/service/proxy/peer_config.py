"""The settings of a group of proxy processes that plan as one (:class:`PeerConfig`), checked
when made (docs/DESIGN.md, "Proxy peers").

Every process of the group is given the same list of peer URLs (its own included, in any
order: the owner rule does not read the order) and which of them it is; they share the tenant
keys and a peer secret (:data:`PEER_SECRET_ENV`), which marks a call one peer forwards to
another. CLI: ``--peer URL`` once per process, ``--peer-self URL``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from contextpilot_integrations.service.proxy.endpoint_url import same_endpoint

__all__ = ["MIN_SECRET_CHARS", "PEER_SECRET_ENV", "PeerConfig"]

PEER_SECRET_ENV = "CONTEXTPILOT_PEER_SECRET"
"""The environment variable that holds the peers' shared secret."""

MIN_SECRET_CHARS = 16
"""The shortest peer secret accepted."""


@dataclass(frozen=True)
class PeerConfig:
    """The proxy processes of one group and which one this is.

    Attributes:
        urls: each process's base URL as its peers reach it (``http(s)://host:port``, no
            query), at least two, no two spellings of one endpoint
            (:func:`~.endpoint_url.same_endpoint`); the same list on every process.
        own: this process's URL, one of ``urls`` (any spelling of it; kept as listed).
        secret: the shared secret that marks a forwarded call (printable ASCII, at least
            :data:`MIN_SECRET_CHARS` characters; never in ``repr``).
        connect_timeout_s: longest wait to connect to a peer before the call is handled by
            the next in the owner order (> 0).
        retry_down_s: seconds a peer that could not be reached is passed over before it is
            tried again (> 0).

    Raises:
        ValueError: a bad field, named.
    """

    urls: tuple[str, ...]
    own: str
    secret: str
    connect_timeout_s: float = 1.0
    retry_down_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.urls, str) or not isinstance(self.urls, Sequence):
            raise ValueError(f"peers must be a list of URLs, got {self.urls!r:.200}")
        urls = tuple(_checked_url(url, f"peers[{i}]") for i, url in enumerate(self.urls))
        if len(urls) < 2:
            raise ValueError(f"peers must name at least two processes, got {len(urls)}")
        seen: dict[str, str] = {}
        for i, url in enumerate(urls):
            other = seen.setdefault(same_endpoint(url), url)
            if other is not url:
                raise ValueError(
                    f"peers[{i}] {url!r} names the same process as {other!r} (twice in peers)"
                )
        object.__setattr__(self, "urls", urls)
        own = seen.get(same_endpoint(_checked_url(self.own, "peer_self")))
        if own is None:
            raise ValueError(
                f"peer_self {self.own!r:.200} must be one of the peers {list(urls)!r:.400}"
            )
        # As listed: every process orders the peers by the same strings.
        object.__setattr__(self, "own", own)
        if (
            not isinstance(self.secret, str)
            or len(self.secret) < MIN_SECRET_CHARS
            or not self.secret.isascii()
            or not self.secret.isprintable()
            or self.secret != self.secret.strip()
        ):
            raise ValueError(
                f"the peer secret (${PEER_SECRET_ENV}) must be printable ASCII of at least "
                f"{MIN_SECRET_CHARS} characters without surrounding spaces"
            )
        for name in ("connect_timeout_s", "retry_down_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 and math.isfinite(value))
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @classmethod
    def from_arguments(
        cls, urls: Sequence[str], own: str | None, environ: Mapping[str, str]
    ) -> PeerConfig | None:
        """The config of ``--peer`` / ``--peer-self`` and the secret in ``environ``; ``None``
        without peers.

        Raises:
            ValueError: ``--peer-self`` without peers or peers without it, the secret unset,
                or a bad field (named as the CLI names it).
        """
        if not urls:
            if own is not None:
                raise ValueError("--peer-self needs the group's --peer URLs")
            return None
        if own is None:
            raise ValueError("--peer needs --peer-self (which of the --peer URLs this is)")
        secret = environ.get(PEER_SECRET_ENV)
        if not secret:
            raise ValueError(
                f"--peer needs the peers' shared secret in ${PEER_SECRET_ENV}, which is unset "
                "or empty"
            )
        try:
            return cls(tuple(urls), own, secret)
        except ValueError as exc:
            message = str(exc).replace("peer_self", "--peer-self").replace("peers", "--peer")
            raise ValueError(message) from None

    def __repr__(self) -> str:  # never the secret
        return f"PeerConfig(urls={self.urls!r}, own={self.own!r}, secret=<set>)"


def _checked_url(url: object, field: str) -> str:
    """``url`` without a trailing slash; refused unless an http(s) URL with a host and no
    query or fragment."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"{field} must be an http(s) URL with a host and no query, got {url!r:.200}"
        )
    assert isinstance(url, str)
    try:
        same_endpoint(url)
    except ValueError as exc:  # a port that is not a number in 0..65535
        raise ValueError(f"{field} {url!r:.200}: {exc}") from None
    return url.rstrip("/")
