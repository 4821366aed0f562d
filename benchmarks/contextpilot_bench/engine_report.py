"""The real engine's figures per method, beside what the embedded models predict.

:class:`EngineRequest` is one request as the engine and the models saw it (the same prompt
tokens); :class:`EngineMethodReport` sums a method's requests: the engine's hit ratio
(``cached_tokens / prompt_tokens`` from ``usage``), TTFT median and p90, prefill tokens per
second (uncached prompt tokens / TTFT, summed over requests), the models' predicted hit ratios
and their relative error, the KV events received while the method ran, and, for ContextPilot,
the evictions its engine link reported and applied to the index
(``pilot.stats()["sync"]``). :func:`format_engine_table` prints them; :func:`target_lines`
judges the vLLM CPU engine's targets (set for k=10 and a 5% KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from contextpilot_bench.kv_cache_size import KVCacheSize

__all__ = ["EngineMethodReport", "EngineRequest", "format_engine_table", "target_lines"]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine and the models saw it.

    Attributes:
        rid: the plan's rid (sent as ``session_id`` and ``request_id``).
        prompt_tokens: the engine's ``usage.prompt_tokens``.
        local_prompt_tokens: the same prompt tokenised here (model tokenizer, chat template).
        cached_tokens: the engine's ``usage.prompt_tokens_details.cached_tokens`` (None: not
            reported).
        model_cached_tokens: the paged prefix-cache model's prediction.
        radix_cached_tokens: the token-level radix model's prediction.
        ttft_s: time to first token, seconds (streaming).
        answer: the generated text (a real model's answer; one token of noise with random
            weights).
    """

    rid: str
    prompt_tokens: int
    local_prompt_tokens: int
    cached_tokens: int | None
    model_cached_tokens: int
    radix_cached_tokens: int
    ttft_s: float
    answer: str | None = None


@dataclass
class EngineMethodReport:
    """One method's figures on the real engine, beside the models' predictions.

    Token figures are prompt tokens; ratios are cached / prompt tokens. ``model_error`` is
    ``(model hit ratio - engine hit ratio) / engine hit ratio`` (None when the engine hit
    nothing). TTFT in seconds; ``prefill_tokens_per_s`` is the sum of uncached prompt tokens
    over the sum of TTFTs. Event figures count what arrived while the method ran: batches
    received, blocks stored and removed (the engine link's mirror). Eviction figures are
    ContextPilot's (None for the other methods), from its engine link
    (``pilot.stats()["sync"]``) while it planned: notices (requests whose cached chain the
    engine broke, ``source.mirror.evicted_requests``) and evictions applied (of those, the ones
    its index still held, ``evictions["kv-events"]``).
    """

    method: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    model_cached_tokens: int
    model_hit_ratio: float
    model_error: float | None
    model_exact_requests: int
    radix_cached_tokens: int
    radix_hit_ratio: float
    radix_error: float | None
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    prefill_tokens: int
    prefill_tokens_per_s: float
    prompt_token_mismatches: int
    event_batches: int
    blocks_stored: int
    blocks_removed: int
    eviction_notices: int | None
    evictions_applied: int | None
    model_evicted_rids: int
    index_requests: int | None = None
    seconds: float = 0.0

    @classmethod
    def build(
        cls,
        method: str,
        requests: Sequence[EngineRequest],
        events: Mapping[str, int],
        *,
        evictions: Mapping[str, int] | None = None,
        model_evicted_rids: int,
        index_requests: int | None,
        seconds: float,
    ) -> EngineMethodReport:
        """Sum ``requests``; ``events`` has ``batches``, ``stored``, ``removed``;
        ``evictions`` (ContextPilot only) has ``notices`` and ``applied``."""
        prompt = sum(r.prompt_tokens for r in requests)
        cached = sum(r.cached_tokens or 0 for r in requests)
        local = sum(r.local_prompt_tokens for r in requests)
        model = sum(r.model_cached_tokens for r in requests)
        radix = sum(r.radix_cached_tokens for r in requests)
        hit = cached / prompt if prompt else 0.0
        model_hit = model / local if local else 0.0
        radix_hit = radix / local if local else 0.0
        ttfts = np.array([r.ttft_s for r in requests], dtype=float)
        prefill = prompt - cached
        return cls(
            method=method,
            requests=len(requests),
            prompt_tokens=prompt,
            cached_tokens=cached,
            hit_ratio=hit,
            model_cached_tokens=model,
            model_hit_ratio=model_hit,
            model_error=(model_hit - hit) / hit if hit else None,
            model_exact_requests=sum(r.model_cached_tokens == r.cached_tokens for r in requests),
            radix_cached_tokens=radix,
            radix_hit_ratio=radix_hit,
            radix_error=(radix_hit - hit) / hit if hit else None,
            ttft_mean_s=float(ttfts.mean()) if ttfts.size else math.nan,
            ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts.size else math.nan,
            ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts.size else math.nan,
            prefill_tokens=prefill,
            prefill_tokens_per_s=prefill / float(ttfts.sum()) if ttfts.size else math.nan,
            prompt_token_mismatches=sum(r.prompt_tokens != r.local_prompt_tokens for r in requests),
            event_batches=events["batches"],
            blocks_stored=events["stored"],
            blocks_removed=events["removed"],
            eviction_notices=evictions["notices"] if evictions is not None else None,
            evictions_applied=evictions["applied"] if evictions is not None else None,
            model_evicted_rids=model_evicted_rids,
            index_requests=index_requests,
            seconds=seconds,
        )


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _evictions(report: EngineMethodReport) -> str:
    if report.evictions_applied is None or report.eviction_notices is None:
        return "n/a"
    return f"{report.evictions_applied:,}/{report.eviction_notices:,}"


