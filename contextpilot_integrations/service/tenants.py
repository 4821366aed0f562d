"""Tenants from credentials: which API key belongs to which tenant, and what each tenant gets.

docs/DESIGN.md, "Tenants from credentials": a request's tenant comes from its API key, never
from its body. The keys come from a key file (``contextpilot-server --api-keys FILE``)::

    {"tenants": {"alice": {"keys": ["<key>", ...], "cache_salt": "<optional>"},
                 "bob": {"keys": ["<key>"]}}}

and/or the environment (``CONTEXTPILOT_API_KEYS="alice=<key>,bob=<key>,alice=<second key>"``);
one key shared by everyone (``CONTEXTPILOT_API_KEY``, ``--api-key``) is the one
tenant named ``""``. A key belongs to exactly one tenant; a tenant may have several keys (to
rotate them).

What a tenant gets (:class:`Tenancy`):

- a **rid tag**: the service prefixes each of the tenant's request ids with it
  (``"<tag>.<rid>"``, the plan's ``rid``, which the app sends to the engine), so two tenants
  choosing the same rid never collide in the engine's KV-event attribution, and a rid given to
  ``/v1/evict`` or ``/v1/usage`` is always looked up among the caller's own. The tag is an HMAC
  of the tenant's secret (its ``cache_salt`` when the key file gives one, else its first key),
  so other tenants cannot guess it and it stays the same across restarts;
- a **cache_salt** (when the index is partitioned, the default): the engine's ``cache_salt``
  for the tenant's requests (vLLM; SGLang >= 0.5.18), so the engine's prefix cache is not
  shared across tenants either. It is the key file's ``cache_salt``, else an HMAC of the
  tenant's first key (stable across restarts; set ``cache_salt`` to keep the engine cache
  when rotating keys).

Isolation modes (:attr:`Tenancy.mode`):

- ``"open"``: no keys. Every request is trusted; ``scope.tenant`` in a body is a label that
  keeps conversations apart (as in process), not a security boundary.
- ``"single"``: only the one shared key (tenant ``""``); nothing to isolate.
- ``"partitioned"`` (tenants configured; the default): each tenant has its own index,
  popularity memory and conversation store, and its own ``cache_salt``: nothing one tenant
  plans changes another's plans (no side channel through ``matched_prefix_blocks`` or block
  order).
- ``"shared"`` (``--share-prefixes-across-tenants``): one index for every tenant, so a prefix
  one tenant indexed is reused for another. It opens the side channel ``cache_salt`` closes in
  the engines: a tenant learns from ``matched_prefix_blocks`` (and from the block order, which
  follows the index) whether another tenant has sent a given document. No ``cache_salt`` is
  sent (the engine must share its cache for the shared prefixes to hit). Request ids,
  conversations, usage and evictions stay per tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from contextpilot_integrations.core.request import MAX_ID_CHARS

__all__ = [
    "RID_TAG_CHARS",
    "IsolationMode",
    "TenantKeys",
    "TenantMismatchError",
    "Tenancy",
    "is_rid_tag",
    "parse_key_list",
    "read_key_file",
]

logger = logging.getLogger(__name__)

IsolationMode = Literal["open", "single", "partitioned", "shared"]

RID_TAG_CHARS = 12
"""Length of a tenant's rid tag (hex digits); the engine-facing rid is ``tag + "." + rid``."""

_RID_TAG = re.compile(rf"[0-9a-f]{{{RID_TAG_CHARS}}}")
_SALT_CHARS = 32
_KEY_FILE_FIELDS = {"keys", "cache_salt"}
_KEY_CHARS = re.compile(r"[!-~]+")  # printable ASCII, no whitespace


class TenantMismatchError(ValueError):
    """A request names another tenant than the one its API key belongs to (HTTP 403)."""


@dataclass(frozen=True)
class TenantKeys:
    """One tenant's credentials.

    Attributes:
        keys: its API keys (non-empty strs of printable ASCII without whitespace, ``!`` to
            ``~``: an HTTP header carries them, and a client could not send another; the
            first one derives its secrets).
        cache_salt: the engine ``cache_salt`` for its requests; ``None``: derived from the
            first key.
    """

    keys: tuple[str, ...]
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keys, str) or not isinstance(self.keys, (tuple, list)):
            raise TypeError(f"keys must be a list of str, got {type(self.keys).__name__}")
        object.__setattr__(self, "keys", tuple(self.keys))
        if not self.keys:
            raise ValueError("keys must not be empty")
        for position, key in enumerate(self.keys):
            if not isinstance(key, str) or not key or not _KEY_CHARS.fullmatch(key):
                raise ValueError(
                    f"keys[{position}] must be a non-empty str of printable ASCII characters "
                    "without whitespace (it travels in an HTTP header as Bearer <key>)"
                )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError("cache_salt must be a non-empty str or null")


