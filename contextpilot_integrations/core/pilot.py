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
        text: the block's exact text.
        block_id: stable 64-bit id of ``text``.
        original_rank: 0-based index in the input (retriever) order.
        tokens: token length by the pilot's counter.
    """

    text: str
    block_id: int
    original_rank: int
    tokens: int


@dataclass(frozen=True)
class Plan:
    """What to send for one request.

    Attributes:
        rid: request id for the engine (SGLang ``rid``, vLLM ``request_id``, ``session_id``).
        query: the question.
        blocks: the prompt's blocks in prompt order (each distinct text once).
        order: original indices of ``blocks`` (``order[i] == blocks[i].original_rank``).
        duplicates: input index -> input index of the earlier identical text; every input
            index is in ``order`` or in ``duplicates`` (nothing is lost).
        segments: ``[system, block 1, ..., block n, tail]``; ``prompt`` is their join.
        matched_prefix_blocks: blocks of the prefix the index already held.
        matched_prefix_tokens: their tokens.
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

    @property
    def prompt(self) -> str:
        """The plain-text prompt (``"".join(segments)``)."""
        return "".join(self.segments)

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

        Items at duplicate positions are dropped from the prompt order; look them up through
        :attr:`duplicates`.

        Raises:
            ValueError: ``items`` has another length than the input.
        """
        expected = len(self.order) + len(self.duplicates)
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
        # Popular blocks recur across requests: remember (id, tokens) of recent texts.
        self._identify = functools.lru_cache(maxsize=block_cache_size)(self._identify_uncached)

    # ------------------------------------------------------------------ one request
    def plan(self, query: str, blocks: Sequence[str], *, rid: str | None = None) -> Plan:
        """Align one request against the index, index it, and render its prompt.

        Args:
            query: the question (a str; may be empty).
            blocks: block texts in retriever (relevance) order; identical texts are sent once
                (see :attr:`Plan.duplicates`).
            rid: request id; a new unique one when ``None``.

        Returns:
            A :class:`Plan`. The request is indexed under ``plan.rid``.

        Raises:
            TypeError / ValueError: bad ``query``, ``blocks`` or ``rid`` (the message names
                the field and the value).
        """
        request = self._prepare(query, blocks, field_name="blocks")
        rid = self._new_rid(rid)
        if not request.ids:
            return self._render(rid, request, [], 0, 0)
        weights = request.tokens if self.weight_by_tokens else None
        found = self.index.search(request.ids, weights)
        order = align(
            request.ids,
            found.prefix,
            rest_order=self.rest_order,
            popularity=self._popularity,
        )
        self._insert(rid, request, order)
        return self._render(rid, request, order, len(found.prefix), found.prefix_tokens)

    # ------------------------------------------------------------------ a batch
    def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
    ) -> BatchPlan:
        """Order a batch jointly, index it, and schedule it.

        Each request is first matched against what the index already holds; requests that
        matched the same prefix are then ordered together by the offline build, so blocks
        they share form common prefixes. The schedule runs requests sharing a prefix back to
        back.

        Args:
            queries: ``B`` questions.
            blocks: ``B`` lists of block texts, each in retriever order.
            rids: optional ``B`` request ids.

        Returns:
            :class:`BatchPlan` with plans in input order and the schedule.

        Raises:
            ValueError: ``queries``, ``blocks`` and ``rids`` of different lengths, repeated
                rids, or a bad entry (named by its index).
        """
        if len(queries) != len(blocks):
            raise ValueError(f"queries has {len(queries)} entries but blocks has {len(blocks)}")
        if rids is not None and len(rids) != len(queries):
            raise ValueError(f"rids has {len(rids)} entries for {len(queries)} queries")
        if rids is not None and len(set(rids)) != len(rids):
            raise ValueError("rids must be unique within a batch")
        requests = [
            self._prepare(q, b, field_name=f"blocks[{i}]")
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
            order = orders.get(i, [])
            if order:
                self._insert(batch_rids[i], request, order)
            prefix, prefix_tokens = matched[i]
            plans.append(self._render(batch_rids[i], request, order, len(prefix), prefix_tokens))
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
    def _prepare(self, query: str, blocks: Sequence[str], *, field_name: str) -> _Request:
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}: {query!r:.80}")
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
            bid, count = self._identify(text)
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
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty str, got {rid!r}")
        return rid

    def _insert(self, rid: str, request: _Request, order: Sequence[int]) -> None:
        token_of = dict(zip(request.ids, request.tokens))
        self.index.insert(rid, order, [token_of[b] for b in order])
        self._history.add(order)

    def _render(
        self,
        rid: str,
        request: _Request,
        order: Sequence[int],
        prefix_blocks: int,
        prefix_tokens: int,
    ) -> Plan:
        position = {bid: i for i, bid in enumerate(request.ids)}
        planned = [
            PlannedBlock(
                text=request.texts[position[bid]],
                block_id=bid,
                original_rank=request.ranks[position[bid]],
                tokens=request.tokens[position[bid]],
            )
            for bid in order
        ]
        annotation_order = None
        if self.annotate:
            annotation_order = sorted(range(len(planned)), key=lambda p: planned[p].original_rank)
        segments = self.layout.render_segments(
            [b.text for b in planned], request.query, annotation_order=annotation_order
        )
        return Plan(
            rid=rid,
            query=request.query,
            blocks=planned,
            order=[b.original_rank for b in planned],
            duplicates=dict(request.duplicates),
            segments=segments,
            matched_prefix_blocks=prefix_blocks,
            matched_prefix_tokens=prefix_tokens,
            layout=self.layout,
        )
