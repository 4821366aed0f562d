"""Each tenant's share of the index service: its pilot, its rid namespace, its requests.

A :class:`Partition` is what one tenant may reach: the pilot that plans its requests (its own
when the service is partitioned, the shared one otherwise) and its rid tags, through which
every rid it names is resolved (:meth:`Partition.engine_rid`) and every request it sends is
admitted (:meth:`Partition.admit`: its scope's tenant is the key's, its rid in its namespace).
:class:`Partitions` holds them all, routes the engine's evictions to the pilot of the rid's
tenant, and lists the distinct pilots (the snapshot's sections, the metrics' sum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.request import MAX_ID_CHARS, PlanRequest, new_rid
from contextpilot_integrations.service.tenants import RID_TAG_CHARS, Tenancy, TenantMismatchError

__all__ = ["Partition", "Partitions", "PilotSection", "sum_stats"]

PilotSection = tuple["str | None", list[str], ContextPilot]
"""A distinct pilot as the snapshot stores it: (tenant or None when shared, rid tags, pilot)."""


@dataclass
class Partition:
    """One tenant as the service sees it (``name`` None: the one caller of a service without
    keys, whose requests keep the tenant their body names).

    Attributes:
        name: the tenant.
        pilot: the pilot that plans its requests.
        rid_tags: its rid tag first (none in the ``"open"`` and ``"single"`` modes), then the
            tags its restored rids carry (an older key derived them).
        api_evictions: rids it asked to evict (and that were indexed).
    """

    name: str | None
    pilot: ContextPilot
    rid_tags: list[str]
    api_evictions: int = 0

    def engine_rid(self, rid: object, where: str = "", *, planned: bool = False) -> str:
        """``rid`` as the engine and the index know it: within this tenant's namespace (its
        tag, a dot, the rid; a rid already carrying one of its tags is kept).

        Args:
            rid: the rid the tenant named.
            where: prefix of the error message's field (``"requests[2]."``).
            planned: a rid to plan under (at most ``MAX_ID_CHARS`` once tagged); a rid only
                looked up may be longer (it is then simply not found).

        Raises:
            TypeError: ``rid`` is not a str.
            ValueError: a ``planned`` rid too long once tagged.
        """
        if not isinstance(rid, str):
            raise TypeError(f"{where}rid must be a str, got {type(rid).__name__}: {rid!r:.80}")
        tag = self.rid_tags[0] if self.rid_tags else ""
        if not tag or any(rid.startswith(f"{known}.") for known in self.rid_tags):
            return rid
        if planned and len(rid) > MAX_ID_CHARS - RID_TAG_CHARS - 1:
            raise ValueError(
                f"{where}rid is longer than {MAX_ID_CHARS - RID_TAG_CHARS - 1} characters (the "
                f"service puts the tenant's {RID_TAG_CHARS + 1}-character tag before it): "
                f"{rid!r:.80}"
            )
        return f"{tag}.{rid}"

    def admit(self, request: PlanRequest, where: str = "") -> PlanRequest:
        """``request`` in this tenant's namespace: its scope's tenant and its rid (a new one
        when it has none).

        Raises:
            TenantMismatchError: ``request.scope.tenant`` names another tenant.
            ValueError: its rid is too long once tagged.
        """
        if self.name is None:  # no keys: the body's tenant is a label, as in process
            return request
        named = request.scope.tenant
        if named and named != self.name:
            raise TenantMismatchError(
                f"{where}scope.tenant {named!r:.80} is not the tenant of this API key "
                f"({self.name!r:.80}); leave it empty (the key decides)"
            )
        scope = request.scope if named else dataclasses.replace(request.scope, tenant=self.name)
        rid = self.engine_rid(
            request.rid if request.rid is not None else new_rid(), where, planned=True
        )
        return dataclasses.replace(request, rid=rid, scope=scope)


class Partitions:
    """Every tenant's :class:`Partition`, made empty.

    Args:
        tenancy: the service's tenants and isolation mode.
        new_pilot: makes an empty pilot for a tenant (``None``: the shared one).
    """

    def __init__(self, tenancy: Tenancy, new_pilot: Callable[[str | None], ContextPilot]) -> None:
        self.tenancy = tenancy
        if not tenancy.keyed:
            self._by_name: dict[str | None, Partition] = {
                None: Partition(None, new_pilot(None), [])
            }
        else:
            shared = None if tenancy.partitioned else new_pilot(None)
            self._by_name = {}
            for name in tenancy.tenants:
                tag = tenancy.rid_tag(name)
                self._by_name[name] = Partition(
                    name, shared or new_pilot(name), [tag] if tag else []
                )
        self._routes: dict[str, ContextPilot] = {}
        self._route_tags()

    def of(self, caller: str | None) -> Partition:
        """The partition of ``caller`` (the tenant of the request's key; None without keys).

        Raises:
            TenantMismatchError: ``caller`` is not a tenant of this service.
        """
        if not self.tenancy.keyed:
            if caller is not None:
                raise TenantMismatchError(
                    f"this service has no API keys: no caller tenant, got {caller!r:.80}"
                )
            return self._by_name[None]
        partition = self._by_name.get(caller) if caller is not None else None
        if partition is None:
            raise TenantMismatchError(f"{caller!r:.80} is not a tenant of this service")
        return partition

    def get(self, tenant: str | None) -> Partition | None:
        """The partition of a tenant named in a snapshot; None if not configured."""
        return self._by_name.get(tenant)

    def __iter__(self) -> Iterator[Partition]:
        return iter(self._by_name.values())

    def add_rid_tags(self, partition: Partition, tags: list[str]) -> None:
        """Route the engine's evictions of rids carrying ``tags`` (restored) to ``partition``."""
        partition.rid_tags += [tag for tag in tags if tag not in partition.rid_tags]
        self._route_tags()

    def route(self, rid: str) -> ContextPilot | None:
        """The pilot whose index holds the engine-facing ``rid`` (None: no tenant's tag)."""
        if not self._routes:
            return next(iter(self._by_name.values())).pilot
        return self._routes.get(rid.partition(".")[0])

    def sections(self) -> list[PilotSection]:
        """Each distinct pilot with its snapshot section's tenant and rid tags."""
        if self.tenancy.partitioned:
            return [(p.name, p.rid_tags, p.pilot) for p in self._by_name.values()]
        return [(None, [], next(iter(self._by_name.values())).pilot)]

    def lose_history(self) -> None:
        """Make every conversation store amnesic (history was lost: see the core's store)."""
        for _, _, pilot in self.sections():
            pilot.deduplicator.store.mark_history_lost()

    def _route_tags(self) -> None:
        if self.tenancy.partitioned:
            self._routes = {tag: p.pilot for p in self._by_name.values() for tag in p.rid_tags}


def sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pilot stats added up: numbers summed (``height`` the largest, ``hit_ratio`` recomputed),
    flags or-ed."""
    if len(parts) == 1:
        return parts[0]
    total: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                total[key] = sum_stats([total[key], value]) if key in total else dict(value)
            elif isinstance(value, bool):
                total[key] = bool(total.get(key, False)) or value
            elif isinstance(value, (int, float)):
                previous = total.get(key, 0)
                total[key] = max(previous, value) if key == "height" else previous + value
            else:
                total.setdefault(key, value)
    usage = total.get("usage")
    if isinstance(usage, dict) and "hit_ratio" in usage:
        prompt = usage.get("prompt_tokens", 0)
        usage["hit_ratio"] = usage.get("cached_tokens", 0) / prompt if prompt else 0.0
    return total
