"""The real engine's sizes for a workload: ``max_model_len`` and the KV cache in whole blocks.

- :func:`max_model_len_for`: the longest prompt of the workload as the engine tokenizes it,
  plus what ContextPilot's prompts add (the order annotation), rounded up to whole blocks.
- :func:`size_kv_cache`: ``--engine-kv-tokens`` (tokens, a fraction of the workload's unique
  block tokens, or ``unlimited``) in whole blocks, raised, when smaller, to what one request of
  ``max_model_len`` tokens needs (the engine cannot schedule a request its cache cannot hold).
  vLLM gets ``--num-gpu-blocks-override`` = usable blocks + 1: its block pool reserves one null
  block (``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from contextpilot_bench.methods import (
    PreparedWorkload,
    parse_cache_tokens,
    resolve_cache_tokens,
)

__all__ = ["ANSWER_TOKENS", "KVCacheSize", "max_model_len_for", "size_kv_cache"]

ANSWER_TOKENS = 1
"""Tokens generated per request: prefill is what is measured."""

ChatTokenizer = Callable[[Sequence[Mapping[str, str]]], Sequence[int]]
"""Chat messages -> the token ids the engine prefills (chat template applied)."""


def max_model_len_for(
    prepared: PreparedWorkload,
    tokenize: ChatTokenizer,
    block_size: int,
    max_positions: int,
    *,
    answer_tokens: int = ANSWER_TOKENS,
) -> tuple[int, int]:
    """``(max_model_len, longest prompt)`` for the workload on the engine, in tokens.

    The longest prompt is the longest baseline prompt (the layout's chat messages, tokenised by
    ``tokenize``); ContextPilot's prompts hold the same blocks plus an order annotation, whose
    tokens for ``k`` labels (``prepared.counter``) are added, with 16 tokens of slack and the
    ``answer_tokens`` generated; the result is rounded up to whole blocks.

    Raises:
        ValueError: it exceeds the model's ``max_positions``.
    """
    layout = prepared.layout
    longest = 0
    for i, request in enumerate(prepared.workload.requests):
        messages = layout.render_messages(prepared.block_texts(i), request.query)
        longest = max(longest, len(tokenize(messages)))
    labels = [layout.label(i) for i in range(prepared.k)]
    annotation = prepared.counter.count(layout.annotation(labels))
    needed = longest + annotation + 16 + answer_tokens
    length = -(-needed // block_size) * block_size
    if length > max_positions:
        raise ValueError(
            f"the longest prompt needs max_model_len {length} tokens, more than the model's "
            f"max_position_embeddings {max_positions}; use a smaller --top-k"
        )
    return length, longest


@dataclass(frozen=True)
class KVCacheSize:
    """The engine's KV cache for a run.

    Attributes:
        spec: the ``--engine-kv-tokens`` text.
        block_size: tokens per KV block.
        requested_tokens: what the spec resolves to (None: unlimited, the engine's memory).
        usable_blocks: blocks the engine can fill (None: decided by the engine).
        raised_from_blocks: the requested block count when it was raised to hold one request
            of ``max_model_len`` tokens (None when not raised).
        unique_block_tokens: the workload's unique block tokens (model tokenizer).
    """

    spec: str
    block_size: int
    requested_tokens: int | None
    usable_blocks: int | None
    raised_from_blocks: int | None
    unique_block_tokens: int

    @property
    def num_gpu_blocks(self) -> int | None:
        """``--num-gpu-blocks-override``: usable blocks plus vLLM's null block."""
        return None if self.usable_blocks is None else self.usable_blocks + 1

    @property
    def usable_tokens(self) -> int | None:
        """Usable blocks in tokens (None: decided by the engine)."""
        return None if self.usable_blocks is None else self.usable_blocks * self.block_size

    def describe(self) -> str:
        """One line for the report, e.g. ``KV cache 63 blocks = 2,016 tokens (0.05 of ...)``."""
        if self.usable_blocks is None:
            return "KV cache sized by the engine (VLLM_CPU_KVCACHE_SPACE)"
        text = f"KV cache {self.usable_blocks:,} blocks = {self.usable_tokens:,} tokens"
        if _fraction(self.spec) is not None:
            text += (
                f" ({self.spec} of {self.unique_block_tokens:,} unique block tokens = "
                f"{self.requested_tokens:,} tokens"
            )
        else:
            text += f" (requested {self.requested_tokens:,} tokens"
        if self.raised_from_blocks is not None:
            text += (
                f", {self.raised_from_blocks:,} blocks, raised to hold one request of "
                "max_model_len tokens"
            )
        return text + ")"


def _fraction(spec: str) -> float | None:
    with contextlib.suppress(ValueError):
        value = parse_cache_tokens(spec)
        if isinstance(value, float):
            return value
    return None


def size_kv_cache(
    spec: str, unique_block_tokens: int, block_size: int, max_model_len: int
) -> KVCacheSize:
    """Resolve ``--engine-kv-tokens`` into whole blocks.

    Args:
        spec: an int (tokens), a decimal fraction of ``unique_block_tokens`` (``0.05``), or
            ``unlimited`` (the engine sizes its cache from its memory setting).
        unique_block_tokens: the workload's unique block tokens (model tokenizer).
        block_size: tokens per block.
        max_model_len: the engine's longest request; the cache holds at least one.

    Raises:
        ValueError: a bad ``spec`` (the message names ``--engine-kv-tokens`` and the value).
    """
    try:
        parsed = parse_cache_tokens(spec)
    except ValueError:
        raise ValueError(
            f"--engine-kv-tokens must be an int (tokens), a fraction such as 0.05, or "
            f"'unlimited'; got {spec!r}"
        ) from None
    if parsed is None:
        return KVCacheSize(spec, block_size, None, None, None, unique_block_tokens)
    requested = resolve_cache_tokens(parsed, unique_block_tokens)
    assert requested is not None
    blocks = -(-requested // block_size)
    minimum = -(-max_model_len // block_size)
    raised = blocks if blocks < minimum else None
    return KVCacheSize(
        spec, block_size, requested, max(blocks, minimum), raised, unique_block_tokens
    )