def read_key_file(path: str | os.PathLike[str]) -> dict[str, TenantKeys]:
    """The tenants of a key file (format in the module docstring).

    A name given twice in one object (JSON keeps the last) is refused: a tenant named twice
    would silently lose the first entry's keys.

    Raises:
        ValueError: the file cannot be read or is not in the format (the message names the
            file and what is wrong, and the tenant; never a key).
    """
    where = f"key file {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_NamedTwice)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: cannot be read as JSON ({type(exc).__name__}: {exc})") from None
    _warn_if_readable_by_others(Path(path))
    if (
        not isinstance(data, dict)
        or set(data) != {"tenants"}
        or not isinstance(data["tenants"], dict)
    ):
        raise ValueError(f'{where}: must be {{"tenants": {{"<name>": {{"keys": [...]}}}}}}')
    if _twice(data):
        raise ValueError(f"{where}: the field {_twice(data)[0]!r:.80} is given twice")
    for name in _twice(data["tenants"]):
        _check_name(name, where)
        raise ValueError(f"{where}: tenant {name!r} is named twice (give it one entry)")
    tenants: dict[str, TenantKeys] = {}
    for name, entry in data["tenants"].items():
        _check_name(name, where)
        if not isinstance(entry, dict) or "keys" not in entry:
            raise ValueError(f"{where}: tenants[{name!r}] must be an object with a keys list")
        if _twice(entry):
            raise ValueError(
                f"{where}: tenants[{name!r}] gives the field {_twice(entry)[0]!r:.80} twice"
            )
        unknown = set(entry) - _KEY_FILE_FIELDS
        if unknown:
            raise ValueError(f"{where}: tenants[{name!r}] has unknown fields {sorted(unknown)}")
        if not isinstance(entry["keys"], list):
            raise ValueError(f"{where}: tenants[{name!r}].keys must be a list of str")
        try:
            tenants[name] = TenantKeys(tuple(entry["keys"]), entry.get("cache_salt"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: tenants[{name!r}]: {exc}") from None
    return tenants


class _NamedTwice(dict[str, object]):
    """A JSON object that remembers the names it was given more than once (``twice``)."""

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        super().__init__(pairs)
        counts = Counter(name for name, _ in pairs)
        self.twice = [name for name, count in counts.items() if count > 1]


def _twice(value: object) -> list[str]:
    """The names a JSON object read by :func:`read_key_file` was given more than once."""
    return list(getattr(value, "twice", ()))


def parse_key_list(text: str, *, source: str = "CONTEXTPILOT_API_KEYS") -> dict[str, TenantKeys]:
    """``"alice=key1,bob=key2,alice=key3"`` -> the tenants (a tenant may repeat).

    Raises:
        ValueError: an entry that is not ``name=key`` (named by its position, never the key),
            or a key that is not printable ASCII without whitespace (named by its tenant).
    """
    keys: dict[str, list[str]] = {}
    for position, item in enumerate(text.split(",")):
        item = item.strip()
        if not item:
            continue
        name, sep, key = item.partition("=")
        name, key = name.strip(), key.strip()
        if not sep or not key:
            raise ValueError(f"{source}: entry {position} must be name=key")
        _check_name(name, source)
        keys.setdefault(name, []).append(key)
    tenants: dict[str, TenantKeys] = {}
    for name, listed in keys.items():
        try:
            tenants[name] = TenantKeys(tuple(listed))
        except ValueError as exc:
            raise ValueError(f"{source}: tenant {name!r}: {exc}") from None
    return tenants


class Tenancy:
    """The service's tenants: key -> tenant, each tenant's rid tag and cache salt.

    Args:
        tenants: tenant name -> its keys (``""``: the one key shared by everyone).
        share_prefixes: one index for all tenants (``"shared"`` mode; no ``cache_salt``).

    Raises:
        ValueError: a key given to two tenants, two tenants with the same ``cache_salt``, a
            ``cache_salt`` with ``share_prefixes`` (the engine must share its cache then),
            or ``share_prefixes`` without named tenants.

    Key look-up compares SHA-256 digests (a dict look-up on a digest tells a timing observer
    nothing about the key); the keys themselves are not kept.
    """

    def __init__(self, tenants: Mapping[str, TenantKeys], *, share_prefixes: bool = False) -> None:
        self._by_digest: dict[bytes, str] = {}
        self._rid_tags: dict[str, str] = {}
        self._salts: dict[str, str | None] = {}
        named = [name for name in tenants if name]
        if share_prefixes and not named:
            raise ValueError(
                "share_prefixes_across_tenants needs tenant keys (--api-keys or "
                "CONTEXTPILOT_API_KEYS)"
            )
        if not tenants:
            self.mode: IsolationMode = "open"
        elif not named:
            self.mode = "single"
        else:
            self.mode = "shared" if share_prefixes else "partitioned"
        salts: dict[str, str] = {}
        for name, credentials in tenants.items():
            for key in credentials.keys:
                digest = _digest(key)
                if self._by_digest.setdefault(digest, name) != name:
                    raise ValueError(
                        f"a key of tenant {name!r} is also a key of tenant "
                        f"{self._by_digest[digest]!r}; a key belongs to one tenant"
                    )
            if credentials.cache_salt is not None:
                if share_prefixes:
                    raise ValueError(
                        f"tenant {name!r} has a cache_salt, but prefixes are shared across "
                        "tenants (the engine must share its cache for them to hit)"
                    )
                other = salts.setdefault(credentials.cache_salt, name)
                if other != name:
                    raise ValueError(f"tenants {other!r} and {name!r} have the same cache_salt")
            if self.mode in ("single", "open"):
                self._rid_tags[name] = ""
                self._salts[name] = None
                continue
            secret = (credentials.cache_salt or credentials.keys[0]).encode("utf-8")
            self._rid_tags[name] = _hmac(secret, "rid tag", name)[:RID_TAG_CHARS]
            self._salts[name] = (
                None
                if share_prefixes
                else credentials.cache_salt
                or _hmac(credentials.keys[0].encode("utf-8"), "cache salt", name)[:_SALT_CHARS]
            )
        tags = list(self._rid_tags.values())
        if len(set(tags)) != len(tags):  # 48-bit tags: never seen, but never silently wrong
            raise ValueError("two tenants derive the same rid tag; give one of them a cache_salt")

    @property
    def tenants(self) -> list[str]:
        """The tenant names, in configuration order."""
        return list(self._rid_tags)

    @property
    def keyed(self) -> bool:
        """Whether requests need an API key (every mode but ``"open"``)."""
        return self.mode != "open"

    @property
    def partitioned(self) -> bool:
        """Whether each tenant has its own pilot (index, conversations)."""
        return self.mode == "partitioned"

    def tenant_of(self, key: str | bytes) -> str | None:
        """The tenant an API key belongs to; ``None`` for an unknown key."""
        return self._by_digest.get(_digest(key))

    def rid_tag(self, tenant: str) -> str:
        """The tenant's rid tag (``""`` in the ``"open"`` and ``"single"`` modes).

        Raises:
            KeyError: an unknown tenant.
        """
        return self._rid_tags[tenant]

    def cache_salt(self, tenant: str) -> str | None:
        """The engine ``cache_salt`` of the tenant's plans (``None`` unless partitioned).

        Raises:
            KeyError: an unknown tenant.
        """
        return self._salts[tenant]


def is_rid_tag(text: object) -> bool:
    """Whether ``text`` has the form of a rid tag (for snapshot validation)."""
    return isinstance(text, str) and _RID_TAG.fullmatch(text) is not None


def _digest(key: str | bytes) -> bytes:
    raw = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def _hmac(secret: bytes, purpose: str, tenant: str) -> str:
    message = f"contextpilot {purpose}\0{tenant}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_ID_CHARS:
        raise ValueError(
            f"{where}: a tenant name must be a str of 1..{MAX_ID_CHARS} characters, "
            f"got {name!r:.80}"
        )
    if not name.isprintable():
        raise ValueError(f"{where}: tenant name {name!r:.80} has unprintable characters")


def _warn_if_readable_by_others(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        logger.warning(
            "key file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777
        )
