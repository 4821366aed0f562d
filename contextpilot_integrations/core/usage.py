"""Running totals of planned requests: the engine's own usage figures, and what plans removed.

:class:`UsageCounter` adds up the engine's figures (prompt, cached and written tokens) over
every report. :class:`ConversationTotals` keeps, overall, per tenant and per
``(tenant, conversation_id)``, the tokens de-duplication removed from the prompts (by the
pilot's token counter) next to the cached tokens the engine reported for those prompts, so a
conversation's saving and its cache hits read side by side (docs/DESIGN.md, "Conversations and
de-duplication"). Both are running totals since the pilot was made (a snapshot does not keep
them).

Engines report how much of a prompt they served from their prefix cache as
``usage.prompt_tokens_details.cached_tokens`` (OpenAI's API; SGLang; vLLM with
``--enable-prompt-tokens-details``) or ``cache_read_input_tokens`` (Anthropic, which also
reports what a request wrote to the cache, ``cache_creation_input_tokens``);
:func:`contextpilot_integrations.llm_call.engine_fields.read_usage` parses them and the planner's
``record_usage`` adds them here.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from contextpilot_integrations.core.lru import LRU

__all__ = [
    "RIDS_REMEMBERED",
    "TOTAL_FIELDS",
    "ConversationTotals",
    "UsageCounter",
    "check_usage",
]

TOTAL_FIELDS = (
    "plans",
    "tokens_removed",
    "blocks_replaced",
    "sub_blocks_replaced",
    "usage_reports",
    "prompt_tokens",
    "cached_tokens",
)
"""The figures of every :class:`ConversationTotals` entry (all ints): plans made, tokens
their de-duplication removed (``DedupFigures.tokens_saved``, by the pilot's token counter),
blocks replaced by a hint, sub-blocks replaced by a pointer, and the engine's usage reports of
those plans with their ``prompt_tokens`` and ``cached_tokens``."""

RIDS_REMEMBERED = 65_536
"""Plans whose rid :class:`ConversationTotals` maps to its conversation, most recent first: a
usage report for an older rid adds to the overall figures only."""

K = TypeVar("K")


def check_usage(
    prompt_tokens: int, cached_tokens: int, cache_write_tokens: int | None = None
) -> None:
    """Check one usage report's figures (``cache_write_tokens``: ``None`` where the provider
    reports no writes).

    Raises:
        TypeError / ValueError: figures that are not ints with
            ``0 <= cached_tokens + cache_write_tokens <= prompt_tokens``.
    """
    figures = [("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)]
    if cache_write_tokens is not None:
        figures.append(("cache_write_tokens", cache_write_tokens))
    for name, value in figures:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    written = cache_write_tokens or 0
    if min(cached_tokens, written) < 0 or cached_tokens + written > prompt_tokens:
        raise ValueError(
            f"need 0 <= cached_tokens + cache_write_tokens <= prompt_tokens, got "
            f"cached_tokens={cached_tokens}, cache_write_tokens={cache_write_tokens}, "
            f"prompt_tokens={prompt_tokens}"
        )


class UsageCounter:
    """Thread-safe running totals of the engine-reported usage (tokens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {
            "reports": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "uncached_reports": 0,
        }

    def add(
        self, prompt_tokens: int, cached_tokens: int, cache_write_tokens: int | None = None
    ) -> None:
        """One request's figures (``cache_write_tokens``: ``None`` where the provider reports
        no writes).

        Raises:
            TypeError / ValueError: figures that are not ints with
                ``0 <= cached_tokens + cache_write_tokens <= prompt_tokens``.
        """
        check_usage(prompt_tokens, cached_tokens, cache_write_tokens)
        written = cache_write_tokens or 0
        with self._lock:
            self._totals["reports"] += 1
            self._totals["prompt_tokens"] += prompt_tokens
            self._totals["cached_tokens"] += cached_tokens
            self._totals["cache_write_tokens"] += written
            self._totals["uncached_reports"] += cache_write_tokens == 0 and cached_tokens == 0

    def stats(self) -> dict[str, float]:
        """``reports``, ``prompt_tokens``, ``cached_tokens``, ``cache_write_tokens``,
        ``uncached_reports`` (reports of a provider that reports writes, where the request
        neither read nor wrote the cache) and ``hit_ratio`` (cached over prompt tokens; 0.0
        before any report)."""
        with self._lock:
            out: dict[str, float] = dict(self._totals)
        out["hit_ratio"] = (
            out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
        )
        return out


class ConversationTotals:
    """Thread-safe running totals (:data:`TOTAL_FIELDS`) overall, per tenant and per
    ``(tenant, conversation_id)``.

    Conversations are keyed by tenant and id together: two tenants that use the same
    conversation id never add to one entry (docs/DESIGN.md, "Isolation").

    Args:
        max_conversations: conversations kept (LRU, the most recently planned or reported).
        max_tenants: tenants kept (LRU); a tenant dropped starts from zero when it is back.

    Raises:
        ValueError: a bound that is not a positive int.

    Bounded (docs/DESIGN.md, "Bounded"): the conversations, the tenants, the rids of the last
    :data:`RIDS_REMEMBERED` plans (to tie a usage report to its conversation) and of as many
    usage reports (to count each request once) are LRUs.
    """

    def __init__(self, max_conversations: int = 1024, max_tenants: int = 1024) -> None:
        for name, bound in (("max_conversations", max_conversations), ("max_tenants", max_tenants)):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name} must be an int >= 1, got {bound!r}")
        self._lock = threading.Lock()
        self._overall = dict.fromkeys(TOTAL_FIELDS, 0)
        self._tenants: LRU[str, dict[str, int]] = LRU(max_tenants)
        self._conversations: LRU[tuple[str, str], dict[str, int]] = LRU(max_conversations)
        self._rids: LRU[str, tuple[str, str | None]] = LRU(RIDS_REMEMBERED)
        self._reported: LRU[str, None] = LRU(RIDS_REMEMBERED)

    def add_plan(
        self,
        rid: str,
        tenant: str,
        conversation_id: str | None,
        tokens_removed: int,
        blocks_replaced: int = 0,
        sub_blocks_replaced: int = 0,
        *,
        plans: int = 1,
    ) -> None:
        """One plan's figures (``conversation_id`` ``None``: the tenant's and the overall
        figures only; ``plans`` 0: more figures of a plan counted already)."""
        with self._lock:
            self._rids.put(rid, (tenant, conversation_id))
            entries = self._entries(tenant, conversation_id)
            for entry in entries:
                entry["plans"] += plans
            if tokens_removed or blocks_replaced or sub_blocks_replaced:
                # Most plans remove nothing: they add to the count of plans only.
                for entry in entries:
                    entry["tokens_removed"] += tokens_removed
                    entry["blocks_replaced"] += blocks_replaced
                    entry["sub_blocks_replaced"] += sub_blocks_replaced

    def add_usage(self, rid: str, prompt_tokens: int, cached_tokens: int) -> bool:
        """One usage report of ``rid`` (figures checked by :func:`check_usage`): added
        overall, and to the tenant and conversation that planned ``rid`` when it is one of
        the rids remembered. A rid reported before (one of the last :data:`RIDS_REMEMBERED`
        reported) adds nothing: one request is one engine call, and two reporters of the
        same call (the service's proxy and its client) must not count it twice.

        Returns:
            Whether the report was added (False: ``rid`` was reported already).
        """
        with self._lock:
            if rid in self._reported:
                return False
            self._reported.put(rid, None)
            owner = self._rids.get(rid)
            entries = [self._overall] if owner is None else self._entries(*owner)
            for entry in entries:
                entry["usage_reports"] += 1
                entry["prompt_tokens"] += prompt_tokens
                entry["cached_tokens"] += cached_tokens
        return True

    def stats(self) -> dict[str, object]:
        """The overall figures, with ``tenants`` (``{tenant: figures}``) and
        ``conversations`` (``{tenant: {conversation_id: figures}}``), least recently used
        first."""
        with self._lock:
            conversations: dict[str, dict[str, dict[str, int]]] = {}
            for (tenant, conversation_id), figures in self._conversations.items():
                conversations.setdefault(tenant, {})[conversation_id] = dict(figures)
            return {
                **self._overall,
                "tenants": {tenant: dict(figures) for tenant, figures in self._tenants.items()},
                "conversations": conversations,
            }

    def tenant_stats(self, tenant: str) -> dict[str, object]:
        """``tenant``'s figures (zeros when none are held) with ``conversations``
        (``{tenant: {conversation_id: figures}}``, that tenant's only)."""
        with self._lock:
            own = self._tenants.peek(tenant)
            mine = {
                conversation_id: dict(figures)
                for (owner, conversation_id), figures in self._conversations.items()
                if owner == tenant
            }
        figures = dict(own) if own is not None else dict.fromkeys(TOTAL_FIELDS, 0)
        return {**figures, "conversations": {tenant: mine} if mine else {}}

    def _entries(self, tenant: str, conversation_id: str | None) -> list[dict[str, int]]:
        """The entries a figure of ``(tenant, conversation_id)`` adds to (made when missing,
        marked as just used)."""
        entries = [self._overall, _entry(self._tenants, tenant)]
        if conversation_id is not None:
            entries.append(_entry(self._conversations, (tenant, conversation_id)))
        return entries


def _entry(table: LRU[K, dict[str, int]], key: K) -> dict[str, int]:
    entry = table.get(key)
    if entry is None:
        entry = dict.fromkeys(TOTAL_FIELDS, 0)
        table.put(key, entry)
    return entry
