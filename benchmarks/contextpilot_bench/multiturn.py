"""Multi-turn replay: each conversation turn by turn, every prompt holding the conversation so far.

Workload ``mtrag-conversations`` (:mod:`~contextpilot_bench.workloads`): the 507
MTRAG-UN conversations, their 2,191 user turns in order. Turn ``t`` retrieves the top-``k`` BM25
blocks of its collection (:mod:`~contextpilot_bench.retrieval`) for the new user
turn (``retrieval_query="turn"``, the default) or for the user turns so far joined by spaces
(``"conversation"``, the input of MTRAG's own ``questions`` retrieval task). Its prompt is what a
chat application sends today, the whole conversation so far, then the new turn::

    [system prompt]
    [### Turn 1\\n][block 1]...[block n][hints][annotation][Question: q1\\nAnswer:][ a1\\n]
    ...
    [### Turn t\\n][block 1]...[block n][hints][annotation][Question: qt\\nAnswer:]

The turns are assembled by the core's one multi-turn assembly,
:meth:`PromptLayout.render_turns` (each turn after its ``layout.turn_header``): each earlier turn
is rendered exactly as it was sent (its blocks, hints, annotation and question,
:meth:`PromptLayout.render_segments`), followed by the agent's answer recorded in the data
(``Request.answer``). So the prompt of turn ``t - 1`` is a byte-identical prefix of the
prompt of turn ``t`` and the engine's prefix cache reuses it (RadixAttention, Zheng et al. 2024).
The answer segment starts with a space after ``Answer:`` and ends with a newline before the next
``###``: pre-tokenizers of the GPT-2 / Llama 3 family cut at both, so the prefix is stable in
tokens too. With ``history_turns=n`` the application keeps only the last ``n`` earlier turns
(then the prefix moves as the window slides).

Methods (one fresh engine, and one fresh :class:`ContextPilot`, per method):

``baseline``
    Each turn's blocks in retriever order, no annotation, no de-duplication.
``alignment``
    :meth:`ContextPilot.plan` per turn without a conversation id: blocks ordered against the
    context index, the order annotation, no de-duplication.
``alignment+dedup``
    The same with ``Scope(conversation_id, turn=...)`` (the MTRAG conversation id and the turn
    number; the plan's ``scope.turn`` is the number its hints name): a block an earlier turn
    already shows is replaced by a location hint naming the turn and label where it stands,
    repeated sub-blocks by pointers (ContextPilot paper, "multi-turn de-duplication";
    :mod:`~contextpilot_integrations.core.conversations.dedup`).

The context index mirrors prompts whose blocks follow the system prompt and the first turn's
header: only those can share a cached prefix with another conversation. A later turn's blocks
sit behind its own conversation's history in the engine's cache, so its request is taken out of
the index right after planning (:meth:`ContextPilot.evict`; its blocks still count for the
popularity order). With a limited cache, request ids the engine model evicts are passed to
:meth:`ContextPilot.evict` (paper, section 4.3).

Interleaving (``sessions=N``): ``N`` conversations are open at a time, their turns sent round
robin (:func:`~contextpilot_bench.prepared_conversations.interleave`).

Figures (:mod:`~contextpilot_bench.multiturn_report`, with the measured ones):
prompt tokens, cached tokens, prefill tokens (prompt minus cached), hit ratio, prefill against
the baseline's, the median planning time per request, and the de-duplication counts;
:attr:`PreparedConversations.repeat_share` is the share of retrieved blocks that an earlier turn
of the same conversation also retrieved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from contextpilot_bench.engine import EmbeddedEngine, Engine
from contextpilot_bench.methods import MethodResult, RequestRecord, send
from contextpilot_bench.prepared_conversations import (
    PreparedConversations,
    ReplayTurn,
    interleave,
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
    """Build every turn's prompt, in the send order of :func:`interleave`.

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
    order = interleave(prepared.conversations, sessions)
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
        sessions: conversations open at a time (:func:`interleave`).
        history_turns: earlier turns each prompt keeps (``None``: all).
        pilot_factory: returns a fresh ContextPilot, the caller's to close (default: one with
            the run's layout and counter, following the engine with
            ``cache_sync=engine.cache_sync``, closed after the run).
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
                        cache_sync=engine.cache_sync,
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
