"""The benchmark's hosted-API mode: what the requests cost on Anthropic's or OpenAI's prompt cache.

``contextpilot-bench --engine hosted-anthropic --rate 1 --price-write 1.25 --price-read 0.1``
replays the workload's requests, arriving as a seeded Poisson process of ``--rate`` requests per
second in virtual time (``--arrival replay`` for a workload's own times), through a model of the
provider's cache (:mod:`~contextpilot_bench.hosted_cache_model`), once per method:

``baseline``
    What a careful user does without ContextPilot: retriever order; on Anthropic a breakpoint
    after the system prompt and one after the documents; on OpenAI no ``prompt_cache_key``.
``contextpilot``
    :meth:`ContextPilot.plan` one request at a time; the plan's breakpoints
    (:func:`~contextpilot_integrations.llm_call.hosted_cache.anthropic_prompt`: after the system
    prompt and after the prefix shared with indexed requests) or its ``prompt_cache_key``; the usage
    read back into the pilot (:meth:`ContextPilot.record_usage`: a read or a write refreshes the
    request, a request that cached nothing is evicted) and a
    :class:`~contextpilot_integrations.sync.ttl_model.TTLModel` on the virtual clock that
    evicts requests unused for the provider's lifetime.

The report gives per method the prompt tokens, cache reads, cache writes, uncached input and
the input cost in base-price tokens, ``input + price_write * writes + price_read * reads``,
against the baseline's. The price ratios are options (the provider's price list is theirs to
change): Anthropic publishes 1.25 (5-minute writes), 2 (1-hour writes) and 0.1 (reads) times
the base input price. Every Anthropic request is checked against the provider's rules: at most
four breakpoints, none whose prefix is below the model's minimum (``--hosted-model``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from contextpilot_bench.hosted_cache_model import (
    AnthropicCacheModel,
    OpenAICacheModel,
)
from contextpilot_bench.methods import PreparedWorkload
from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    AnthropicCachePolicy,
    AnthropicPrompt,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.engine_fields import CacheUsageTracker
from contextpilot_integrations.llm_call.openai_cache_key import prompt_cache_key
from contextpilot_integrations.sync.cache_state_source import SentRequest
from contextpilot_integrations.sync.ttl_model import TTLModel

__all__ = [
    "HOSTED_ENGINES",
    "HOSTED_METHODS",
    "HOSTED_TARGET",
    "HostedResult",
    "HostedSettings",
    "format_hosted_table",
    "hosted_rows",
    "run_hosted",
]

HOSTED_ENGINES = ("hosted-anthropic", "hosted-openai")
HOSTED_METHODS = ("baseline", "contextpilot")
HOSTED_TARGET = 0.6
"""ContextPilot's input cost at most this share of the baseline's (Anthropic, 5-minute ratios)."""


@dataclass(frozen=True)
class HostedSettings:
    """One hosted run's provider settings.

    Attributes:
        provider: ``"anthropic"`` or ``"openai"``.
        price_write: cache-write price over the base input price (Anthropic; OpenAI writes are
            not billed apart and not reported).
        price_read: cache-read price over the base input price.
        model: the model id (Anthropic: its minimum cacheable length).
        min_tokens: the minimum cacheable prefix (``None``: by ``model``).
        ttl: Anthropic's ``"5m"`` or ``"1h"``.
        retention: OpenAI's ``prompt_cache_retention`` (passed through; the model keeps the
            in-memory lifetime, the documented lower bound).
        documents: Anthropic breakpoint after ContextPilot's documents (``"conversation"``:
            in a conversation only, as the library does by default).
    """

    provider: Literal["anthropic", "openai"]
    price_write: float
    price_read: float
    model: str | None = None
    min_tokens: int | None = None
    ttl: Literal["5m", "1h"] = "5m"
    retention: Literal["in_memory", "24h"] | None = None
    documents: Literal["conversation", "always", "never"] = "conversation"

    @property
    def ttl_s(self) -> float:
        return 3600.0 if self.provider == "anthropic" and self.ttl == "1h" else 300.0

    def policy(self, *, baseline: bool) -> AnthropicCachePolicy:
        """The breakpoint policy of a method (the baseline: system prompt and documents end)."""
        if baseline:
            return AnthropicCachePolicy(
                model=self.model,
                min_tokens=self.min_tokens,
                ttl=self.ttl,
                shared_prefix=False,
                history=False,
                documents="always",
            )
        return AnthropicCachePolicy(
            model=self.model, min_tokens=self.min_tokens, ttl=self.ttl, documents=self.documents
        )


@dataclass
class HostedResult:
    """One method's run on the hosted cache model (token totals over the run)."""

    method: str
    requests: int = 0
    prompt_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    input_tokens: int = 0
    max_breakpoints: int = 0
    breakpoints_below_minimum: int = 0
    uncached_requests: int = 0
    plan_seconds: float = 0.0
    price_write: float = 1.0
    price_read: float = 1.0
    usage: dict[str, Any] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)

    @property
    def input_cost(self) -> float:
        """Input cost in base-price tokens."""
        return (
            self.input_tokens
            + self.price_write * self.cache_write_tokens
            + self.price_read * self.cache_read_tokens
        )


