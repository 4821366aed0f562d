"""Multi-turn replay: each conversation turn by turn, every prompt holding the conversation so far.

Workload ``mtrag-conversations``: MTRAG-UN's user turns in order. Turn ``t`` retrieves the
top-``k`` BM25 blocks of its collection for the new user turn (``retrieval_query="turn"``) or
for the user turns so far (``"conversation"``, MTRAG's own ``questions`` task). Its prompt is
what a chat application sends without ContextPilot: the conversation so far, then the turn::

    [system prompt]
    [### Turn 1\\n][block 1]...[block n][hints][annotation][Question: q1\\nAnswer:][ a1\\n]
    ...
    [### Turn t\\n][block 1]...[block n][hints][annotation][Question: qt\\nAnswer:]

assembled by :meth:`PromptLayout.render_turns`: each earlier turn exactly as it was sent, then
the agent's recorded answer (``Request.answer``), so turn ``t - 1``'s prompt is a byte-identical
prefix of turn ``t``'s and the engine's prefix cache reuses it. The answer segment starts with a
space and ends with a newline: GPT-2 / Llama 3 pre-tokenizers cut at both, so the prefix is
stable in tokens too. ``history_turns=n`` keeps only the last ``n`` earlier turns.

Methods (a fresh engine and :class:`ContextPilot` each): ``baseline`` (retriever order);
``alignment`` (:meth:`ContextPilot.plan` per turn without a conversation: aligned, annotated);
``alignment+dedup`` (with ``Scope(conversation_id, turn=...)``: a block an earlier turn already
shows becomes a location hint, repeated sub-blocks pointers;
:mod:`~contextpilot_integrations.core.conversations.dedup`).

Only a first turn's blocks can share a cached prefix with another conversation, so a later
turn's request is evicted from the index right after planning (its blocks still count for the
popularity order); the request ids the engine evicts are passed to :meth:`ContextPilot.evict`.
``sessions=N`` interleaves ``N`` open conversations
(:func:`~contextpilot_bench.prepared_conversations.interleave_turns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from contextpilot_bench.engine import EmbeddedEngine, Engine
from contextpilot_bench.methods import MethodResult, RequestRecord, engine_link, send
from contextpilot_bench.prepared_conversations import (
    PreparedConversations,
    ReplayTurn,
    interleave_turns,
)
from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.request import Scope

__all__ = [
    "ANSWER_TEMPLATE",
    "MULTITURN_METHODS",
    "MULTITURN_WORKLOADS",
    "MultiTurnResult",
    "ReplayedTurn",
    "replay",
    "run_multiturn",
]

MULTITURN_METHODS = ("baseline", "alignment", "alignment+dedup")
MULTITURN_WORKLOADS = ("mtrag-conversations",)
ANSWER_TEMPLATE = " {answer}\n"
"""The recorded answer after an earlier turn's ``Answer:`` (stripped of outer whitespace)."""


# --- the replay -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayedTurn:
    """One turn's prompt as a method sends it.

    Attributes:
        turn: the turn.
        rid: the request id sent to the engine.
        segments: the whole prompt: ``[system, <each earlier turn the prompt holds: header,
            blocks..., tail, answer>, header, blocks..., tail]``; ``"".join(segments)`` is the
            plain-text prompt (the chat form puts everything after the system prompt in one user
            message).
        turns: the turn numbers the prompt holds, in order (the last is ``turn.number``).
        starts: index in ``segments`` of each of those turns' header.
        plan: the ContextPilot plan of this turn (``None`` for the baseline).
        plan_seconds: wall time of planning it (``plan`` and the index bookkeeping).
    """

    turn: ReplayTurn
    rid: str
    segments: list[str]
    turns: tuple[int, ...]
    starts: tuple[int, ...]
    plan: Plan | None
    plan_seconds: float


def _answer_segment(answer: str | None) -> str:
    return ANSWER_TEMPLATE.format(answer=answer.strip()) if answer is not None else "\n"


def _check_method(method: str) -> None:
    if method not in MULTITURN_METHODS:
        raise ValueError(f"method must be one of {MULTITURN_METHODS}, got {method!r}")


