"""Choosing the replica for each request, and planning it there.

One request (:meth:`ReplicaPlanning.plan`):

1. searches every replica's index for the longest aligned prefix of the request's blocks;
2. picks the replica by that prefix, within the bounded-imbalance rule over the replicas' loads
   (:mod:`.replica_load`), with a conversation's last replica credited with its history;
3. plans there (alignment against that index, de-duplication, insert) and returns the plan with
   the replica's name and how to reach it: ``routing_key`` (``"gateway"`` mode: a gateway header,
   ``engine_fields.engine_headers``) or ``base_url`` (``"direct"`` mode).

A batch (:meth:`ReplicaPlanning.plan_batch`) is partitioned across replicas by the top of its
prefix tree and balanced by load (:func:`~.replica_load.partition_batch`); each part is ordered
and scheduled by its replica's pilot, and the parts' schedules are interleaved (replicas run in
parallel).

A rid is held from the choice of its replica until its plan is recorded (its route, its
conversation's last replica), so two concurrent calls never plan it; the choice is made under
the fleet's lock, the planning outside it. The per-request work is bounded by the request's
size times the number of replicas (docs/DESIGN.md, "Hot path").

A call with no blocks to plan (an agent's messages, forwarded by the service's proxy) is routed
alone (:meth:`ReplicaPlanning.route`): to its conversation's last replica, credited with its
history, within the same bounded-imbalance rule, else to the least loaded.

Public API: :class:`ReplicaPlanning`, :class:`ReplicaChoice`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from contextpilot_integrations.core.blocks import TokenCounter, block_id
from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.plan import BatchPlan, Placement, Plan
from contextpilot_integrations.core.replicas.replica_fleet import Replica, ReplicaFleet, Route
from contextpilot_integrations.core.replicas.replica_load import (
    batch_items,
    interleave,
    partition_batch,
    pick_replica,
)
from contextpilot_integrations.core.request import (
    PlanRequest,
    RidConflictError,
    Scope,
    check_batch,
    new_rid,
)
from contextpilot_integrations.core.request_blocks import distinct_blocks

__all__ = ["ReplicaChoice", "ReplicaPlanning"]


@dataclass(frozen=True, slots=True)
class ReplicaChoice:
    """Where a routed call goes (what a :class:`~.plan.Plan` of the router carries).

    Attributes:
        replica: the replica's name.
        routing_key: the gateway header's value (``"gateway"`` mode), else None.
        base_url: the replica's base URL (``"direct"`` mode), else None.
    """

    replica: str
    routing_key: str | None
    base_url: str | None


class ReplicaPlanning:
    """Plans requests on the replicas of a fleet (module docstring). Thread-safe.

    Args:
        fleet: the replicas; its lock guards what this keeps too.
        token_counter: text -> tokens, as the replicas' pilots count (a block's identity, a
            request's cost).
        direct: plans carry their replica's ``base_url`` (the ``"direct"`` mode); else its
            routing key.
        max_imbalance: the bounded-imbalance factor (:func:`~.replica_load.eligible`).
        max_conversations: conversations whose last replica is remembered.
    """

    def __init__(
        self,
        fleet: ReplicaFleet,
        token_counter: TokenCounter,
        *,
        direct: bool,
        max_imbalance: float,
        max_conversations: int,
    ) -> None:
        self._fleet = fleet
        self._token_counter = token_counter
        self._direct = direct
        self._imbalance = float(max_imbalance)
        # conversation -> (its last call's replica as planned, that prompt's tokens, its rid)
        self._conversations: LRU[tuple[str, str], tuple[str, int, str]] = LRU(max_conversations)
        self._planning: set[str] = set()
        self._identify = functools.lru_cache(maxsize=65_536)(self._identify_uncached)

    # ------------------------------------------------------------------ Public API
    def plan(self, request: PlanRequest) -> Plan:
        """Pick the replica for one (checked) request and plan it there (``ReplicaRouter.plan``).

        Raises:
            RidConflictError: its rid is indexed on a replica or being planned.
        """
        rid = request.rid or new_rid()
        ids, tokens, cost = self._measure(request)
        candidates = self._fleet.candidates()
        scores = self._scores([ids], [tokens], candidates)[0]
        loads, keys = self._fleet.loads, self._fleet.keys
        with self._reserved([rid]) as replicas:
            self._credit_conversation(request.scope, scores)
            names = [name for name in candidates if name in replicas]
            now = loads.loads(names)
            name = pick_replica(
                names, scores, now, loads.cost(cost), self._imbalance, self._routed_tokens(names)
            )
            loads.add(rid, name, cost)
            replica, key = replicas[name], keys.key_for(name)
        try:
            plan = replica.pilot.plan(request.query, request.blocks, rid=rid, scope=request.scope)
        except BaseException:
            self._abandon([rid])
            raise
        return self._routed([plan], replica, key)[0]

    def route(self, rid: str, scope: Scope, prompt_tokens: int) -> ReplicaChoice:
        """Pick the replica for a call with no blocks to plan (``ReplicaRouter.route``): the
        conversation's last replica is credited with its history; the bounded-imbalance rule
        and the least loaded decide the rest. The route, load and conversation are recorded
        as for a plan.

        Raises:
            RidConflictError: ``rid`` is indexed on a replica or being planned.
        """
        candidates = self._fleet.candidates()
        scores: dict[str, int] = {}
        loads, keys = self._fleet.loads, self._fleet.keys
        with self._reserved([rid]) as replicas:
            self._credit_conversation(scope, scores)
            names = [name for name in candidates if name in replicas]
            cost = max(1, prompt_tokens)
            name = pick_replica(
                names,
                scores,
                loads.loads(names),
                loads.cost(cost),
                self._imbalance,
                self._routed_tokens(names),
            )
            loads.add(rid, name, cost)
            key = keys.key_for(name)
            self._fleet.routes.put(rid, Route(name, key, ()))
            conversation = scope.conversation
            if conversation is not None:
                self._conversations.put(conversation, (name, cost, rid))
            self._planning.discard(rid)
            base_url = replicas[name].spec.base_url
        if self._direct:
            return ReplicaChoice(name, None, base_url)
        return ReplicaChoice(name, key, None)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """Partition a batch across the replicas and plan each part on its replica.

        Requests whose aligned order starts with the same block (the cached prefix they match
        on some replica, else their block most frequent in the batch) form a group; groups are
        assigned by :func:`~.replica_load.partition_batch`; each replica's part is planned with
        its pilot's ``plan_batch`` (joint order, schedule). The schedule interleaves the parts'
        schedules, one request per replica in turn.

        Returns:
            :class:`~.plan.BatchPlan`, plans in input order.

        Raises:
            TypeError / ValueError: as :func:`~.request.check_batch`.
            RidConflictError: a rid is indexed on a replica or being planned.
        """
        batch = check_batch(requests)
        if not batch:
            return BatchPlan(plans=(), schedule=())
        batch = [r if r.rid is not None else dataclasses.replace(r, rid=new_rid()) for r in batch]
        rids = [r.rid or "" for r in batch]
        measured = [self._measure(r) for r in batch]
        candidates = self._fleet.candidates()
        found = self._found([m[0] for m in measured], [m[1] for m in measured], candidates)
        loads, keys = self._fleet.loads, self._fleet.keys
        with self._reserved(rids) as replicas:
            names = [name for name in candidates if name in replicas]
            scores = [{name: tokens for name, (_, tokens) in f.items()} for f in found]
            for request, credited in zip(batch, scores):
                self._credit_conversation(request.scope, credited)
            prefixes = [_best_prefix(f) for f in found]
            items = batch_items(measured, prefixes, scores, loads.cost)
            assigned = partition_batch(items, names, loads.loads(names), self._imbalance)
            for rid, name, (_, _, cost) in zip(rids, assigned, measured):
                loads.add(rid, name, cost)
            parts = {name: [i for i, n in enumerate(assigned) if n == name] for name in names}
            targets = {name: (replicas[name], keys.key_for(name)) for name in parts}
        plans: list[Plan | None] = [None] * len(batch)
        schedules: list[list[int]] = []
        try:
            for name, part in parts.items():
                if not part:
                    continue
                replica, key = targets[name]
                planned = replica.pilot.plan_batch([batch[i] for i in part])
                for i, plan in zip(part, self._routed(planned.plans, replica, key)):
                    plans[i] = plan
                schedules.append([part[j] for j in planned.schedule])
        except BaseException:
            self._abandon([rid for rid, plan in zip(rids, plans) if plan is None])
            raise
        done = [plan for plan in plans if plan is not None]
        assert len(done) == len(batch)
        return BatchPlan(plans=tuple(done), schedule=tuple(interleave(schedules)))

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _reserved(self, rids: Sequence[str]) -> Iterator[dict[str, Replica]]:
        """Under the lock: refuse rids indexed on a replica or being planned, hold them for
        the call (released when the plans are recorded) and yield the replicas."""
        with self._fleet.lock:
            busy = next((rid for rid in rids if rid in self._planning), None)
            if busy is not None:
                raise RidConflictError(f"rid {busy!r} is being planned by a concurrent call")
            for rid in rids:
                for name, replica in self._fleet.replicas.items():
                    if rid in replica.pilot.index:
                        raise RidConflictError(f"rid {rid!r} is already indexed on {name!r}")
            self._planning.update(rids)
            try:
                yield dict(self._fleet.replicas)
            except BaseException:
                self._planning.difference_update(rids)
                raise

    def _routed_tokens(self, names: Sequence[str]) -> dict[str, int]:
        """Prompt tokens routed to each of ``names`` so far (lock held)."""
        return {name: self._fleet.loads.routed(name)[1] for name in names}

    def _abandon(self, rids: Sequence[str]) -> None:
        """Their plans failed: not routed after all, the rids free again."""
        with self._fleet.lock:
            for rid in rids:
                self._fleet.loads.cancel(rid)
            self._planning.difference_update(rids)

    def _routed(self, plans: Sequence[Plan], replica: Replica, key: str | None) -> list[Plan]:
        """Record each plan's route and conversation, release its rid; the plans as returned
        (``replica``, ``routing_key`` or ``base_url`` set)."""
        name, direct = replica.spec.name, self._direct
        out = []
        dropped: list[str] = []
        with self._fleet.lock:
            for plan in plans:
                blocks = tuple(self._indexed(p) for p in plan.blocks)
                self._fleet.routes.put(plan.rid, Route(name, key, blocks))
                dropped.extend(replica.held(plan.rid, blocks, plan.prompt_tokens))
                conversation = plan.scope.conversation
                if conversation is not None:
                    self._conversations.put(conversation, (name, plan.prompt_tokens, plan.rid))
                self._planning.discard(plan.rid)
                out.append(
                    dataclasses.replace(
                        plan,
                        replica=name,
                        routing_key=None if direct else key,
                        base_url=replica.spec.base_url if direct else None,
                    )
                )
        # What the replica's KV cache cannot hold any more leaves its index now, ahead of the
        # engine's events (the link goes on following it).
        for rid in dropped:
            replica.pilot.index.evict(rid)
        return out

    def _indexed(self, placement: Placement) -> tuple[int, int]:
        """What the pilot indexed for a shown block: the block as given, or as rendered when
        sub-blocks were replaced (as :meth:`ContextPilot.plan` does)."""
        rendered = placement.rendered_text
        if rendered is None or rendered == placement.text:
            return placement.block_id or 0, placement.tokens
        return self._identify(rendered)

    def _credit_conversation(self, scope: Scope, scores: dict[str, int]) -> None:
        """A conversation's last replica holds its history: credit it with that prompt's
        tokens (lock held). The replica is where that call went as the fleet last learnt it
        (its route, moved when its engine's events or a gateway's answer name another), else
        the one planned."""
        conversation = scope.conversation
        last = self._conversations.get(conversation) if conversation is not None else None
        if last is not None:
            planned, tokens, rid = last
            route = self._fleet.routes.peek(rid)
            name = route.replica if route is not None else planned
            scores[name] = scores.get(name, 0) + tokens

    def _measure(self, request: PlanRequest) -> tuple[list[int], list[int], int]:
        """The request's distinct block ids and tokens (as the pilot identifies them) and its
        prompt tokens (blocks and question)."""
        distinct = distinct_blocks(request.blocks, self._identify)
        cost = sum(distinct.tokens) + self._token_counter.count(request.query)
        return distinct.ids, distinct.tokens, cost

    def _found(
        self, ids: Sequence[list[int]], tokens: Sequence[list[int]], names: Sequence[str]
    ) -> list[dict[str, tuple[tuple[int, ...], int]]]:
        """Per request, replica -> (its longest aligned prefix there, its tokens); outside
        the lock (each index is thread-safe)."""
        with self._fleet.lock:
            replicas = self._fleet.replicas
            indexes = [(n, replicas[n].pilot.index) for n in names if n in replicas]
        out = []
        for request_ids, request_tokens in zip(ids, tokens):
            found = {}
            if request_ids:
                # The request's block -> tokens map (its blocks are distinct), made once for
                # every replica's search (docs/DESIGN.md, "Hot path").
                weight = dict(zip(request_ids, request_tokens))
                for name, index in indexes:
                    result = index.search_weights(weight)
                    found[name] = (result.prefix, result.prefix_tokens)
            out.append(found)
        return out

    def _scores(
        self, ids: Sequence[list[int]], tokens: Sequence[list[int]], names: Sequence[str]
    ) -> list[dict[str, int]]:
        return [
            {name: matched for name, (_, matched) in found.items()}
            for found in self._found(ids, tokens, names)
        ]

    def _identify_uncached(self, text: str) -> tuple[int, int]:
        return block_id(text), max(1, self._token_counter.count(text))


def _best_prefix(found: Mapping[str, tuple[tuple[int, ...], int]]) -> tuple[int, ...]:
    """The longest (in tokens) of a request's cached prefixes over the replicas; the first
    replica's on a tie."""
    return max(found.values(), key=lambda match: match[1], default=((), 0))[0]
