"""Prometheus metrics of the index service (prometheus-client, text exposition format).

Each service owns its :class:`~prometheus_client.CollectorRegistry` (no process-wide default
registry: several services can live in one process, e.g. in tests). Counted as the service runs:

- ``contextpilot_http_requests_total{endpoint, status}`` and
  ``contextpilot_http_request_duration_seconds{endpoint}`` (histogram, seconds);
- ``contextpilot_plans_total{kind}`` (``single``, ``batch``: plans made, a batch counts each).

Read from the live state at each scrape (no copy to keep in step), service-wide: every
tenant's pilot added up (``IndexService``; no tenant names in the labels, so a key holder who
reads the metrics learns volumes, never which tenant or what):

- ``contextpilot_evictions_total{source}``: requests dropped from the index, by who asked
  (``api``: the service's own count; ``kv-events``, ``capacity``, ``ttl``, ``resync``: the
  engine link's ``evictions``);
- ``contextpilot_sync_failures_total{kind}``: failures of the engine-sync path that were
  absorbed (``engine_unreachable``, ``record``, ``resync_timeout``, ``snapshot``, ...; the
  engine link's ``failures``, or the service's own without one);
- ``contextpilot_usage_prompt_tokens_total`` / ``contextpilot_usage_cached_tokens_total``:
  the engine's own ``usage`` figures reported back by clients (hit ratio = cached / prompt);
- ``contextpilot_dedup_tokens_removed_total``, ``contextpilot_dedup_blocks_replaced_total``,
  ``contextpilot_dedup_sub_blocks_replaced_total``: what de-duplication removed from the
  plans' prompts (tokens by the service's token counter; ``ContextPilot.totals``), next to
  the engine's cached tokens above (per tenant and conversation: ``GET /v1/usage``, never here);
- ``contextpilot_index_{requests,nodes,tokens,height}`` gauges, the index size;
- ``contextpilot_index_{inserts,evictions,lru_evictions,searches}_total`` counters;
- ``contextpilot_conversations`` and the engine link's other numeric figures as
  ``contextpilot_sync_<name>`` gauges (per-rank lists get a ``rank`` label; the source's own
  counters under ``contextpilot_sync_source_``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
"""Histogram buckets in seconds: a plan takes well under a millisecond, a batch seconds."""

_INDEX_GAUGES = ("requests", "nodes", "tokens", "height")
_INDEX_COUNTERS = ("inserts", "evictions", "lru_evictions", "searches")
_USAGE_COUNTERS = {
    "prompt_tokens": "Prompt tokens the engine reported for planned requests.",
    "cached_tokens": "Prompt tokens the engine served from its prefix cache (cached_tokens).",
}
_DEDUP_COUNTERS = {
    "tokens_removed": "Prompt tokens de-duplication removed from planned prompts.",
    "blocks_replaced": "Blocks de-duplication replaced by a location hint.",
    "sub_blocks_replaced": "Sub-blocks de-duplication replaced by a pointer.",
}
_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")

StatsSource = Callable[[], Mapping[str, Any]]
"""Returns the service's stats dict (see ``IndexService.stats``)."""


class ServiceMetrics:
    """The service's registry and the metrics it updates.

    Args:
        stats: called at each scrape for the live figures (index, conversations, usage,
            totals, sync, the service's own evictions).
    """

    def __init__(self, stats: StatsSource) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "contextpilot_http_requests",
            "HTTP requests served, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "contextpilot_http_request_duration_seconds",
            "Time from request start to response end, seconds.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.plans = Counter(
            "contextpilot_plans",
            "Plans made (a batch counts each of its requests).",
            ["kind"],
            registry=self.registry,
        )
        self.registry.register(_LiveStatsCollector(stats))

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveStatsCollector(Collector):
    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        index = stats.get("index", {})
        for name in _INDEX_GAUGES:
            if name in index:
                yield GaugeMetricFamily(
                    f"contextpilot_index_{name}", f"Context index {name}.", value=index[name]
                )
        for name in _INDEX_COUNTERS:
            if name in index:
                yield CounterMetricFamily(
                    f"contextpilot_index_{name}", f"Context index {name}.", value=index[name]
                )
        conversations = stats.get("conversations", {})
        if "conversations" in conversations:
            yield GaugeMetricFamily(
                "contextpilot_conversations",
                "Conversations held for de-duplication.",
                value=conversations["conversations"],
            )
        usage = stats.get("usage", {})
        for name, help_text in _USAGE_COUNTERS.items():
            if name in usage:
                yield CounterMetricFamily(
                    f"contextpilot_usage_{name}", help_text, value=usage[name]
                )
        totals = stats.get("totals", {})
        for name, help_text in _DEDUP_COUNTERS.items():
            if name in totals:
                yield CounterMetricFamily(
                    f"contextpilot_dedup_{name}", help_text, value=totals[name]
                )
        sync = stats.get("sync", {})
        evictions = {**sync.get("evictions", {}), **stats.get("service", {}).get("evictions", {})}
        yield _labelled_counter(
            "contextpilot_evictions",
            "Requests evicted from the context index, by source.",
            "source",
            evictions,
        )
        yield _labelled_counter(
            "contextpilot_sync_failures",
            "Engine-sync failures absorbed without failing a request, by kind.",
            "kind",
            sync.get("failures", {}),
        )
        gauges = {k: v for k, v in sync.items() if k not in ("failures", "evictions")}
        yield from _numeric_gauges("contextpilot_sync", gauges)  # counters above


def _labelled_counter(
    name: str, help_text: str, label: str, values: Mapping[str, Any]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


def _numeric_gauges(prefix: str, values: Mapping[str, Any]) -> Iterator[Metric]:
    """One gauge per numeric leaf of ``values`` (nested keys joined by ``_``)."""
    for key, value in values.items():
        name = f"{prefix}_{_NAME_CHARS.sub('_', str(key))}"
        if isinstance(value, bool):
            yield GaugeMetricFamily(name, f"Sync state {key}.", value=float(value))
        elif isinstance(value, (int, float)):
            yield GaugeMetricFamily(name, f"Sync counter {key}.", value=value)
        elif isinstance(value, Mapping):
            yield from _numeric_gauges(name, value)
        elif isinstance(value, (list, tuple)):
            family = GaugeMetricFamily(name, f"Sync counter {key}, per rank.", labels=["rank"])
            for rank, item in enumerate(value):
                if isinstance(item, (int, float)):  # bools (joined, connected) as 0/1
                    family.add_metric([str(rank)], float(item))
            yield family
