"""The facade the adapters call: plan one request, or plan and schedule a batch.

Flow of one request (docs/DESIGN.md, "The flow of one request"): blocks -> index search ->
align -> de-duplicate (per conversation) -> index insert -> annotate -> render. A batch is
ordered jointly first (:mod:`.clustering`) and scheduled (:mod:`.scheduling`), as the
:class:`~.ordering_config.OrderingConfig` says. Each plan carries a request id (``rid``) to
send with the LLM call, so the engine's cache events and evictions can be tied back to it;
with an engine link (``engine=``, :mod:`.engine_link_protocol`) the pilot follows the engine
itself. Steps with a home of their own: a request's distinct blocks (:mod:`.request_blocks`),
where each input goes in the prompt (:mod:`.placements`), the rids a running call holds
(:mod:`.rid_reservations`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter, block_id
from contextpilot_integrations.core.conversations.dedup import Deduplicator
from contextpilot_integrations.core.engine_link_protocol import EngineLinkProtocol
from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.index.index_types import SearchResult
from contextpilot_integrations.core.ordering.alignment import CONDITIONAL_STEPS, align
from contextpilot_integrations.core.ordering.clustering import order_behind_prefixes
from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.ordering.popularity import CooccurrenceMemory, PopularityMemory
from contextpilot_integrations.core.ordering.scheduling import schedule
from contextpilot_integrations.core.placements import PendingTurns, place_blocks
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.planner_protocol import ThreadedAsyncTwins
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import (
    NO_SCOPE,
    PlanRequest,
    Scope,
    check_batch,
    new_rid,
)
from contextpilot_integrations.core.request_blocks import RequestBlocks, distinct_blocks
from contextpilot_integrations.core.rid_reservations import RidReservations
from contextpilot_integrations.core.usage import ConversationTotals, UsageCounter, check_usage

__all__ = ["PILOT_SNAPSHOT_VERSION", "ContextPilot"]

logger = logging.getLogger(__name__)

PILOT_SNAPSHOT_VERSION = 1
"""Version of :meth:`ContextPilot.snapshot`'s format (the index's and the conversation store's
sections carry their own)."""

TAIL_BATCH_LIMIT = 128
"""Largest batch whose schedule picks the prompt it leaves in the cache for the next batch
(docs/DESIGN.md, "Ordering"): a planning window holds tens of requests; in a larger batch that
one prompt is a negligible share of its reuse, and scoring every request costs a set
intersection per leading block."""


class ContextPilot(ThreadedAsyncTwins):
    """Plans requests against one shared :class:`ContextIndex`.

    Args:
        layout: prompt layout (system prompt, templates); default :class:`PromptLayout`.
        token_counter: text -> tokens; default :class:`ApproxTokenCounter`.
        index: an existing index to share; default a new one bounded by ``max_requests``.
        max_requests: LRU bound of a new index (ignored when ``index`` is given).
        ordering: how blocks are ordered (:class:`OrderingConfig`); default its defaults.
        annotate: add the order annotation after the blocks.
        block_cache_size: texts whose (block id, tokens) are memoised (LRU).
        deduplicator: multi-turn de-duplication against each conversation's earlier turns;
            default a :class:`Deduplicator` with the layout's labels and this token counter.
            Every plan counts with this pilot's token counter, a given deduplicator's too
            (its ``min_tokens_saved`` test and ``dedup_figures.tokens_saved``), so a plan's
            figures all have the counter its blocks' tokens come from.
        cache_salt: the engine's ``cache_salt`` for every plan of this pilot (one tenant's
            pilot; see :attr:`Plan.cache_salt`); ``None``: none.
        engine: follow the engine's prefix cache through this link
            (:class:`~.engine_link_protocol.EngineLinkProtocol`; e.g.
            ``EngineLink({"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5557"})`` from
            ``contextpilot_integrations.sync.engine_link``, the ``sync`` extra). Every plan is
            recorded with it. A link nobody bound yet is this pilot's: its evictions drop
            requests from this pilot's index, it starts here and stops with :meth:`close` (or
            the ``with`` block). A link its owner bound already (the index service's, shared by
            every tenant's pilot) is only recorded with: its owner routes its evictions and
            starts and stops it. ``None`` (default): the index's own LRU bound only.
        stats_conversations: conversations whose running totals :meth:`stats` keeps (LRU of
            ``(tenant, conversation_id)``, ``int >= 1``).
        stats_tenants: tenants whose running totals :meth:`stats` keeps (LRU, ``int >= 1``).

    Every plan logs one INFO line (logger ``contextpilot_integrations.core.pilot``): its rid,
    tenant, conversation id and turn as given (ids, never content; quoted, so no id breaks the
    line), the blocks it shows, the hints and sub-block pointers de-duplication put in and the
    tokens they removed.

    Raises:
        TypeError: ``engine`` is not an engine link.
        ValueError: a bad ``cache_salt``, ``stats_conversations`` or ``stats_tenants``.

    Thread-safe: one pilot may be shared by threads and coroutines.
    """

    def __init__(
        self,
        *,
        layout: PromptLayout | None = None,
        token_counter: TokenCounter | None = None,
        index: ContextIndex | None = None,
        max_requests: int | None = 100_000,
        ordering: OrderingConfig | None = None,
        annotate: bool = True,
        block_cache_size: int = 65_536,
        deduplicator: Deduplicator | None = None,
        cache_salt: str | None = None,
        engine: EngineLinkProtocol | None = None,
        stats_conversations: int = 1024,
        stats_tenants: int = 1024,
    ) -> None:
        if engine is not None and not isinstance(engine, EngineLinkProtocol):
            raise TypeError(
                "engine must be an engine link such as EngineLink({...}) "
                f"(contextpilot_integrations.sync.engine_link) or None, got {engine!r:.80}"
            )
        if ordering is not None and not isinstance(ordering, OrderingConfig):
            raise TypeError(f"ordering must be an OrderingConfig or None, got {ordering!r:.80}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r:.80}")
        for name, bound in (
            ("stats_conversations", stats_conversations),
            ("stats_tenants", stats_tenants),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name} must be an int >= 1, got {bound!r:.80}")
        self.cache_salt = cache_salt
        self._layout = layout or PromptLayout()
        self.token_counter = token_counter or ApproxTokenCounter()
        self.index = (
            index
            if index is not None
            else ContextIndex(max_requests=max_requests, on_evict=self._dropped_by_index)
        )
        self.ordering = ordering or OrderingConfig()
        self.annotate = annotate
        self._history = PopularityMemory(self.ordering.popularity_memory)
        self._cooccurrence = CooccurrenceMemory(self.ordering.cooccurrence_memory)
        self.deduplicator = deduplicator or Deduplicator(
            token_counter=self.token_counter, label_template=self._layout.label_template
        )
        # Popular blocks recur across requests: remember (id, tokens) of recent texts.
        self._identify = functools.lru_cache(maxsize=block_cache_size)(self._identify_uncached)
        # The annotation's cost depends only on how many blocks the prompt shows.
        self._annotation_tokens = functools.lru_cache(maxsize=1024)(
            self._annotation_tokens_uncached
        )
        self._reservations = RidReservations()
        self._usage = UsageCounter()
        self._totals = ConversationTotals(stats_conversations, stats_tenants)
        self.engine = engine
        self._owns_engine = engine is not None and not engine.bound
        if engine is not None and self._owns_engine:
            engine.bind(self.index.evict)
            engine.start()

    @property
    def layout(self) -> PromptLayout:
        """The layout plans are rendered with."""
        return self._layout

    # ------------------------------------------------------------------ Public API: planning
    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """Align one request against the index, de-duplicate it, index it, render its prompt.

        Args:
            query: the question (a str; may be empty).
            blocks: block texts in retriever (relevance) order (see :class:`PlanRequest`).
            rid: request id; a new unique one when ``None``.
            scope: the conversation and tenant (:class:`Scope`); default none.

        Returns:
            A :class:`Plan`. The request is indexed under ``plan.rid`` with the blocks its
            prompt shows, and recorded with the engine link.

        Raises:
            TypeError / ValueError: a bad argument (the message names the field and value).
            RidConflictError: ``rid`` is already indexed or being planned by another call.
        """
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        rid = request.rid or new_rid()
        explicit = [rid] if request.rid is not None else []
        with self._reservations.hold(explicit, self.index), PendingTurns() as turns:
            prepared = distinct_blocks(request.blocks, self._identify)
            found = self._search(prepared)
            order = align(
                prepared.ids,
                found.prefix,
                rest_order=self.ordering.rest_order,
                popularity=self._popularities(prepared.ids),
                holders=self._cooccurrence.held_by,
            )
            if self.ordering.reorder == "cost-aware" and not self._reordering_pays(
                prepared, order, found
            ):
                # The retriever's order stays; what it hits is its own indexed prefix.
                order = list(prepared.ids)
                kept, kept_tokens = self.index.prefix_in_order(prepared.ids, prepared.tokens)
                found = SearchResult(tuple(order[:kept]), kept_tokens, (), 0, False)
            plan = self._finish(rid, request, prepared, order, found, turns)
        self._count(plan)
        if self.engine is not None:
            self.engine.record([plan])
        return plan

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """Order a batch jointly, de-duplicate, index and schedule it.

        Each request is first matched against what the index already holds; requests that
        matched the same prefix are then ordered together by the offline build, so blocks
        they share form common prefixes. The schedule runs requests sharing a prefix back to
        back, those hitting a prefix the index held before the batch first, and last the one
        whose prompt later requests are expected to reuse most (it stays in the cache for the
        next batch).

        Args:
            requests: the batch (each conversation at most once: its turns are sequential).

        Returns:
            :class:`BatchPlan` with plans in input order and the schedule.

        Raises:
            TypeError / ValueError: as :func:`~.request.check_batch`.
            RidConflictError: a rid is already indexed or being planned by another call.
        """
        batch = check_batch(requests)
        rids = [request.rid or new_rid() for request in batch]
        explicit = [r.rid for r in batch if r.rid is not None]
        with self._reservations.hold(explicit, self.index), PendingTurns() as turns:
            prepared = [distinct_blocks(request.blocks, self._identify) for request in batch]
            found = [self._search(blocks) for blocks in prepared]
            orders = order_behind_prefixes(
                [blocks.ids for blocks in prepared],
                [blocks.tokens for blocks in prepared],
                [result.prefix for result in found],
                method=self.ordering.build_method,
                alpha=self.ordering.alpha,
                weight_by_tokens=self.ordering.weight_by_tokens,
                cluster_limit=self.ordering.cluster_limit,
            )
            reuse = self._tail_reuse(prepared, orders, found)
            plans = tuple(
                self._finish(rids[i], batch[i], prepared[i], orders[i], found[i], turns)
                for i in range(len(batch))
            )
            # Paths are read after every insert (a later insert can split a node on an earlier
            # request's path) in one step: a request evicted meanwhile has none.
            rids = [plan.rid for plan in plans]
            paths = self.index.search_paths(rids)
            plans = tuple(
                dataclasses.replace(plan, shared_prefix_blocks=blocks, shared_prefix_tokens=tokens)
                for plan, (blocks, tokens) in zip(plans, self.index.shared_prefixes(rids))
            )
        for plan in plans:
            self._count(plan)
        if self.engine is not None:
            self.engine.record(plans)
        return BatchPlan(
            plans=plans,
            schedule=tuple(
                schedule(
                    paths,
                    self.ordering.schedule_method,
                    [r.prefix_tokens for r in found],
                    reuse,
                )
            ),
        )

    def warm_start(self, requests: Sequence[PlanRequest]) -> int:
        """Learn what ordering reads from earlier traffic, without indexing it.

        Each request's distinct blocks feed the popularity and co-occurrence memories
        (:mod:`.popularity`) as if it had been planned, in the order given (oldest first), so
        new requests are ordered by what that traffic taught; none is indexed, so no plan
        counts a past request's prefix as cached (the engine's cache does not hold it). Call it
        before planning (at start-up); the memories keep only their most recent requests
        (``OrderingConfig.popularity_memory`` blocks, ``cooccurrence_memory`` requests).

        Args:
            requests: past requests (``rid`` and ``scope`` are not read; a conversation may
                appear many times).

        Returns:
            The requests learned from (those with at least one block).

        Raises:
            TypeError: ``requests`` is not a sequence of :class:`PlanRequest`, or
                ``requests[i]`` is not one (the message names it).
        """
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
            raise TypeError(
                "requests must be a sequence of PlanRequest, got "
                f"{type(requests).__name__}: {requests!r:.80}"
            )
        for i, request in enumerate(requests):
            if not isinstance(request, PlanRequest):
                raise TypeError(
                    f"requests[{i}] must be a PlanRequest, got "
                    f"{type(request).__name__}: {request!r:.80}"
                )
        learned = 0
        for request in requests:
            ids = distinct_blocks(request.blocks, self._identify).ids
            if ids:
                self._history.add(ids)
                self._cooccurrence.add(ids)
                learned += 1
        return learned

    def forget_conversation(self, conversation_id: str, tenant: str = "") -> bool:
        """Drop a conversation's de-duplication records (its turn numbers go on: a later turn
        is never numbered as one already given); False if unknown. No later plan hints at
        what its earlier turns showed."""
        return self.deduplicator.store.forget(tenant, conversation_id)

    # ------------------------------------------------------------------ Public API: the engine
    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index (the engine evicted its cached prefix); False if it was
        not indexed. The engine link stops following it."""
        evicted = self.index.evict(rid)
        if self.engine is not None:
            self.engine.forget(rid)
        return evicted

    def record_usage(
        self,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        cache_write_tokens: int | None = None,
    ) -> bool:
        """Add the engine's ``usage`` of one sent request (``prompt_tokens``, the cached
        tokens read, and, where the provider reports them, the tokens written to its cache:
        Anthropic's ``cache_creation_input_tokens``; ``engine_fields.read_usage``) to
        :meth:`stats`. A request that read or wrote the cache is marked as just used in the
        index and the engine link (LRU and TTL refresh: a read renews a hosted cache's
        lifetime, a write starts it).

        A request that did neither stays indexed: its prefix is not cached yet, but the next
        request that shares it places a breakpoint there and writes it (a hosted cache is
        written only where a breakpoint stands, and the index is what tells where requests
        share). Requests below the minimum cacheable length are the TTL model's to drop.

        A rid reported before (among the most recent reports, ``core.usage.RIDS_REMEMBERED``)
        changes nothing: two reporters of one engine call count it once.

        Returns:
            Whether ``rid`` is indexed.

        Raises:
            TypeError / ValueError: figures that are not ints with
                ``0 <= cached_tokens + cache_write_tokens <= prompt_tokens``.
        """
        check_usage(prompt_tokens, cached_tokens, cache_write_tokens)
        if not self._totals.add_usage(rid, prompt_tokens, cached_tokens):
            return rid in self.index  # reported already: one engine call counts once
        self._usage.add(prompt_tokens, cached_tokens, cache_write_tokens)
        if cached_tokens > 0 or (cache_write_tokens or 0) > 0:
            indexed = self.index.touch(rid)
            if self.engine is not None:
                self.engine.touch(rid)
            return indexed
        return rid in self.index

    def count_plan(
        self,
        rid: str,
        scope: Scope,
        tokens_removed: int,
        *,
        blocks_replaced: int = 0,
        sub_blocks_replaced: int = 0,
        plans: int = 1,
    ) -> None:
        """Add a plan made outside this pilot for its callers (the service proxy's message
        plans) to :meth:`totals`, so the usage reported later for ``rid`` adds to ``scope``'s
        conversation as it does for this pilot's own plans. ``plans``: how many plans it adds
        (0: figures of a call this pilot planned already, e.g. the proxy's message plan of a
        call whose documents this pilot planned under the same rid)."""
        self._totals.add_plan(
            rid,
            scope.tenant,
            scope.conversation_id,
            tokens_removed,
            blocks_replaced,
            sub_blocks_replaced,
            plans=plans,
        )

    def stats(self) -> dict[str, Any]:
        """The index's statistics at the top level (``requests``, ``nodes``, ``tokens``, ...),
        and sections ``index`` (the same), ``conversations``, ``usage`` (with ``hit_ratio``),
        ``totals`` (:meth:`totals`) and, with an engine link, ``sync``. Walks the conversation
        store: for monitoring."""
        s = self.index.stats()
        index = {f: getattr(s, f) for f in s.__dataclass_fields__}
        out: dict[str, Any] = {
            **index,
            "index": index,
            "conversations": self.deduplicator.store.stats(),
            "usage": self._usage.stats(),
            "totals": self._totals.stats(),
        }
        if self.engine is not None:
            out["sync"] = self.engine.stats()
        return out

    def totals(self, tenant: str | None = None) -> dict[str, Any]:
        """Running totals since the pilot was made (:data:`~.usage.TOTAL_FIELDS`: ``plans``,
        ``tokens_removed``: the plans' ``dedup_figures.tokens_saved``, by this pilot's token
        counter; ``blocks_replaced``, ``sub_blocks_replaced``; and the engine's
        ``usage_reports``, ``prompt_tokens``, ``cached_tokens`` from :meth:`record_usage`).

        Args:
            tenant: ``None``: every tenant's, with ``tenants`` (``{tenant: figures}``) and
                ``conversations`` (``{tenant: {conversation_id: figures}}``); a tenant: that
                tenant's figures and its own ``conversations`` only.

        The most recent ``stats_conversations`` conversations and ``stats_tenants`` tenants are
        kept; a usage report adds to a conversation when its rid is one of the last
        :data:`~.usage.RIDS_REMEMBERED` planned.
        """
        if tenant is None:
            return self._totals.stats()
        return self._totals.tenant_stats(tenant)

    def snapshot(self, *, final: bool = False) -> dict[str, Any]:
        """A JSON-serialisable copy of the state a restart must keep: the index's contexts
        (:meth:`ContextIndex.snapshot`) and the conversation store
        (:meth:`ConversationStore.snapshot`; ``final``: nothing is planned after it, e.g. at
        shutdown, so the restored store misses no turn)."""
        return {
            "version": PILOT_SNAPSHOT_VERSION,
            "index": self.index.snapshot(),
            "conversations": self.deduplicator.store.snapshot(final=final),
        }

    def restore(self, snapshot: object, *, checkpoint: bool = False) -> int:
        """Load :meth:`snapshot` output into this pilot's index and conversation store;
        returns the requests indexed. Call it before planning (at start-up).

        Args:
            snapshot: :meth:`snapshot` output.
            checkpoint: restore the conversations as from a checkpoint even when the snapshot
                says ``final`` (the owner knows planning went on after it, e.g. the last run did
                not stop cleanly): they keep their turn numbers, not their records, and the
                store is amnesic (:mod:`.conversation`).

        Raises:
            ValueError: a malformed snapshot; the index and the conversations are then empty
                and the store amnesic.
        """
        store = self.deduplicator.store
        try:
            if not isinstance(snapshot, dict) or snapshot.get("version") != PILOT_SNAPSHOT_VERSION:
                raise ValueError(f"pilot snapshot version must be {PILOT_SNAPSHOT_VERSION}")
            count = self.index.load(snapshot["index"])
            store.restore(snapshot["conversations"], checkpoint=checkpoint)
        except (KeyError, ValueError) as exc:
            self.index.clear()
            store.mark_history_lost()
            raise ValueError(f"cannot restore the pilot: {exc}") from None
        return count

    def close(self) -> None:
        """Stop the engine link this pilot bound and started (idempotent; a link its owner
        bound is the owner's to stop); the index stays usable."""
        if self.engine is not None and self._owns_engine:
            self.engine.stop()

    def __enter__(self) -> ContextPilot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _search(self, blocks: RequestBlocks) -> SearchResult:
        if not blocks.ids:
            return SearchResult((), 0, (), 0, False)
        return self.index.search_weights(
            blocks.weights if self.ordering.weight_by_tokens else dict.fromkeys(blocks.ids, 1)
        )

    def _tail_reuse(
        self,
        prepared: Sequence[RequestBlocks],
        orders: Sequence[Sequence[int]],
        found: Sequence[SearchResult],
    ) -> list[float] | None:
        """Per request of a batch, the tokens of its ordered prompt that the next requests are
        expected to reuse (as :meth:`_reordering_pays` reckons it, over as many requests as the
        batch holds), read before the batch joins the memories: what the schedule reads to
        pick the prompt it leaves in the cache for the next batch (docs/DESIGN.md,
        "Ordering"). ``None`` above :data:`TAIL_BATCH_LIMIT` requests."""
        if len(prepared) > TAIL_BATCH_LIMIT:
            return None
        reuse = []
        for blocks, order, result in zip(prepared, orders, found):
            token_of = blocks.weights
            reuse.append(
                self._cooccurrence.future_reuse(
                    order,
                    [token_of[b] for b in order],
                    len(prepared),
                    len(result.prefix) + CONDITIONAL_STEPS,
                )
            )
        return reuse

    def _reordering_pays(
        self, blocks: RequestBlocks, order: Sequence[int], found: SearchResult
    ) -> bool:
        """Whether the aligned order is expected to reuse more tokens than the retriever's
        order by more than the order annotation it needs costs (tokens by this pilot's
        counter; the annotation is uncached prompt text)."""
        if list(order) == blocks.ids:
            return True  # nothing moves: no annotation either way
        _, kept = self.index.prefix_in_order(blocks.ids, blocks.tokens)
        annotation = self._annotation_tokens(len(order))
        token_of = blocks.weights
        lifetime = len(self.index)  # requests the cache holds: how long a prompt stays to share
        depth = len(found.prefix) + CONDITIONAL_STEPS
        head = order[:depth]  # all that future_reuse reads
        future = self._cooccurrence.future_reuse(
            head, [token_of[b] for b in head], lifetime, depth
        ) - self._cooccurrence.future_reuse(blocks.ids, blocks.tokens, lifetime, depth)
        return found.prefix_tokens - kept + future > annotation

    def _count(self, plan: Plan) -> None:
        """Add ``plan`` to the running totals and log its line (class docstring)."""
        figures, scope = plan.dedup_figures, plan.scope
        self._totals.add_plan(
            plan.rid,
            scope.tenant,
            scope.conversation_id,
            figures.tokens_saved,
            figures.blocks_replaced,
            figures.sub_blocks_replaced,
        )
        if not logger.isEnabledFor(logging.INFO):
            return  # the line's arguments are not even gathered
        logger.info(
            "contextpilot: rid=%s tenant=%r conversation=%r turn=%s blocks=%d hints=%d "
            "pointers=%d tokens_removed=%d",
            plan.rid,
            scope.tenant,
            scope.conversation_id,
            scope.turn,
            figures.blocks_kept,
            figures.blocks_replaced,
            figures.sub_blocks_replaced,
            figures.tokens_saved,
        )

    def _popularities(self, blocks: Sequence[int]) -> Callable[[int], float]:
        """Block -> popularity (the indexed requests holding it plus its decayed count) for
        ``blocks``, each read once for the whole alignment."""
        held = self.index.block_popularities(blocks)
        scores = dict(zip(blocks, map(operator.add, held, self._history.get_many(blocks))))
        return scores.__getitem__

    def _annotation_tokens_uncached(self, blocks: int) -> int:
        """Tokens of the order annotation of a prompt showing ``blocks`` blocks (its labels are
        those of positions ``0 .. blocks - 1``, whatever their order)."""
        labels = [self._layout.label(p) for p in range(blocks)]
        return self.token_counter.count(self._layout.annotation(labels))

    def _identify_uncached(self, text: str) -> tuple[int, int]:
        return block_id(text), max(1, self.token_counter.count(text))

    def _dropped_by_index(self, rid: str) -> None:
        # The index's own LRU bound dropped ``rid`` (it runs under the index lock): the
        # engine link need not follow it any longer.
        if self.engine is not None:
            self.engine.forget(rid)

    def _finish(
        self,
        rid: str,
        request: PlanRequest,
        blocks: RequestBlocks,
        order: Sequence[int],
        found: SearchResult,
        turns: PendingTurns,
    ) -> Plan:
        """Place the aligned blocks (de-duplicated in a conversation: :func:`.place_blocks`),
        index what the prompt shows, render the plan. The conversation turn it records joins
        ``turns`` (committed when the call returns)."""
        layout = self._layout
        placed = place_blocks(
            request, blocks, order, layout, self.deduplicator, turns, self.token_counter
        )
        shown, hints, references = placed.shown, placed.hints, placed.references
        rendered = placed.rendered
        if shown:
            # The index mirrors what the engine will cache: the blocks as rendered.
            ids: Sequence[int]
            counts: Sequence[int]
            if placed.as_given is not None:
                ids, counts = placed.as_given
            else:
                identities = [
                    (p.block_id or 0, p.tokens)
                    if p.rendered_text == p.text
                    else self._identify(text)
                    for p, text in zip(shown, rendered)
                ]
                ids = [bid for bid, _ in identities]
                counts = [count for _, count in identities]
            self.index.insert(rid, ids, counts)
            self._history.add(ids)
            self._cooccurrence.add(ids)
        annotation: list[str] = []
        shown_indices = placed.shown_indices
        in_order = shown_indices == sorted(shown_indices)  # input indices are distinct
        if self.annotate and (hints or not in_order):
            annotation = [references[i] for i in sorted(references)]
        segments = layout.render_segments(
            rendered, request.query, annotation_labels=annotation, hints=hints
        )
        ((shared_blocks, shared_tokens),) = self.index.shared_prefixes([rid]) if shown else [(0, 0)]
        return Plan(
            rid=rid,
            query=request.query,
            scope=placed.scope,
            placements=placed.placements,
            hints=tuple(hints),
            segments=tuple(segments),
            annotation_labels=tuple(annotation),
            matched_prefix_blocks=len(found.prefix),
            matched_prefix_tokens=found.prefix_tokens,
            shared_prefix_blocks=shared_blocks,
            shared_prefix_tokens=shared_tokens,
            dedup_figures=placed.figures,
            layout=layout,
            cache_salt=self.cache_salt,
        )
