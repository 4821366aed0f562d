"""The settings of one index service (:class:`ServiceConfig`), checked when made.

What the command line (:mod:`.server`) and embedders give
:class:`~contextpilot_integrations.service.index_service.IndexService`:
the engine link, the snapshot file, the index bound, the layout, the tenants and their keys,
the limits of the HTTP layer, and the proxy mode's upstream.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.tenants import Tenancy, TenantKeys
from contextpilot_integrations.sync.configuration import CacheSyncConfig

__all__ = ["MAX_WINDOW_BATCH", "ServiceConfig"]

MAX_WINDOW_BATCH = 1024
"""Most requests one planning window of the service may gather: a window's calls each hold a
worker thread while it is open (the proxy keeps twice this many), and its batch is planned
in one go."""


@dataclass
class ServiceConfig:
    """Settings of one index service.

    Attributes:
        cache_sync: the engine link, as
            :meth:`~contextpilot_integrations.sync.configuration.CacheSyncConfig.from_mapping`
            takes it (``{"kind": "kv-events", "endpoint": ..., "engine_grace_s": 5.0}``,
            ``{"kind": "capacity", ...}``, ``{"kind": "ttl", ...}``); the same mapping
            ``EngineLink(...)`` takes. None: no engine feedback (the index's own LRU bound).
        snapshot_path: file to restore on start and save on stop; None: no snapshot. A
            symlink is followed (its target is read and replaced).
        snapshot_interval_s: also save a checkpoint every this many seconds (None: only on
            stop).
        max_requests: LRU bound of the context index (of each tenant's, when partitioned).
        layout: the prompt layout (None: the default :class:`PromptLayout`).
        api_key: one shared secret for everyone: the tenant named ``""``. Every
            request but ``/health`` must present a key as ``Authorization: Bearer <key>``
            once any key is set.
        tenants: tenant name -> its keys and optional ``cache_salt`` (:mod:`.tenants`); None:
            none (with ``api_key`` neither: no authentication). An empty mapping is refused:
            keys were meant to be checked, and none would be.
        share_prefixes_across_tenants: one index for all tenants instead of one per tenant;
            opens the side channel described in :mod:`.tenants`.
        max_body_bytes: largest request body accepted (413 above).
        max_batch_threads: batch builds running at once (others wait their turn).
        max_call_threads: other calls that take a lock (evict, usage, forget, stats,
            metrics, snapshot) running at once in worker threads.
        window_ms: a planning window in front of each tenant's pilot
            (:class:`~contextpilot_integrations.core.window.planning_window.PlanningWindow`): single
            plans arriving within this many milliseconds are planned jointly (at most as many
            as run at once: anyio's 40 worker threads); 0 (default): each at once.
        window_max_batch: most requests one planning window gathers (the service's and the
            proxy's; 1 to :data:`MAX_WINDOW_BATCH`, default 64): a window that reaches it
            closes at once.
        shutdown_timeout_s: longest :meth:`IndexService.stop` waits for in-flight plans, the
            engine link and the final save together.
        proxy: the proxy mode (:mod:`.proxy`): OpenAI's and Anthropic's chat endpoints
            planned and forwarded to this upstream, every other ``/v1/`` path passed
            through; ``None`` (default): the index service alone.
        tenancy: (made from ``api_key``, ``tenants`` and ``share_prefixes_across_tenants``)
            the :class:`~.tenants.Tenancy`: key -> tenant, rid tags, salts, isolation mode.

    Raises:
        ValueError: a setting out of range, an invalid ``cache_sync`` or tenant set (names
            the field).
    """

    cache_sync: Mapping[str, Any] | CacheSyncConfig | None = None
    snapshot_path: str | Path | None = None
    snapshot_interval_s: float | None = None
    max_requests: int = 100_000
    layout: PromptLayout | None = None
    api_key: str | None = None
    tenants: Mapping[str, TenantKeys] | None = None
    share_prefixes_across_tenants: bool = False
    max_body_bytes: int = 64 * 1024 * 1024
    max_batch_threads: int = 2
    max_call_threads: int = 8
    shutdown_timeout_s: float = 10.0
    window_ms: float = 0.0
    window_max_batch: int = 64
    proxy: ProxyConfig | None = None
    tenancy: Tenancy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise ValueError(f"max_requests must be a positive int, got {self.max_requests!r}")
        for name in ("snapshot_interval_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if (value is not None or name == "shutdown_timeout_s") and not (
                isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            ):
                raise ValueError(f"{name} must be positive, got {value!r}")
        if isinstance(self.window_ms, bool) or not (
            isinstance(self.window_ms, (int, float)) and 0 <= self.window_ms < math.inf
        ):
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms!r}")
        batch = self.window_max_batch
        if (
            isinstance(batch, bool)
            or not isinstance(batch, int)
            or not 1 <= batch <= MAX_WINDOW_BATCH
        ):
            raise ValueError(
                f"window_max_batch must be an int from 1 to {MAX_WINDOW_BATCH}, got {batch!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty str or None, got ''")
        if self.tenants is not None and not self.tenants:
            raise ValueError(
                "tenants must name at least one tenant, or be None for no authentication; "
                "got an empty mapping"
            )
        for name in ("max_body_bytes", "max_batch_threads", "max_call_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.proxy is not None and not isinstance(self.proxy, ProxyConfig):
            raise ValueError(
                f"proxy must be a ProxyConfig or None, got {type(self.proxy).__name__}"
            )
        fleet = self.proxy.fleet if self.proxy is not None else None
        if fleet is not None and fleet.window_hold_ms > 0 and self.window_ms == 0:
            raise ValueError(
                f"fleet.window_hold_ms {fleet.window_hold_ms!r} holds planning windows, and "
                "window_ms is 0 (no window): give window_ms > 0 too"
            )
        if self.cache_sync is not None and not isinstance(self.cache_sync, CacheSyncConfig):
            self.cache_sync = CacheSyncConfig.from_mapping(self.cache_sync)
        tenants: dict[str, TenantKeys] = dict(self.tenants or {})
        if self.api_key is not None:
            shared = tenants.get("")
            keys = (*(shared.keys if shared else ()), self.api_key)
            tenants[""] = TenantKeys(
                tuple(dict.fromkeys(keys)), shared.cache_salt if shared else None
            )
        self.tenancy = Tenancy(tenants, share_prefixes=self.share_prefixes_across_tenants)
