"""What a vLLM server says it served, from its Prometheus ``/metrics``: per worker, per method.

vLLM (v1 engine) exports cumulative counters; the ones read here (labels summed):

- ``vllm:prefix_cache_queries_total``: prompt tokens looked up in the prefix cache;
- ``vllm:prefix_cache_hits_total``: of those, tokens found cached;
- ``vllm:request_success_total``: requests finished (any finish reason);
- ``vllm:prompt_tokens_total``: prompt tokens prefilled or cached.

A method's figures on one worker are the difference of two readings
(:meth:`WorkerCounters.minus`): which worker a gateway sent each request to is not said in the
response, but the workers' own counters say how many requests and tokens each got and what its
cache served.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

__all__ = ["WorkerCounters", "read_worker_counters"]

_COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
}


@dataclass(frozen=True)
class WorkerCounters:
    """One worker's cumulative (or, after :meth:`minus`, per-method) counters.

    Attributes:
        requests: finished requests.
        prompt_tokens: prompt tokens.
        queries: prompt tokens looked up in the prefix cache.
        hits: of those, tokens served from it.
    """

    requests: int = 0
    prompt_tokens: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_ratio(self) -> float | None:
        """``hits / queries``; None when nothing was queried."""
        return self.hits / self.queries if self.queries else None

    def minus(self, earlier: WorkerCounters) -> WorkerCounters:
        """What was counted since ``earlier`` (a reading of the same worker)."""
        return WorkerCounters(
            self.requests - earlier.requests,
            self.prompt_tokens - earlier.prompt_tokens,
            self.queries - earlier.queries,
            self.hits - earlier.hits,
        )


def parse_worker_counters(text: str) -> WorkerCounters:
    """The counters of a Prometheus text exposition (samples of one name summed over labels).

    Raises:
        ValueError: a counter is missing (not a vLLM server, or one without prefix caching).
    """
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    seen: set[str] = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = _COUNTERS.get(name)
        if field is None:
            continue
        seen.add(name)
        totals[field] += float(line.rsplit(" ", 1)[1])
    missing = sorted(set(_COUNTERS) - seen)
    if missing:
        raise ValueError(f"/metrics lacks {missing}")
    return WorkerCounters(**{field: round(value) for field, value in totals.items()})


def read_worker_counters(base_url: str, *, timeout_s: float = 10.0) -> WorkerCounters:
    """``GET {base_url}/metrics`` (the server root, ``http://127.0.0.1:PORT``), parsed.

    Raises:
        httpx.HTTPError: unreachable, or an error status.
        ValueError: a counter is missing.
    """
    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return parse_worker_counters(response.text)
