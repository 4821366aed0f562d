"""The replicas benchmark's figures: per method, the engines' hit ratios in total and per
replica, TTFT, load balance, and the one-replica reference; the targets.

Per method (:func:`vllm_replica_rows`):

- ``hit_ratio``: cached / prompt tokens of the responses' ``usage`` (the engines' own figure);
- ``replica_hit_ratios``: per replica, ``vllm:prefix_cache_hits_total`` over
  ``vllm:prefix_cache_queries_total`` during the method (its ``/metrics``);
- ``replica_requests``, ``replica_prompt_tokens`` and their max/min (``vllm:request_success_total``,
  ``vllm:prompt_tokens_total``);
- ``ttft_p50_s``, ``ttft_p90_s``;
- ``one_replica_model_hit``: the same token stream through one paged prefix-cache model (vLLM's
  block pool, :class:`~contextpilot_bench.prefix_cache_model.PrefixCacheModel`)
  holding the fleet's total KV capacity: what one engine of that size would have hit. The
  single-engine benchmark checks this model against the engine request by request.

Targets (:func:`vllm_replica_target_lines`; the constants of
:mod:`~contextpilot_bench.replica_report`): ContextPilot routing keeps >= 0.9 of the
one-replica ContextPilot hit ratio at the same total capacity (the replica-blind plan's stream
on the one-replica model), reaches >= 1.3x ContextPilot's prompts through ``cache_aware`` and
>= 3x the baseline through ``cache_aware``, with max/min prompt tokens per replica <= 1.3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_bench.replica_report import (
    TARGET_BALANCE,
    TARGET_VS_BASELINE,
    TARGET_VS_BLIND,
    TARGET_VS_ONE_REPLICA,
)
from contextpilot_bench.vllm_replica_methods import PROXY_METHOD, ROUTED_METHODS, ReplicaMethodRun

__all__ = ["VLLM_REPLICA_COLUMNS", "vllm_replica_rows", "vllm_replica_target_lines"]

VLLM_REPLICA_COLUMNS = (
    ("method", "method", "str"),
    ("gateway", "gateway", "str"),
    ("requests", "requests", "int"),
    ("engine hit", "hit_ratio", "ratio"),
    ("hit per replica", "replica_hits", "str"),
    ("requests per replica", "replica_request_counts", "str"),
    ("prompt tokens per replica", "replica_token_counts", "str"),
    ("tokens max/min", "prompt_tokens_max_over_min", "x"),
    ("TTFT p50 s", "ttft_p50_s", "s"),
    ("TTFT p90 s", "ttft_p90_s", "s"),
    ("1-replica model hit", "one_replica_model_hit", "ratio"),
)

REFERENCE = "contextpilot-cache_aware"
"""The replica-blind plan: its stream on one engine of the total size is the one-replica
ContextPilot figure."""


def _max_over_min(values: Sequence[int]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


def _one_replica_hit(run: ReplicaMethodRun, capacity_tokens: int | None, block_size: int) -> float:
    model = PrefixCacheModel(capacity_tokens, block_size=block_size, paged=True)
    prompt = cached = 0
    for request in run.requests:
        cached += model.serve(list(request.token_ids))
        prompt += len(request.token_ids)
    return cached / prompt if prompt else 0.0


def vllm_replica_rows(
    runs: Sequence[ReplicaMethodRun], *, total_capacity_tokens: int | None, block_size: int
) -> list[dict[str, Any]]:
    """One row per run (module docstring), for ``format_table`` with :data:`VLLM_REPLICA_COLUMNS`
    and the JSON."""
    rows = []
    for run in runs:
        prompt = sum(r.prompt_tokens for r in run.requests)
        cached = sum(r.cached_tokens for r in run.requests)
        ttfts = np.array([r.ttft_s for r in run.requests], dtype=float)
        workers = run.workers
        hits = {name: w.hit_ratio for name, w in workers.items()}
        requests = [w.requests for w in workers.values()]
        tokens = [w.prompt_tokens for w in workers.values()]
        rows.append(
            {
                "method": run.method,
                "gateway": run.gateway,
                "requests": len(run.requests),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_ratio": cached / prompt if prompt else 0.0,
                "replica_hit_ratios": hits,
                "replica_hits": "/".join("n/a" if h is None else f"{h:.3f}" for h in hits.values()),
                "replica_requests": {name: w.requests for name, w in workers.items()},
                "replica_prompt_tokens": {name: w.prompt_tokens for name, w in workers.items()},
                "replica_request_counts": "/".join(f"{n:,}" for n in requests),
                "replica_token_counts": "/".join(f"{n:,}" for n in tokens),
                "requests_max_over_min": _max_over_min(requests),
                "prompt_tokens_max_over_min": _max_over_min(tokens),
                "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts.size else math.nan,
                "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts.size else math.nan,
                "one_replica_model_hit": _one_replica_hit(run, total_capacity_tokens, block_size),
                "plan_seconds": run.plan_seconds,
                "seconds": run.seconds,
                "gateway_startup_s": run.gateway_startup_s,
                "router": run.router,
            }
        )
    return rows


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def vllm_replica_target_lines(
    rows: Sequence[Mapping[str, Any]], *, same_arrival_one_replica: float | None = None
) -> list[str]:
    """The targets, judged on the rows present.

    Args:
        same_arrival_one_replica: one replica of the fleet's total KV behind the proxy's
            window at the same arrival times
            (:func:`~contextpilot_bench.windowed_fleet_model.run_windowed_fleet_model`), or
            None; the proxy method is also judged against it (its hit ratio over that figure
            separates "two replicas against one" from "online windows against one offline
            plan", which the line against the reference row mixes).
    """
    by_method = {row["method"]: row for row in rows}
    reference = by_method.get(REFERENCE)
    baseline = by_method.get("baseline-cache_aware")
    lines = []
    one_target, blind_target = TARGET_VS_ONE_REPLICA, TARGET_VS_BLIND
    for routed in (*ROUTED_METHODS.values(), PROXY_METHOD):
        row = by_method.get(routed)
        if row is None:
            continue
        hit = row["hit_ratio"]
        if reference is not None and reference["ttft_p50_s"] > 0:
            slower = row["ttft_p50_s"] / reference["ttft_p50_s"]
            lines.append(
                f"{routed}: median TTFT {row['ttft_p50_s']:.3f} s = {slower:.2f}x ContextPilot "
                f"prompts via cache_aware ({reference['ttft_p50_s']:.3f} s) "
                f"(<= 1: {_verdict(slower <= 1.0)})"
            )
        if reference is not None and reference["one_replica_model_hit"]:
            one = reference["one_replica_model_hit"]
            share = hit / one
            lines.append(
                f"{routed}: engine hit {hit:.4f} = {share:.2f} of one-replica ContextPilot "
                f"{one:.4f} (paged model, same total KV) "
                f"(>= {one_target:g}: {_verdict(share >= one_target)})"
            )
        if routed == PROXY_METHOD and same_arrival_one_replica:
            share = hit / same_arrival_one_replica
            lines.append(
                f"{routed}: engine hit {hit:.4f} = {share:.2f} of one-replica ContextPilot at "
                f"the same arrivals and window {same_arrival_one_replica:.4f} (window model: "
                f"windows closed on time, never held; same total KV) "
                f"(>= {one_target:g}: {_verdict(share >= one_target)})"
            )
        if reference is not None and reference["hit_ratio"]:
            gain = hit / reference["hit_ratio"]
            lines.append(
                f"{routed}: {gain:.2f}x ContextPilot prompts via cache_aware "
                f"({reference['hit_ratio']:.4f}) "
                f"(>= {blind_target:g}x: {_verdict(gain >= blind_target)})"
            )
        if baseline is not None and baseline["hit_ratio"]:
            gain = hit / baseline["hit_ratio"]
            lines.append(
                f"{routed}: {gain:.2f}x baseline via cache_aware ({baseline['hit_ratio']:.4f}) "
                f"(>= {TARGET_VS_BASELINE:g}x: {_verdict(gain >= TARGET_VS_BASELINE)})"
            )
        balance = row["prompt_tokens_max_over_min"]
        if balance is not None:
            lines.append(
                f"{routed}: max/min prompt tokens per replica {balance:.3f} "
                f"(<= {TARGET_BALANCE:g}: {_verdict(balance <= TARGET_BALANCE)})"
            )
        else:
            lines.append(f"{routed}: a replica got no prompt tokens (max/min undefined): MISSED")
    return lines
