"""No wrong hint, no lost or phantom turn, through TTL expiry, LRU eviction, restarts (with a
fresh, a stale or no snapshot) and client fallbacks (docs/DESIGN.md, "Sure hints").

A model application keeps every conversation's prompt history as the model sees it: each turn
under its header, each shown block under its label. It resends the whole history (or the last
few turns, as it declares), and numbers its turns either itself (``Scope.turn``) or with the
store's numbers (``plan.scope.turn``). Every hint and sub-block pointer a plan makes must name a
(turn, label) that stands exactly once in what the app still sends, with the replaced text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import ContextPilot, PlacementStatus, Scope, TurnVisibility
from contextpilot_integrations.core.conversations.conversation import ConversationStore
from contextpilot_integrations.core.conversations.dedup import Deduplicator

TTL_S = 100.0
POOL = [f"passage {i}: " + " ".join(f"w{i}-{j}" for j in range(60)) for i in range(12)]
HINT = re.compile(r"(\[Doc \d+\]) (?:of turn (\d+)|in this message)")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class AppConversation:
    """What the app's prompt holds for one conversation."""

    numbered_by_app: bool
    window: int | None  # resends the last n turns; None: all
    turns: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (header, label->text)
    count: int = 0  # the app's own turn count
    suspect: bool = False  # a plan call failed: the client forgets it before the next call

    def visible(self) -> list[tuple[str, dict[str, str]]]:
        return self.turns if self.window is None else self.turns[-self.window :]


def new_pilot(clock: Clock) -> ContextPilot:
    store = ConversationStore(max_conversations=3, ttl_seconds=TTL_S, clock=clock)
    return ContextPilot(deduplicator=Deduplicator(store))


def check_hints(plan, app: AppConversation) -> int:
    """Count the plan's hints and pointers whose (turn, label) is not exactly one place in what
    the app sends, holding the named text."""
    wrong = 0
    visible = app.visible()
    shown_now = {p.label: p.rendered_text for p in plan.blocks}
    texts: list[tuple[str, str]] = [(p.hint or "", p.text) for p in plan.placements if p.hint]
    texts += [(p.rendered_text or "", "") for p in plan.blocks]
    for where, replaced_text in texts:
        for label, turn in HINT.findall(where):
            if not turn:  # "in this message"
                wrong += label not in shown_now
                continue
            places = [labels for header, labels in visible if header == turn]
            resolved = places[0].get(label) if len(places) == 1 else None
            wrong += resolved is None or bool(replaced_text and resolved != replaced_text)
    return wrong


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_no_wrong_hints_no_lost_or_phantom_turns(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    pilot = new_pilot(clock)
    snapshots: list[dict] = [pilot.snapshot()]
    apps = {
        f"c{i}": AppConversation(numbered_by_app=rng.random() < 0.5, window=rng.choice([None, 2]))
        for i in range(5)
    }
    wrong = hints = 0
    for _ in range(70):
        event = rng.random()
        if event < 0.05:
            clock.now += TTL_S + 1  # every conversation expires
            continue
        if event < 0.12:  # a restart: fresh, stale or lost snapshot
            kind = rng.choice(["final", "stale", "lost"])
            snapshot = pilot.snapshot(final=True) if kind == "final" else rng.choice(snapshots)
            pilot = new_pilot(clock)
            if kind == "lost":
                pilot.deduplicator.store.mark_history_lost()
            else:
                pilot.restore(snapshot)
            continue
        if event < 0.17:
            snapshots.append(pilot.snapshot())
            continue
        conversation_id = rng.choice(sorted(apps))
        app = apps[conversation_id]
        blocks = rng.sample(POOL, rng.randint(1, 4))
        app.count += 1
        turn = app.count if app.numbered_by_app else None
        visibility = TurnVisibility.all() if app.window is None else TurnVisibility.last(app.window)
        if app.suspect:  # the client's rule after a failed call (service/client_conversations.py)
            pilot.deduplicator.store.forget("", conversation_id)
            app.suspect = False
        if event < 0.25:  # the service is unreachable: the client plans locally, no hints
            if rng.random() < 0.5:  # ...but the service recorded the turn before timing out
                pilot.plan("q", blocks, scope=Scope(conversation_id, "", turn, visibility))
            local = ContextPilot().plan("q", blocks)
            assert not local.hints
            header = str(turn) if turn is not None else "?"
            app.turns.append((header, {p.label: p.rendered_text for p in local.blocks}))
            app.suspect = True
            continue
        plan = pilot.plan("q", blocks, scope=Scope(conversation_id, "", turn, visibility))
        hints += sum(p.status == PlacementStatus.REPLACED for p in plan.placements)
        wrong += check_hints(plan, app)
        store = pilot.deduplicator.store
        if plan.scope.turn is None:  # an amnesic store numbers no turn the app did not number
            assert turn is None and store.stats()["amnesic"]
        else:  # no lost turn: the returned turn is recorded, numbered as the app asked
            assert turn is None or plan.scope.turn == turn
            assert store._conversations.peek(("", conversation_id)).latest_turn() >= plan.scope.turn
        header = "?" if plan.scope.turn is None else str(plan.scope.turn)
        app.turns.append((header, {p.label: p.rendered_text for p in plan.blocks}))
    assert wrong == 0, f"{wrong} wrong hints of {hints}"


def test_the_property_finds_wrong_hints_when_numbering_restarts() -> None:
    """The check above is not vacuous: a store that forgets a conversation without a tombstone
    (numbering restarts at 1) produces hints the app's prompt cannot resolve."""
    clock = Clock()
    app = AppConversation(numbered_by_app=False, window=None)
    pilot = new_pilot(clock)
    scope = Scope("c")
    for blocks in ([POOL[0], POOL[1]], [POOL[2]]):
        plan = pilot.plan("q", blocks, scope=scope)
        app.turns.append((str(plan.scope.turn), {p.label: p.rendered_text for p in plan.blocks}))
    pilot = new_pilot(clock)  # a new store that does not know it lost history
    plan = pilot.plan("q", [POOL[3]], scope=scope)  # numbered 1 again
    app.turns.append((str(plan.scope.turn), {p.label: p.rendered_text for p in plan.blocks}))
    plan = pilot.plan("q", [POOL[3], POOL[4]], scope=scope)
    assert plan.hints and check_hints(plan, app) > 0