def replay(
    prepared: PreparedConversations,
    method: str,
    *,
    sessions: int = 1,
    pilot: ContextPilot | None = None,
    history_turns: int | None = None,
) -> Iterator[ReplayedTurn]:
    """Build every turn's prompt, in the send order of :func:`interleave_turns`.

    Lazy: each turn is planned when it is asked for, so a caller can pass the engine's
    evictions to ``pilot`` between turns.

    Args:
        prepared: the conversations.
        method: one of :data:`MULTITURN_METHODS`.
        sessions: conversations open at a time.
        pilot: the ContextPilot of ``alignment`` / ``alignment+dedup`` (default: a new one with
            the run's layout and counter); ignored by the baseline.
        history_turns: earlier turns the prompt keeps (the last ones); ``None``: all.

    Yields:
        One :class:`ReplayedTurn` per turn.

    Raises:
        ValueError: unknown method, ``sessions < 1`` or ``history_turns < 0``.
    """
    _check_method(method)
    if history_turns is not None and (isinstance(history_turns, bool) or history_turns < 0):
        raise ValueError(f"history_turns must be None or an int >= 0, got {history_turns!r}")
    order = interleave_turns(prepared.conversations, sessions)
    layout = prepared.layout
    if method != "baseline" and pilot is None:
        pilot = ContextPilot(layout=layout, token_counter=prepared.counter)
    dedup = method == "alignment+dedup"
    visibility = None if history_turns is None else TurnVisibility.last(history_turns)
    # conversation -> (turn number, segments after the header: blocks..., tail, answer) sent
    sent: dict[str, list[tuple[int, list[str]]]] = {}
    for turn in order:
        earlier = sent.setdefault(turn.conversation_id, [])
        shown = (
            earlier if history_turns is None else earlier[max(0, len(earlier) - history_turns) :]
        )
        rid = f"{method}-{turn.request_id}"
        plan: Plan | None = None
        elapsed = 0.0
        if pilot is None:
            own = layout.render_segments(list(turn.blocks), turn.question)
        else:
            start = time.perf_counter()
            scope = (
                Scope(turn.conversation_id, turn=turn.number, visibility=visibility)
                if dedup
                else None
            )
            plan = pilot.plan(turn.question, turn.blocks, rid=rid, scope=scope)
            if shown or turn.number != 1:
                # Not at the root of the engine's cache: nothing else can share its prefix.
                pilot.evict(plan.rid)
            elapsed = time.perf_counter() - start
            own = list(plan.segments)
        # The hints name turns by the number the plan was made as.
        number = (
            plan.scope.turn if plan is not None and plan.scope.turn is not None else turn.number
        )
        segments, starts = layout.render_turns([*shown, (number, own[1:])])
        yield ReplayedTurn(
            turn,
            rid,
            [own[0], *segments],
            (*(n for n, _ in shown), number),
            tuple(start + 1 for start in starts),  # after the system segment
            plan,
            elapsed,
        )
        earlier.append((number, [*own[1:], _answer_segment(turn.answer)]))


# --- running a method through an engine -------------------------------------------------------


@dataclass
class MultiTurnResult:
    """One method's multi-turn run.

    Attributes:
        result: the per-request records (send order), planning time and cache counters.
        sessions: conversations open at a time.
        plan_ms: planning time per request in milliseconds (empty for the baseline).
        dedup: the de-duplication figures summed over the requests (the fields of
            ``Plan.dedup_figures``).
        evicted_from_index: engine evictions passed to :meth:`ContextPilot.evict` that
            removed a request the index still held.
    """

    result: MethodResult
    sessions: int
    plan_ms: list[float] = field(default_factory=list)
    dedup: dict[str, int] = field(default_factory=dict)
    evicted_from_index: int = 0

    @property
    def method(self) -> str:
        return self.result.method


def run_multiturn(
    method: str,
    prepared: PreparedConversations,
    *,
    engine_factory: Callable[[], Engine],
    sessions: int = 1,
    history_turns: int | None = None,
    pilot_factory: Callable[[], ContextPilot] | None = None,
    progress: bool = False,
) -> MultiTurnResult:
    """Replay the conversations with one method through a fresh engine.

    Args:
        method: one of :data:`MULTITURN_METHODS`.
        prepared: the conversations.
        engine_factory: returns a fresh (empty-cache) engine.
        sessions: conversations open at a time (:func:`interleave_turns`).
        history_turns: earlier turns each prompt keeps (``None``: all).
        pilot_factory: returns a fresh ContextPilot, the caller's to close (default: one with
            the run's layout and counter, following the engine with
            ``engine=engine_link(engine.cache_sync)``, closed after the run).
        progress: show a tqdm progress bar on stderr.

    Returns:
        The :class:`MultiTurnResult`.

    Raises:
        ValueError: unknown method, ``sessions < 1`` or ``history_turns < 0``.
    """
    _check_method(method)
    engine = engine_factory()
    records: list[RequestRecord] = []
    plan_ms: list[float] = []
    dedup: dict[str, int] = {}
    evicted = 0
    with contextlib.ExitStack() as owned:
        pilot = None
        if method != "baseline":
            pilot = (
                pilot_factory()
                if pilot_factory is not None
                else owned.enter_context(
                    ContextPilot(
                        layout=prepared.layout,
                        token_counter=prepared.counter,
                        engine=engine_link(engine.cache_sync),
                    )
                )
            )
            engine.sync(pilot)
        turns = replay(
            prepared, method, sessions=sessions, pilot=pilot, history_turns=history_turns
        )
        label = f"{method} x{sessions}"
        with tqdm(
            total=prepared.turns, desc=label, unit="req", disable=not progress, leave=False
        ) as bar:
            for sent in turns:
                served = send(engine, sent.rid, sent.segments, pilot)
                records.append(
                    RequestRecord(
                        sent.turn.request_index,
                        sent.rid,
                        served.prompt_tokens,
                        served.cached_tokens,
                        served.ttft_s,
                    )
                )
                evicted_rids = engine.take_evicted_rids()
                if sent.plan is not None and pilot is not None:
                    start = time.perf_counter()
                    evicted += sum(pilot.evict(rid) for rid in evicted_rids)
                    plan_ms.append(1000 * (sent.plan_seconds + time.perf_counter() - start))
                    for key, value in dataclasses.asdict(sent.plan.dedup_figures).items():
                        dedup[key] = dedup.get(key, 0) + value
                bar.update()
        engine.sync(pilot)
        result = MethodResult(
            method,
            records,
            plan_seconds=sum(plan_ms) / 1000,
            index=pilot.stats() if pilot is not None else {},
        )
    if isinstance(engine, EmbeddedEngine):
        result.cache = engine.model.stats()
    return MultiTurnResult(result, sessions, plan_ms, dedup, evicted)
