"""The engines the benchmark sends prompts through: the interface, and the embedded model.

An :class:`Engine` runs one method's prompts on an empty cache (a fresh engine per method) and
says how the planner under test learns what it evicts: either the engine reports evicted request
ids itself (:meth:`Engine.take_evicted_rids`: the embedded model), or the planner follows the
engine's cache through the core's engine link (:attr:`Engine.cache_sync`:
``ContextPilot(engine=EngineLink(engine.cache_sync))``, the KV events of a real engine).

Implementations: :class:`EmbeddedEngine` (the prefix-cache model, here),
:class:`~contextpilot_bench.engine_client.OpenAIEngine` (any OpenAI-compatible
server) and :class:`~contextpilot_bench.vllm_engine.VllmCpuEngine` (vLLM's CPU
build, with the models fed the same tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_integrations.core.blocks import TokenCounter, TokenizerCounter, block_id

if TYPE_CHECKING:
    from contextpilot_integrations.core.pilot import ContextPilot

__all__ = ["EmbeddedEngine", "Engine", "Served"]


@dataclass(frozen=True, slots=True)
class Served:
    """An engine's answer for one request.

    Attributes:
        prompt_tokens: tokens of the whole prompt as the engine counted them.
        cached_tokens: of those, tokens served from the prefix cache (``None``: not reported).
        ttft_s: time to first token in seconds (real engines only).
        token_ids: the prompt's token ids as the engine prefilled them, for a planner that
            follows the engine's KV events (attribution by token matching,
            ``EngineLink.register_tokens``); ``None`` when the engine does not say.
    """

    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float | None = None
    token_ids: tuple[int, ...] | None = None


class Engine(Protocol):
    """Runs prompts. ``segments`` is ``PromptLayout.render_segments`` output (or a multi-turn
    prompt of such segments).

    Attributes:
        cache_sync: how a planner follows this engine's prefix cache, the mapping
            ``EngineLink(...)`` takes; ``None``: it does not, evictions come from
            :meth:`take_evicted_rids`.
    """

    cache_sync: Mapping[str, Any] | None

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        """Run one request (prefill) under ``rid``."""
        ...

    def take_evicted_rids(self) -> list[str]:
        """Request ids whose cached prompt was evicted since the last call (engines without
        :attr:`cache_sync`; otherwise empty)."""
        ...

    def sync(self, pilot: ContextPilot | None) -> None:
        """Wait until what the engine reports about the requests sent so far has arrived: at
        ``pilot``'s engine link when given (a fresh link first catches up with the engine's
        event stream). Called before a method's first request (with its pilot) and after its
        last (before its figures are read); a no-op where reports arrive with each request."""
        ...


class EmbeddedEngine:
    """The prefix-cache model driven by rendered prompts.

    Without a tokenizer, each non-empty segment is one unit: its id is ``block_id(segment)``
    and its weight ``counter.count(segment)`` tokens. With ``tokenizer`` (a
    :class:`TokenizerCounter`), the whole prompt is tokenized and every token id is a unit.
    Evictions are reported by :meth:`take_evicted_rids` (no ``cache_sync``).

    Args:
        capacity_tokens: cache capacity in tokens (``None``: unlimited).
        counter: token counter for segments (ignored with ``tokenizer``).
        tokenizer: optional real tokenizer.
        block_size: engine block size (hits in whole blocks).
    """

    cache_sync: Mapping[str, Any] | None = None

    def __init__(
        self,
        capacity_tokens: int | None,
        *,
        counter: TokenCounter,
        tokenizer: TokenizerCounter | None = None,
        block_size: int = 1,
    ) -> None:
        self.model = PrefixCacheModel(capacity_tokens, block_size=block_size)
        self._counter = counter
        self._tokenizer = tokenizer
        self._units: dict[str, tuple[int, int]] = {}

    def _unit(self, segment: str) -> tuple[int, int]:
        unit = self._units.get(segment)
        if unit is None:
            unit = (block_id(segment), self._counter.count(segment))
            self._units[segment] = unit
        return unit

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        if self._tokenizer is not None:
            ids = self._tokenizer.encode("".join(segments))
            return Served(len(ids), self.model.serve(ids, rid=rid))
        units = [self._unit(s) for s in segments if s]
        weights = [w for _, w in units]
        cached = self.model.serve([u for u, _ in units], weights, rid=rid)
        return Served(sum(weights), cached)

    def take_evicted_rids(self) -> list[str]:
        return self.model.take_evicted_rids()

    def sync(self, pilot: ContextPilot | None) -> None:
        """Nothing to wait for: the model answers each request at once."""
