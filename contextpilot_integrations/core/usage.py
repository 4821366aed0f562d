"""The engine's own figures for planned requests, added up: prompt, cached and written tokens.

Engines report how much of a prompt they served from their prefix cache as
``usage.prompt_tokens_details.cached_tokens`` (OpenAI's API; SGLang; vLLM with
``--enable-prompt-tokens-details``) or ``cache_read_input_tokens`` (Anthropic, which also
reports what a request wrote to the cache, ``cache_creation_input_tokens``);
:func:`contextpilot_integrations.llm_call.engine_fields.read_usage` parses them and the planner's
``record_usage`` adds them here.
"""

from __future__ import annotations

import threading

__all__ = ["UsageCounter"]


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
