"""The benchmark's engine on vLLM's CPU build: chat requests, the embedded models fed the same
tokens, and the planner following the engine through its KV events.

Per request (:meth:`VllmCpuEngine.serve`): the segments become the layout's chat messages; their
token ids are computed here exactly as the server applies the chat template
(:meth:`~contextpilot_bench.testbed.vllm_server.VllmCpuServer.tokenize`, checked against
``usage.prompt_tokens`` on every request); the request is streamed with the plan's rid as
``session_id`` and ``request_id`` (vLLM echoes ``session_id`` on ``BlockStored``), TTFT
measured; and the same token ids are fed to two embedded prefix-cache models with the engine's
block size and capacity: the paged model (vLLM's block pool,
:class:`~contextpilot_bench.prefix_cache_model.PrefixCacheModel` with
``paged=True``) and the token-level radix model (SGLang-style, whole-node eviction), to report
what each predicts for the same stream (:mod:`~contextpilot_bench.engine_report`).

The ContextPilot method's planner follows the engine itself: it is made with
``ContextPilot(engine=EngineLink(engine.cache_sync))`` (the core's engine link on the server's KV
events; :mod:`~contextpilot_bench.methods`), which is given each prompt's token ids
(``served.token_ids``: attribution by token matching, for a prompt whose blocks were all cached
already and so stores nothing) and drops a request from the index once the engine removes a
block of its chain (:mod:`~contextpilot_integrations.sync.cache_mirror`). :meth:`sync` waits
until the link has caught up; the eviction figures come from ``pilot.stats()["sync"]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from contextpilot_bench.engine import Served
from contextpilot_bench.engine_report import EngineMethodReport, EngineRequest
from contextpilot_bench.methods import pilot_link
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_integrations.core.rendering import PromptLayout

if TYPE_CHECKING:
    from contextpilot_bench.vllm_instance import VllmCpuInstance
    from contextpilot_integrations.core.pilot import ContextPilot

__all__ = ["VllmCpuEngine"]

logger = logging.getLogger(__name__)


def _eviction_counts(pilot: ContextPilot) -> dict[str, int]:
    sync = pilot.stats()["sync"]
    return {
        "notices": int(sync["source"]["mirror"]["evicted_requests"]),
        "applied": int(sync["evictions"].get("kv-events", 0)),
    }


class VllmCpuEngine:
    """The benchmark's :class:`~contextpilot_bench.engine.Engine` on a running
    :class:`~contextpilot_bench.vllm_instance.VllmCpuInstance` (one per method,
    made on an emptied cache by :meth:`on_emptied_cache`).

    Args:
        instance: the running server, client and event watch.
        layout: renders segments into chat messages.

    Attributes:
        cache_sync: the server's KV events, for ``EngineLink(...)``.
        requests: one :class:`EngineRequest` per request served, in send order.
        messages: rid -> the chat messages sent.
        answers: rid -> the generated text.
    """

    def __init__(self, instance: VllmCpuInstance, layout: PromptLayout) -> None:
        self.instance = instance
        self.layout = layout
        self.cache_sync: Mapping[str, Any] | None = instance.cache_sync
        size, capacity = instance.block_size, instance.model_capacity_tokens
        self.model = PrefixCacheModel(capacity, block_size=size, paged=True)
        self.radix_model = PrefixCacheModel(capacity, block_size=size)
        self.requests: list[EngineRequest] = []
        self.messages: dict[str, list[dict[str, str]]] = {}
        self.answers: dict[str, str] = {}
        self.model_evicted_rids = 0
        self._warned_mismatch = False
        self._began = time.perf_counter()
        self._seconds = 0.0
        self._events = (instance.event_counters(),) * 2  # at creation, at the last sync
        self._evictions: tuple[dict[str, int], dict[str, int]] | None = None  # first, last
        self._index_requests: int | None = None

    @classmethod
    def on_emptied_cache(cls, instance: VllmCpuInstance, layout: PromptLayout) -> VllmCpuEngine:
        """Empty ``instance``'s prefix cache (waiting for its ``AllBlocksCleared``), then a new
        engine on it: one per method, so that no method reuses another's cache."""
        instance.reset()
        return cls(instance, layout)

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        """Send one request and feed its tokens to the models.

        Raises:
            KeyboardInterrupt, Terminated: a stop signal arrived.
            EngineError: the engine failed the request.
        """
        messages = self.layout.messages_from_segments(segments)
        self.messages[rid] = messages
        token_ids = self.instance.server.tokenize(messages)
        completion = self.instance.chat(messages, rid=rid)
        self.answers[rid] = completion.text
        if completion.prompt_tokens != len(token_ids) and not self._warned_mismatch:
            self._warned_mismatch = True
            logger.warning(
                "rid %s: the engine counted %d prompt tokens, the local tokenizer %d; the "
                "models' predictions are for the local tokens",
                rid,
                completion.prompt_tokens,
                len(token_ids),
            )
        predicted = self.model.serve(token_ids, rid=rid)
        self.model_evicted_rids += len(self.model.take_evicted_rids())
        radix = self.radix_model.serve(token_ids)
        self.requests.append(
            EngineRequest(
                rid,
                completion.prompt_tokens,
                len(token_ids),
                completion.cached_tokens,
                predicted,
                radix,
                completion.ttft_s,
                completion.text,
            )
        )
        return Served(
            completion.prompt_tokens,
            completion.cached_tokens,
            completion.ttft_s,
            token_ids=tuple(token_ids),
        )

    def take_evicted_rids(self) -> list[str]:
        """Nothing: the engine's evictions reach the planner through its engine link."""
        return []

    def sync(self, pilot: ContextPilot | None) -> None:
        """Wait until the event watch and ``pilot``'s engine link are quiet (the link having
        first joined the event stream), then note the figures read so far."""
        link = pilot_link(pilot)
        links = [link] if link is not None else []
        if not self.instance.wait_for_events(*links):
            logger.warning("KV events still arriving after 15 s; counting anyway")
        self._seconds = time.perf_counter() - self._began
        self._events = (self._events[0], self.instance.event_counters())
        if links and pilot is not None:
            counts = _eviction_counts(pilot)
            self._evictions = (self._evictions[0] if self._evictions else counts, counts)
            self._index_requests = len(pilot.index)

    def report(self, method: str) -> EngineMethodReport:
        """The method's figures: the requests served, the events between this engine's creation
        and its last :meth:`sync`, and the pilot's evictions from its first sync to its last."""
        start, end = self._events
        evictions = None
        if self._evictions is not None:
            first, last = self._evictions
            evictions = {key: last[key] - first[key] for key in last}
        return EngineMethodReport.build(
            method,
            self.requests,
            {key: end[key] - start[key] for key in end},
            evictions=evictions,
            model_evicted_rids=self.model_evicted_rids,
            index_requests=self._index_requests,
            seconds=self._seconds,
        )
