"""The engine's own figures for planned requests, added up: prompt tokens, cached tokens.

Engines report how much of a prompt they served from their prefix cache as
``usage.prompt_tokens_details.cached_tokens`` (OpenAI's API; SGLang; vLLM with
``--enable-prompt-tokens-details``); :func:`contextpilot_integrations.engine_fields.read_usage`
parses it and the planner's ``record_usage`` adds it here.
"""

from __future__ import annotations

import threading

__all__ = ["UsageCounter"]


class UsageCounter:
    """Thread-safe running totals of the engine-reported usage (tokens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {"reports": 0, "prompt_tokens": 0, "cached_tokens": 0}

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One request's figures.

        Raises:
            TypeError / ValueError: figures that are not ints with
                ``0 <= cached_tokens <= prompt_tokens``.
        """
        for name, value in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(
                f"need 0 <= cached_tokens <= prompt_tokens, got cached_tokens={cached_tokens}, "
                f"prompt_tokens={prompt_tokens}"
            )
        with self._lock:
            self._totals["reports"] += 1
            self._totals["prompt_tokens"] += prompt_tokens
            self._totals["cached_tokens"] += cached_tokens

    def stats(self) -> dict[str, float]:
        """``reports``, ``prompt_tokens``, ``cached_tokens`` and ``hit_ratio`` (cached over
        prompt tokens; 0.0 before any report)."""
        with self._lock:
            out: dict[str, float] = dict(self._totals)
        out["hit_ratio"] = (
            out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
        )
        return out