def run_hosted(
    prepared: PreparedWorkload,
    times_s: Sequence[float],
    settings: HostedSettings,
    methods: Sequence[str] = HOSTED_METHODS,
) -> list[HostedResult]:
    """Run ``methods`` on a fresh provider cache model each, requests in ``prepared``'s order
    arriving at ``times_s`` (seconds, non-decreasing, one per request).

    Raises:
        ValueError: an unknown method, or ``times_s`` of another length than the requests.
        TooManyBreakpoints: a request with more breakpoints than the provider accepts.
    """
    if len(times_s) != len(prepared.retrieved):
        raise ValueError(f"need {len(prepared.retrieved)} arrival times, got {len(times_s)}")
    unknown = [m for m in methods if m not in HOSTED_METHODS]
    if unknown:
        raise ValueError(f"hosted methods are {list(HOSTED_METHODS)}, got {unknown}")
    return [_run(method, prepared, times_s, settings) for method in methods]


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(
    method: str, prepared: PreparedWorkload, times_s: Sequence[float], settings: HostedSettings
) -> HostedResult:
    result = HostedResult(method, price_write=settings.price_write, price_read=settings.price_read)
    counter, layout = prepared.counter, prepared.layout
    model: AnthropicCacheModel | OpenAICacheModel
    if settings.provider == "anthropic":
        minimum = settings.policy(baseline=False).min_cacheable_tokens
        model = AnthropicCacheModel(settings.ttl_s, minimum)
    else:
        model = OpenAICacheModel(settings.ttl_s)
    clock = _Clock()
    pilot = ContextPilot(layout=layout, token_counter=counter) if method == "contextpilot" else None
    tracker = CacheUsageTracker(pilot)
    # The pilot follows the provider as the library does: the TTL preset on the virtual clock
    # (the model's minimum, the lifetime), refreshed by the reads and writes read back.
    ttl = None
    if pilot is not None and settings.provider == "anthropic":
        given = {} if settings.min_tokens is None else {"min_cached_tokens": settings.min_tokens}
        one_hour = settings.ttl == "1h"
        ttl = TTLModel.anthropic(
            pilot.evict, one_hour=one_hour, model=settings.model, clock=clock, **given
        )
    elif pilot is not None:
        ttl = TTLModel.openai(pilot.evict, clock=clock)
    units_memo: dict[str, tuple[int, int]] = {}

    def units(texts: Sequence[str]) -> list[tuple[int, int]]:
        out = []
        for text in texts:
            unit = units_memo.get(text)
            if unit is None:
                unit = units_memo[text] = (block_id(text), counter.count(text))
            out.append(unit)
        return out

    for i, request in enumerate(prepared.workload.requests):
        clock.now = float(times_s[i])
        texts = prepared.block_texts(i)
        if pilot is None:
            rid = f"baseline-{request.id}"
            segments = layout.render_segments(texts, request.query)
            messages = layout.messages_from_segments(segments)
            prefix = CachePrefix(tuple(segments[1:-1]))
            plan = None
        else:
            if ttl is not None:
                ttl.expire()  # what the provider dropped by now is not planned against
            started = time.perf_counter()
            plan = pilot.plan(request.query, texts, rid=f"contextpilot-{request.id}")
            result.plan_seconds += time.perf_counter() - started
            rid, messages, prefix = plan.rid, plan.messages, CachePrefix.of(plan)
            segments = list(plan.segments)
        if isinstance(model, AnthropicCacheModel):
            prompt = _anthropic(messages, prefix, settings, baseline=pilot is None, counter=counter)
            texts_sent = [b["text"] for b in [*(prompt.system or []), *_content(prompt)]]
            marks = [
                j
                for j, b in enumerate([*(prompt.system or []), *_content(prompt)])
                if "cache_control" in b
            ]
            result.max_breakpoints = max(result.max_breakpoints, len(marks))
            result.breakpoints_below_minimum += sum(
                bp.tokens < model.min_tokens for bp in prompt.breakpoints
            )
            usage = model.serve(clock.now, units(texts_sent), marks)
        else:
            # The system message, then the user message block by block (cache hits end at
            # block boundaries in this model).
            texts_sent = [m["content"] for m in messages[:-1]] + [t for t in segments[1:] if t]
            key = prompt_cache_key(prefix) if pilot is not None else None
            usage = model.serve(clock.now, units(texts_sent), key)
        result.requests += 1
        result.prompt_tokens += usage.prompt_tokens
        result.cache_read_tokens += usage.cache_read_tokens
        result.cache_write_tokens += usage.cache_write_tokens or 0
        result.input_tokens += usage.input_tokens
        if ttl is not None and plan is not None:
            ttl.record(SentRequest.from_plan(plan))
        read = tracker.record(rid, usage.response())
        if read is not None and read.uncached:
            result.uncached_requests += 1
        if ttl is not None and read is not None and (read.cached_tokens or read.cache_write_tokens):
            ttl.touch(rid)
    result.usage = tracker.stats()
    if pilot is not None:
        result.index = {k: v for k, v in pilot.stats().items() if k in ("requests", "tokens")}
    return result