def format_engine_table(reports: Sequence[EngineMethodReport]) -> str:
    """The engine-vs-model table, one row per method that ran on the engine."""
    columns: list[tuple[str, Callable[[EngineMethodReport], str]]] = [
        ("method", lambda r: r.method),
        ("requests", lambda r: f"{r.requests:,}"),
        ("engine hit", lambda r: f"{r.hit_ratio:.4f}"),
        ("model hit", lambda r: f"{r.model_hit_ratio:.4f}"),
        ("model vs engine", lambda r: _fmt(r.model_error, "+.1%")),
        ("exact", lambda r: f"{r.model_exact_requests}/{r.requests}"),
        ("radix model hit", lambda r: f"{r.radix_hit_ratio:.4f}"),
        ("TTFT p50 s", lambda r: _fmt(r.ttft_p50_s, ".3f")),
        ("TTFT p90 s", lambda r: _fmt(r.ttft_p90_s, ".3f")),
        ("prefill tok/s", lambda r: _fmt(r.prefill_tokens_per_s, ",.0f")),
        ("KV batches", lambda r: f"{r.event_batches:,}"),
        ("stored/removed", lambda r: f"{r.blocks_stored:,}/{r.blocks_removed:,}"),
        ("evictions applied", _evictions),
    ]
    cells = [[str(get(r)) for _, get in columns] for r in reports]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _) in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            [values[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(values[1:], widths[1:]))]
        )

    return "\n".join(
        [line([t for t, _ in columns]), "  ".join("-" * w for w in widths), *map(line, cells)]
    )


def target_lines(reports: Sequence[EngineMethodReport], k: int, kv: KVCacheSize) -> list[str]:
    """The targets, judged on this run (they are set for k=10 and a 5% KV cache)."""
    by_name = {r.method: r for r in reports}
    base, pilot = by_name.get("baseline"), by_name.get("contextpilot")
    lines = []
    applies = k == 10 and kv.spec.strip() in ("0.05", ".05")
    note = "" if applies else "the targets are set for k=10 and --engine-kv-tokens 0.05"
    if base is not None and pilot is not None:
        if base.hit_ratio:
            gain = pilot.hit_ratio / base.hit_ratio
            verdict = "ok" if gain >= 3 else "MISSED"
            lines.append(
                f"engine hit ratio, contextpilot / baseline: {gain:.2f}x (>= 3x: {verdict})"
            )
        else:
            lines.append("engine hit ratio: the baseline hit nothing")
        if pilot.ttft_p50_s > 0:
            speedup = base.ttft_p50_s / pilot.ttft_p50_s
            verdict = "ok" if speedup >= 1.5 else "MISSED"
            lines.append(
                f"median TTFT, baseline / contextpilot: {speedup:.2f}x lower "
                f"({base.ttft_p50_s:.3f} s -> {pilot.ttft_p50_s:.3f} s) (>= 1.5x: {verdict})"
            )
    for r in reports:
        if r.requests and r.model_error is not None:
            verdict = "ok" if abs(r.model_error) <= 0.15 else "MISSED"
            lines.append(
                f"{r.method}: model hit ratio {r.model_hit_ratio:.4f} vs engine "
                f"{r.hit_ratio:.4f}: {r.model_error:+.1%} (within 15%: {verdict}); "
                f"token-level radix model {r.radix_hit_ratio:.4f} "
                f"({_fmt(r.radix_error, '+.1%')})"
            )
    if note and lines:
        lines.append(note)
    return lines
