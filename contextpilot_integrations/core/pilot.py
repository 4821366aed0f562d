"""The facade the adapters call: plan one request, or plan and schedule a batch.

Flow of one request (DESIGN.md): blocks -> index search -> align -> index insert ->
annotate -> render. A batch is ordered jointly first (:mod:`.clustering`) and scheduled
(:mod:`.scheduling`). Each plan carries a request id (``rid``) to send with the LLM call, so
the engine's cache events and evictions can be tied back to it.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .alignment import RestOrder, align
from .blocks import ApproxTokenCounter, TokenCounter, block_id, validate_block_text
from .clustering import DEFAULT_CLUSTER_LIMIT, BuildMethod, order_batch
from .context_index import ContextIndex
from .conversation import TurnVisibility
from .dedup import Deduplicator, DedupPlan
from .distance import DEFAULT_ALPHA
from .rendering import PromptLayout
from .scheduling import ScheduleMethod, schedule

__all__ = ["BatchPlan", "ContextPilot", "Plan", "PlannedBlock"]

T = TypeVar("T")

MAX_BLOCKS_PER_REQUEST = 100_000


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    """One block of a plan, in prompt order.

    Attributes:
        text: the block's exact text, as given.
        block_id: stable 64-bit id of ``text``.
        original_rank: 0-based index in the input (retriever) order.
        tokens: token length of ``text`` by the pilot's counter.
        rendered_text: what the prompt shows: ``text``, or ``text`` with sub-blocks already
            shown earlier in the conversation replaced by pointers to them.
    """

    text: str
    block_id: int
    original_rank: int
    tokens: int
    rendered_text: str


@dataclass(frozen=True)
class Plan:
    """What to send for one request.

    Attributes:
        rid: request id for the engine (SGLang ``rid``, vLLM ``request_id``, ``session_id``).
        query: the question.
        blocks: the prompt's blocks in prompt order (each distinct text once).
        order: original indices of ``blocks`` (``order[i] == blocks[i].original_rank``).
        duplicates: input index -> input index of the earlier identical text.
        replaced: input index -> the location hint that replaces it (the identical text
            already stands in an earlier turn of this conversation that the app still sends).
            Every input index is in exactly one of ``order``, ``duplicates`` and ``replaced``
            (nothing is lost).
        hints: the hints in prompt order (rendered after the blocks).
        segments: ``[system, block 1, ..., block n, tail]``; ``prompt`` is their join.
        matched_prefix_blocks: blocks of the prefix the index already held.
        matched_prefix_tokens: their tokens.
        conversation_id, tenant, turn: the conversation the plan was de-duplicated in
            (``conversation_id`` and ``turn`` are ``None`` without one).
        dedup: per-request figures: blocks_kept, blocks_replaced, sub_blocks_replaced,
            tokens_in, tokens_saved (all zero savings without a conversation).
        annotation_labels: how the order annotation names the blocks, highest relevance
            first (empty when annotation is off).
        layout: the layout that rendered the plan.
    """

    rid: str
    query: str
    blocks: list[PlannedBlock]
    order: list[int]
    duplicates: dict[int, int]
    segments: list[str]
    matched_prefix_blocks: int
    matched_prefix_tokens: int
    layout: PromptLayout = field(repr=False)
    replaced: dict[int, str] = field(default_factory=dict)
    hints: list[str] = field(default_factory=list)
    conversation_id: str | None = None
    tenant: str = ""
    turn: int | None = None
    dedup: dict[str, int] = field(default_factory=dict)
    annotation_labels: list[str] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        """The plain-text prompt (``"".join(segments)``)."""
        return "".join(self.segments)

    @property
    def context_tail(self) -> str:
        """Hints and order annotation: the tail without the question (for adapters that
        render the question themselves)."""
        return self.layout.context_tail(annotation_labels=self.annotation_labels, hints=self.hints)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat form: system message, then one user message."""
        return self.layout.messages_from_segments(self.segments)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the blocks (the system prompt and tail are not counted here)."""
        return sum(b.tokens for b in self.blocks)

    def reorder(self, items: Sequence[T]) -> list[T]:
        """Return ``items`` (one per input block, in input order) in prompt order.

        Items at duplicate or replaced positions are not in the prompt order; look them up
        through :attr:`duplicates` and :attr:`replaced`.

        Raises:
            ValueError: ``items`` has another length than the input.
        """
        expected = len(self.order) + len(self.duplicates) + len(self.replaced)
        if len(items) != expected:
            raise ValueError(f"items has {len(items)} entries, the plan was made for {expected}")
        return [items[i] for i in self.order]


@dataclass(frozen=True)
class BatchPlan:
    """Plans for a batch, in input order, and the order to send them in.

    Attributes:
        plans: one :class:`Plan` per input request, in input order.
        schedule: indices into ``plans`` in execution order (a permutation).
    """

    plans: list[Plan]
    schedule: list[int]

    def scheduled(self) -> list[Plan]:
        """The plans in execution order."""
        return [self.plans[i] for i in self.schedule]


class _BlockHistory:
    """Recency-weighted popularity of blocks, remembered after the engine evicts them.

    Each time a planned request holds a block, the block's score gains 1; scores halve every
    ``half_life`` planned requests, so blocks that keep being retrieved stay ahead of blocks
    that were popular once. Bounded to ``capacity`` blocks (least recently seen dropped),
    ``O(k)`` per request. Measured in ``benchmarks/bench_ordering.py``: a half-life
    of 30 requests beat both no memory and unbounded counts on MultiHop-RAG and MTRAG online.
    """

    def __init__(self, capacity: int, half_life: float = 30.0) -> None:
        self.capacity = capacity
        self.half_life = half_life
        self._clock = 0
        self._scores: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._clock += 1
            for block in blocks:
                score = self._decayed(self._scores.pop(block, None))
                self._scores[block] = (score + 1.0, self._clock)
            while len(self._scores) > self.capacity:
                self._scores.popitem(last=False)

    def get(self, block: int) -> float:
        return self._decayed(self._scores.get(block))

    def _decayed(self, entry: tuple[float, int] | None) -> float:
        if entry is None:
            return 0.0
        score, seen = entry
        return score * 0.5 ** ((self._clock - seen) / self.half_life)


@dataclass(frozen=True)
class _Request:
    query: str
    texts: list[str]
    ids: list[int]
    tokens: list[int]
    ranks: list[int]
    duplicates: dict[int, int]


class ContextPilot:
    """Plans requests against one shared :class:`ContextIndex`.

    Args:
        layout: prompt layout (system prompt, templates); default :class:`PromptLayout`.
        token_counter: text -> tokens; default :class:`ApproxTokenCounter`.
        index: an existing index to share; default a new one bounded by ``max_requests``.
        alpha: position-gap weight of the paper's distance (offline build).
        max_requests: LRU bound of a new index (ignored when ``index`` is given).
        build_method: offline build, ``"auto"``, ``"cluster"`` or ``"frequency"``.
        schedule_method: ``"prefix-tree"`` (default) or ``"first-step"`` (paper Alg. 5).
        rest_order: order of the unmatched blocks, ``"retriever"`` or ``"popularity"``.
        weight_by_tokens: weigh shared blocks by tokens (else by count) when ordering.
        annotate: add the order annotation after the blocks.
        block_cache_size: texts whose (block id, tokens) are memoised (LRU).
        popularity_memory: blocks whose request counts are remembered after eviction, for
            ``rest_order="popularity"`` (0: use only the requests the index holds).
        deduplicator: multi-turn de-duplication against each conversation's earlier turns;
            default a :class:`Deduplicator` with the layout's labels and this token counter.
    """

    def __init__(
        self,
        *,
        layout: PromptLayout | None = None,
        token_counter: TokenCounter | None = None,
        index: ContextIndex | None = None,
        alpha: float = DEFAULT_ALPHA,
        max_requests: int | None = 100_000,
        build_method: BuildMethod = "auto",
        cluster_limit: int = DEFAULT_CLUSTER_LIMIT,
        schedule_method: ScheduleMethod = "prefix-tree",
        rest_order: RestOrder = "popularity",
        weight_by_tokens: bool = True,
        annotate: bool = True,
        block_cache_size: int = 65_536,
        popularity_memory: int = 262_144,
        deduplicator: Deduplicator | None = None,
    ) -> None:
        self.layout = layout or PromptLayout()
        self.token_counter = token_counter or ApproxTokenCounter()
        self.index = index if index is not None else ContextIndex(max_requests=max_requests)
        self.alpha = alpha
        self.build_method = build_method
        self.cluster_limit = cluster_limit
        self.schedule_method = schedule_method
        self.rest_order = rest_order
        self.weight_by_tokens = weight_by_tokens
        self.annotate = annotate
        self._history = _BlockHistory(popularity_memory)
        self.deduplicator = deduplicator or Deduplicator(
            token_counter=self.token_counter, label_template=self.layout.label_template
        )
        # Popular blocks recur across requests: remember (id, tokens) of recent texts.
        self._identify = functools.lru_cache(maxsize=block_cache_size)(self._identify_uncached)

    # ------------------------------------------------------------------ one request
    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        conversation_id: str | None = None,
        tenant: str = "",
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Plan:
        """Align one request against the index, de-duplicate it, index it, render its prompt.

        Args:
            query: the question (a str; may be empty).
            blocks: block texts in retriever (relevance) order; identical texts are sent once
                (see :attr:`Plan.duplicates`).
            rid: request id; a new unique one when ``None``.
            conversation_id: the conversation this request is a turn of; ``None`` (default):
                no de-duplication across turns, nothing recorded.
            tenant: the tenant (user, app) owning the conversation; conversations of
                different tenants never see each other.
            turn: this turn's number (default: one after the conversation's latest).
            visibility: which earlier turns the app's prompt still holds (default: all); a
                hint only ever points at a visible turn.

        Returns:
            A :class:`Plan`. The request is indexed under ``plan.rid`` with the blocks its
            prompt shows.

        Raises:
            TypeError / ValueError: bad ``query``, ``blocks``, ``rid``, ``tenant``, ``turn``
                or ``visibility`` (the message names the field and the value).
        """
        request = self._prepare(query, blocks, field_name="blocks")
        rid = self._new_rid(rid)
        if rid in self.index:
            raise ValueError(f"rid {rid!r} is already indexed")
        if not request.ids:
            return self._finish(rid, request, [], (), 0, conversation_id, tenant, turn, visibility)
        weights = request.tokens if self.weight_by_tokens else None
        found = self.index.search(request.ids, weights)
        order = align(
            request.ids,
            found.prefix,
            rest_order=self.rest_order,
            popularity=self._popularity,
        )
        return self._finish(
            rid,
            request,
            order,
            found.prefix,
            found.prefix_tokens,
            conversation_id,
            tenant,
            turn,
            visibility,
        )

    # ------------------------------------------------------------------ a batch
    def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
        conversation_ids: Sequence[str | None] | None = None,
        tenants: Sequence[str] | None = None,
        turns: Sequence[int | None] | None = None,
        visibilities: Sequence[TurnVisibility | None] | None = None,
    ) -> BatchPlan:
        """Order a batch jointly, de-duplicate, index and schedule it.

        Each request is first matched against what the index already holds; requests that
        matched the same prefix are then ordered together by the offline build, so blocks
        they share form common prefixes. The schedule runs requests sharing a prefix back to
        back.

        Args:
            queries: ``B`` questions.
            blocks: ``B`` lists of block texts, each in retriever order.
            rids: optional ``B`` request ids.
            conversation_ids: optional ``B`` conversation ids (``None`` entries: none); each
                conversation at most once per batch, since its turns are sequential.
            tenants: optional ``B`` tenants (default ``""``).
            turns: optional ``B`` turn numbers (``None``: next turn), as in :meth:`plan`.
            visibilities: optional ``B`` :class:`TurnVisibility` (``None``: all earlier
                turns), as in :meth:`plan`.

        Returns:
            :class:`BatchPlan` with plans in input order and the schedule.

        Raises:
            ValueError: ``queries``, ``blocks``, ``rids``, ``conversation_ids`` or ``tenants``
                of different lengths, repeated rids, a conversation twice, or a bad entry
                (named by its index).
        """
        if len(queries) != len(blocks):
            raise ValueError(f"queries has {len(queries)} entries but blocks has {len(blocks)}")
        if rids is not None and len(rids) != len(queries):
            raise ValueError(f"rids has {len(rids)} entries for {len(queries)} queries")
        if rids is not None and len(set(rids)) != len(rids):
            raise ValueError("rids must be unique within a batch")
        for name, values in (
            ("conversation_ids", conversation_ids),
            ("tenants", tenants),
            ("turns", turns),
            ("visibilities", visibilities),
        ):
            if values is not None and len(values) != len(queries):
                raise ValueError(f"{name} has {len(values)} entries for {len(queries)} queries")
        conversations = [
            (tenants[i] if tenants else "", c)
            for i, c in enumerate(conversation_ids or ())
            if c is not None
        ]
        if len(set(conversations)) != len(conversations):
            raise ValueError(
                "a (tenant, conversation_id) appears twice in one batch; plan the turns of one "
                "conversation one after the other with plan()"
            )
        requests = [
            self._prepare(q, b, field_name=f"blocks[{i}]", query_field=f"queries[{i}]")
            for i, (q, b) in enumerate(zip(queries, blocks))
        ]
        batch_rids = [self._new_rid(rids[i] if rids else None) for i in range(len(requests))]
        already = [rid for rid in batch_rids if rid in self.index]
        if already:
            raise ValueError(f"rids already indexed: {already[:5]!r}")

        # Match each request against the index, then order each group of requests that
        # matched the same prefix jointly on the rest of their blocks.
        groups: dict[tuple[int, ...], list[int]] = {}
        matched: list[tuple[tuple[int, ...], int]] = []
        for i, request in enumerate(requests):
            if not request.ids:
                matched.append(((), 0))
                continue
            weights = request.tokens if self.weight_by_tokens else None
            found = self.index.search(request.ids, weights)
            matched.append((found.prefix, found.prefix_tokens))
            groups.setdefault(found.prefix, []).append(i)
        orders: dict[int, list[int]] = {}
        for prefix, members in groups.items():
            in_prefix = set(prefix)
            rests = [[b for b in requests[i].ids if b not in in_prefix] for i in members]
            token_of = [dict(zip(requests[i].ids, requests[i].tokens)) for i in members]
            nonempty = [j for j, rest in enumerate(rests) if rest]
            ordered_rests = order_batch(
                [rests[j] for j in nonempty],
                [[token_of[j][b] for b in rests[j]] for j in nonempty],
                method=self.build_method,
                alpha=self.alpha,
                weight_by_tokens=self.weight_by_tokens,
                cluster_limit=self.cluster_limit,
            )
            for member in members:
                orders[member] = list(prefix)
            for j, ordered in zip(nonempty, ordered_rests):
                orders[members[j]].extend(ordered)

        plans: list[Plan] = []
        for i, request in enumerate(requests):
            prefix, prefix_tokens = matched[i]
            plans.append(
                self._finish(
                    batch_rids[i],
                    request,
                    orders.get(i, []),
                    prefix,
                    prefix_tokens,
                    conversation_ids[i] if conversation_ids else None,
                    tenants[i] if tenants else "",
                    turns[i] if turns else None,
                    visibilities[i] if visibilities else None,
                )
            )
        # Paths are read after every insert: a later insert can split a node on an earlier
        # request's path. A request already evicted by the index's bound has no path.
        paths = [
            self.index.search_path(plan.rid) if plan.rid in self.index else () for plan in plans
        ]
        return BatchPlan(plans=plans, schedule=schedule(paths, self.schedule_method))

    # ------------------------------------------------------------------ index passthrough
    def evict(self, rid: str) -> bool:
        """Drop ``rid`` from the index (the engine evicted its cached prefix)."""
        return self.index.evict(rid)

    def stats(self) -> dict[str, Any]:
        """Index statistics as a plain dict."""
        s = self.index.stats()
        return {f: getattr(s, f) for f in s.__dataclass_fields__}

    # ------------------------------------------------------------------ internals
    def _prepare(
        self, query: str, blocks: Sequence[str], *, field_name: str, query_field: str = "query"
    ) -> _Request:
        if not isinstance(query, str):
            raise TypeError(
                f"{query_field} must be a str, got {type(query).__name__}: {query!r:.80}"
            )
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{query_field} cannot be encoded as UTF-8 ({error.reason} at character "
                f"{error.start}): {query!r:.80}"
            ) from None
        if isinstance(blocks, str) or not isinstance(blocks, Sequence):
            raise TypeError(
                f"{field_name} must be a sequence of str, got {type(blocks).__name__}: "
                f"{blocks!r:.80}"
            )
        if len(blocks) > MAX_BLOCKS_PER_REQUEST:
            raise ValueError(
                f"{field_name} has {len(blocks)} blocks; at most "
                f"{MAX_BLOCKS_PER_REQUEST} per request"
            )
        texts: list[str] = []
        ids: list[int] = []
        tokens: list[int] = []
        ranks: list[int] = []
        first_seen: dict[int, int] = {}
        duplicates: dict[int, int] = {}
        for rank, text in enumerate(blocks):
            validate_block_text(text, field=f"{field_name}[{rank}]")
            try:
                bid, count = self._identify(text)
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"{field_name}[{rank}] cannot be encoded as UTF-8 ({error.reason} at "
                    f"character {error.start}): {text!r:.80}"
                ) from None
            if bid in first_seen:
                duplicates[rank] = first_seen[bid]
                continue
            first_seen[bid] = rank
            texts.append(text)
            ids.append(bid)
            tokens.append(count)
            ranks.append(rank)
        return _Request(query, texts, ids, tokens, ranks, duplicates)

    def _popularity(self, block: int) -> float:
        return self.index.block_popularity(block) + self._history.get(block)

    def _identify_uncached(self, text: str) -> tuple[int, int]:
        return block_id(text), max(1, self.token_counter.count(text))

    @staticmethod
    def _new_rid(rid: str | None) -> str:
        if rid is None:
            return f"cp-{uuid.uuid4().hex}"
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a str, got {type(rid).__name__}: {rid!r:.80}")
        if not rid:
            raise ValueError("rid must be a non-empty str, got ''")
        return rid

    def _finish(
        self,
        rid: str,
        request: _Request,
        order: Sequence[int],
        prefix: Sequence[int],
        prefix_tokens: int,
        conversation_id: str | None,
        tenant: str,
        turn: int | None,
        visibility: TurnVisibility | None,
    ) -> Plan:
        """De-duplicate the aligned blocks, index what the prompt shows, render the plan."""
        position = {bid: i for i, bid in enumerate(request.ids)}
        ordered = [position[bid] for bid in order]
        planned: list[PlannedBlock] = []
        replaced: dict[int, str] = {}
        labels: dict[int, str] = {}  # original rank -> how the annotation names it
        if conversation_id is None:
            # No conversation: nothing to look up or record; every block is shown as given.
            if not isinstance(tenant, str):
                raise TypeError(f"tenant must be a str, got {type(tenant).__name__}: {tenant!r}")
            for p in ordered:
                labels[request.ranks[p]] = self.layout.label(len(planned))
                planned.append(
                    PlannedBlock(
                        text=request.texts[p],
                        block_id=request.ids[p],
                        original_rank=request.ranks[p],
                        tokens=request.tokens[p],
                        rendered_text=request.texts[p],
                    )
                )
            hints: list[str] = []
            figures = {
                "blocks_kept": len(planned),
                "blocks_replaced": 0,
                "sub_blocks_replaced": 0,
                "tokens_in": sum(b.tokens for b in planned),
                "tokens_saved": 0,
            }
        else:
            dedup: DedupPlan = self.deduplicator.plan(
                tenant,
                conversation_id,
                [request.texts[p] for p in ordered],
                turn=turn,
                visibility=visibility,
                block_ids=list(order),
                block_tokens=[request.tokens[p] for p in ordered],
            )
            for p, decision in zip(ordered, dedup.blocks):
                rank = request.ranks[p]
                labels[rank] = decision.reference
                if decision.text is None:
                    assert decision.hint is not None
                    replaced[rank] = decision.hint
                    continue
                planned.append(
                    PlannedBlock(
                        text=request.texts[p],
                        block_id=request.ids[p],
                        original_rank=rank,
                        tokens=request.tokens[p],
                        rendered_text=decision.text,
                    )
                )
            hints = dedup.hints
            figures = dedup.figures()
            turn = dedup.turn
        if planned:
            # The index mirrors what the engine will cache: the blocks as rendered.
            ids = [
                b.block_id if b.rendered_text == b.text else self._identify(b.rendered_text)[0]
                for b in planned
            ]
            tokens = [
                b.tokens if b.rendered_text == b.text else self._identify(b.rendered_text)[1]
                for b in planned
            ]
            self.index.insert(rid, ids, tokens)
            self._history.add(ids)
        annotation_labels = [labels[r] for r in sorted(labels)] if self.annotate else []
        if not replaced and all(
            a.original_rank < b.original_rank for a, b in zip(planned, planned[1:])
        ):
            annotation_labels = []  # the prompt already shows relevance order: say nothing
        segments = self.layout.render_segments(
            [b.rendered_text for b in planned],
            request.query,
            annotation_labels=annotation_labels,
            hints=hints,
        )
        return Plan(
            rid=rid,
            query=request.query,
            blocks=planned,
            order=[b.original_rank for b in planned],
            duplicates=dict(request.duplicates),
            segments=segments,
            matched_prefix_blocks=len(prefix),
            matched_prefix_tokens=prefix_tokens,
            layout=self.layout,
            replaced=replaced,
            hints=hints,
            conversation_id=conversation_id,
            tenant=tenant,
            turn=turn if conversation_id is not None else None,
            dedup=figures,
            annotation_labels=annotation_labels,
        )