def _anthropic(
    messages: Sequence[dict[str, Any]],
    prefix: CachePrefix,
    settings: HostedSettings,
    *,
    baseline: bool,
    counter: Any,
) -> AnthropicPrompt:
    return anthropic_prompt(messages, prefix, settings.policy(baseline=baseline), counter)


def _content(prompt: AnthropicPrompt) -> list[dict[str, Any]]:
    return [block for message in prompt.messages for block in message["content"]]


HOSTED_COLUMNS = (
    ("method", "method", "{}"),
    ("requests", "requests", "{:,}"),
    ("prompt_tokens", "prompt tokens", "{:,}"),
    ("cache_read_tokens", "cache reads", "{:,}"),
    ("cache_write_tokens", "cache writes", "{}"),
    ("input_tokens", "uncached input", "{:,}"),
    ("input_cost", "input cost", "{:,.0f}"),
    ("vs_baseline", "vs baseline", "{}"),
    ("max_breakpoints", "max breakpoints", "{}"),
)


def hosted_rows(results: Sequence[HostedResult], provider: str) -> list[dict[str, Any]]:
    """One row per method (``vs_baseline``: input cost over the baseline's, or None)."""
    base = next((r.input_cost for r in results if r.method == "baseline"), None)
    rows = []
    for r in results:
        rows.append(
            {
                "method": r.method,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "cache_read_tokens": r.cache_read_tokens,
                "cache_write_tokens": r.cache_write_tokens if provider == "anthropic" else None,
                "input_tokens": r.input_tokens,
                "input_cost": r.input_cost,
                "vs_baseline": round(r.input_cost / base, 4) if base else None,
                "max_breakpoints": r.max_breakpoints if provider == "anthropic" else None,
                "breakpoints_below_minimum": r.breakpoints_below_minimum,
                "uncached_requests": r.uncached_requests,
                "plan_seconds": round(r.plan_seconds, 3),
            }
        )
    return rows


def format_hosted_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table (``n/a`` for figures the provider does not report)."""
    header = [title for _, title, _ in HOSTED_COLUMNS]
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in HOSTED_COLUMNS:
            value = row.get(key)
            if value is None:
                cells.append("n/a")
            elif key == "vs_baseline":
                cells.append(f"{value:.3f}")
            elif key == "cache_write_tokens":
                cells.append(f"{value:,}")
            else:
                cells.append(fmt.format(value))
        body.append(cells)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for cells in body:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )
        )
    return "\n".join(lines)
