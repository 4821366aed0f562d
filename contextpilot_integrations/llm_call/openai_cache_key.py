"""OpenAI's prompt-cache request fields for a plan: ``prompt_cache_key`` and retention.

OpenAI ("Prompt caching", developers.openai.com/api/docs/guides/prompt-caching): caching is
automatic from a minimum prompt length (:mod:`.provider_minimums`), hits grow in 128-token
steps, requests are routed by a hash of the prompt's first ~256 tokens combined with the
optional ``prompt_cache_key`` (past ~15 requests a minute per prefix and key some overflow to
other machines), ``prompt_cache_retention`` is ``"in_memory"`` (5-10 minutes idle, at most an
hour) or ``"24h"``, and ``usage.prompt_tokens_details.cached_tokens`` reports the hit.
:func:`prompt_cache_key` gives requests whose aligned prefix starts alike one key.

Public API: :func:`prompt_cache_key`, :func:`openai_cache_fields`,
:data:`OPENAI_CACHE_STEP_TOKENS`.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from contextpilot_integrations.llm_call.cache_prefix import CachePrefix

__all__ = [
    "OPENAI_CACHE_STEP_TOKENS",
    "openai_cache_fields",
    "prompt_cache_key",
]

OPENAI_CACHE_STEP_TOKENS = 128
"""OpenAI's cache hits grow in steps of this many tokens past the minimum."""


def prompt_cache_key(prefix: CachePrefix, *, depth: int = 1) -> str:
    """OpenAI's ``prompt_cache_key`` for a plan: requests whose aligned prefix starts with the
    same ``depth`` blocks share it, in every process (a hash of the block ids and the tenant's
    salt; never the text).

    Why the leading blocks and not the whole shared prefix: a group's first request cannot know
    how far later requests will share it, and a key that grew with the shared prefix would send
    the later ones to other machines than the one holding the first request's prefix. Every
    request of a prefix group starts with the group's first block, so ``depth=1`` keeps a
    group on one route; a larger ``depth`` splits a popular first block's traffic (OpenAI
    overflows a prefix and key past ~15 requests a minute) at the price of misses where groups
    diverge earlier.

    Raises:
        ValueError: ``depth`` < 1.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth!r}")
    digest = hashlib.blake2b(digest_size=12)
    digest.update((prefix.salt or "").encode("utf-8") + b"\x00")
    for block in prefix.block_ids[:depth]:
        digest.update(block.to_bytes(8, "big"))
    return f"cp-{digest.hexdigest()}"


def openai_cache_fields(
    prefix: CachePrefix,
    *,
    retention: Literal["in_memory", "24h"] | None = None,
    depth: int = 1,
) -> dict[str, str]:
    """The OpenAI request fields for a plan: ``prompt_cache_key`` (:func:`prompt_cache_key`)
    and, when given, ``prompt_cache_retention`` (passed through).

    Raises:
        ValueError: an unknown ``retention`` or a bad ``depth``.
    """
    fields = {"prompt_cache_key": prompt_cache_key(prefix, depth=depth)}
    if retention is not None:
        if retention not in ("in_memory", "24h"):
            raise ValueError(f"retention must be 'in_memory' or '24h', got {retention!r}")
        fields["prompt_cache_retention"] = retention
    return fields
