"""The routing key of each replica, learnt from where a gateway sends each key's requests.

A gateway that routes on a key (SMG: ``--routing-key-headers NAME --routing-key-override``;
docs/DESIGN.md, "The smg gateway") pins each key to one worker when the first request with it
arrives (by its assignment mode: random, least loaded, fewest groups, or its policy) and sends
every later request with that key there. The client cannot name the worker: a key names a
*group*. So the router mints a *probe* key for a replica, sends that replica's requests with it,
and learns where the group landed from which replica's KV events carry those requests' rids
(the rid goes out as ``session_id``; :meth:`RouteKeys.observe`):

- it landed on the intended replica: the key is *confirmed* for it and used from then on;
- it landed on another one: the key now belongs to that replica (its confirmed key if it had
  none, an alias otherwise), and the intended replica gets a fresh probe with its next request.

With distinct keys per replica and a gateway placing new groups on the least busy worker
(``--assignment-mode min_group``), the probes spread one per worker and the map settles after
one request per replica; with a random placement it settles after a few probes more. A replica
that goes down or is removed drops its keys (the gateway may pin them elsewhere).

In the ``"direct"`` mode (no gateway) there are no keys: :meth:`RouteKeys.key_for` is None.
Not thread-safe: the router holds its lock around every call.
"""

from __future__ import annotations

import secrets
from typing import Any

from contextpilot_integrations.core.replicas.routing_config import RoutingMode

__all__ = ["RouteKeys"]


class RouteKeys:
    """Keys per replica, probes and confirmations (module docstring).

    Args:
        mode: ``"gateway"`` (keys) or ``"direct"`` (none).
        prefix: how keys start (each is ``f"{prefix}{n}"``); None: ``"cp-"`` and six random hex
            digits, new per router, then ``"-"``.
        max_aliases: confirmed keys kept per replica; one more that lands there is no longer
            followed (the router still moves its requests: bounded memory).
    """

    def __init__(
        self, mode: RoutingMode = "gateway", prefix: str | None = None, max_aliases: int = 8
    ) -> None:
        self.mode = mode
        self.prefix = prefix if prefix is not None else f"cp-{secrets.token_hex(3)}-"
        self.max_aliases = max_aliases
        self._minted = 0
        self._owner: dict[str, str] = {}  # key -> the replica its group is on (or meant for)
        self._confirmed: dict[str, list[str]] = {}  # replica -> keys seen landing there
        self._probe: dict[str, str] = {}  # replica -> key not confirmed yet
        self.remapped_keys = 0

    def key_for(self, replica: str) -> str | None:
        """The key to send ``replica``'s requests with: its first confirmed key, else its probe
        (minted on first use); None in the direct mode."""
        if self.mode == "direct":
            return None
        confirmed = self._confirmed.get(replica)
        if confirmed:
            return confirmed[0]
        probe = self._probe.get(replica)
        if probe is None:
            probe = self._probe[replica] = f"{self.prefix}{self._minted}"
            self._minted += 1
            self._owner[probe] = replica
        return probe

    def observe(self, key: str, replica: str) -> None:
        """A request sent with ``key`` reached ``replica`` (its KV events carry the rid)."""
        owner = self._owner.get(key)
        if owner is None or key in self._confirmed.get(replica, ()):
            return
        if owner != replica:
            self.remapped_keys += 1
            self._release(owner, key)
        if self._probe.get(replica) == key:
            del self._probe[replica]
        confirmed = self._confirmed.setdefault(replica, [])
        if len(confirmed) < self.max_aliases:
            confirmed.append(key)
            self._owner[key] = replica
        else:  # bounded: a key beyond the aliases is not followed
            del self._owner[key]

    def replica_of(self, key: str) -> str | None:
        """The replica ``key``'s group is on (or meant for), or None."""
        return self._owner.get(key)

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica``'s keys (it went down or was removed)."""
        self._confirmed.pop(replica, None)
        self._probe.pop(replica, None)
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def stats(self, replica: str) -> dict[str, Any]:
        """``key`` (the one sent now, without minting), ``confirmed`` (it was seen landing
        there) and ``aliases`` (keys seen landing there)."""
        confirmed = self._confirmed.get(replica, [])
        key = confirmed[0] if confirmed else self._probe.get(replica)
        return {"key": key, "confirmed": bool(confirmed), "aliases": len(confirmed)}

    def _release(self, replica: str, key: str) -> None:
        """``key`` no longer belongs to ``replica``: a probe is dropped (the next request gets
        a fresh one), a confirmed key is unlisted (the gateway moved its group)."""
        if self._probe.get(replica) == key:
            del self._probe[replica]
        confirmed = self._confirmed.get(replica)
        if confirmed and key in confirmed:
            confirmed.remove(key)
