"""The hosted providers' minimum cacheable prompt lengths, in tokens.

Below its minimum a provider serves the request uncached, and says nothing. Two readers need
the same figures: the Anthropic breakpoints (:mod:`.anthropic_breakpoints`: no breakpoint whose
prefix is shorter) and the TTL cache model (``contextpilot_integrations.sync.ttl_model``: a
shorter prompt is never cached). This module imports nothing, so either side reads it without
the other.

- OpenAI ("Prompt caching" guide): prompts of 1,024 tokens or more are cached.
- Anthropic ("Prompt caching", "Cache limitations"): per model, 4,096 tokens for Claude
  Opus 4.7, 4.6, 4.5 and Haiku 4.5; 2,048 for Claude Haiku 3.5 and 3; 1,024 for Claude
  Sonnet 4.6, 4.5, 4, Opus 4.1, 4 and Sonnet 3.7. Minimums change with new models: every
  reader takes an override.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ANTHROPIC_MIN_CACHEABLE_TOKENS",
    "DEFAULT_ANTHROPIC_MIN_TOKENS",
    "OPENAI_MIN_CACHED_TOKENS",
    "anthropic_min_cacheable_tokens",
]

OPENAI_MIN_CACHED_TOKENS = 1024
"""OpenAI caches prompts of at least this many tokens."""

DEFAULT_ANTHROPIC_MIN_TOKENS = 1024
"""Anthropic's minimum cacheable prefix for a model the table does not name."""

ANTHROPIC_MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    ("claude-opus-4-7", 4096),
    ("claude-opus-4-6", 4096),
    ("claude-opus-4-5", 4096),
    ("claude-haiku-4-5", 4096),
    ("claude-3-5-haiku", 2048),
    ("claude-3-haiku", 2048),
    ("claude-sonnet-4-6", 1024),
    ("claude-sonnet-4-5", 1024),
    ("claude-sonnet-4", 1024),
    ("claude-opus-4-1", 1024),
    ("claude-opus-4", 1024),
    ("claude-3-7-sonnet", 1024),
)
"""Anthropic model-id prefix -> minimum cacheable prompt length in tokens (the longest matching
prefix wins)."""


def anthropic_min_cacheable_tokens(
    model: str | None, overrides: Mapping[str, int] | None = None
) -> int:
    """The minimum cacheable prefix of ``model`` (tokens): the longest model-id prefix in
    ``overrides``, then in :data:`ANTHROPIC_MIN_CACHEABLE_TOKENS`, that ``model`` starts with;
    :data:`DEFAULT_ANTHROPIC_MIN_TOKENS` for an unknown or absent model."""
    if model:
        for table in (overrides or {}).items(), ANTHROPIC_MIN_CACHEABLE_TOKENS:
            matches = [(len(p), tokens) for p, tokens in table if model.startswith(p)]
            if matches:
                return max(matches)[1]
    return DEFAULT_ANTHROPIC_MIN_TOKENS
