"""The pilot's running totals: tokens removed by its own token counter, per (tenant,
conversation) and overall, with the engine's cached tokens, and one log line per plan."""

from __future__ import annotations

import logging

import pytest

from contextpilot_integrations.core.conversations.dedup import Deduplicator
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.core.usage import TOTAL_FIELDS, ConversationTotals


class WordCounter:
    """One token per whitespace-separated word: far from 4 bytes a token."""

    def count(self, text: str) -> int:
        return len(text.split())


def _blocks(tag: str, number: int = 3) -> list[str]:
    return [" ".join(f"{tag}{i}-word{w}" for w in range(80)) for i in range(number)]


def _figures(**given: int) -> dict[str, int]:
    return {**dict.fromkeys(TOTAL_FIELDS, 0), **given}


def test_tokens_removed_are_counted_by_the_pilots_counter() -> None:
    counter = WordCounter()
    # A deduplicator made without a counter would count 4 bytes a token.
    pilot = ContextPilot(token_counter=counter, deduplicator=Deduplicator(chunker=None))
    blocks = _blocks("a")
    scope = Scope(conversation_id="c", tenant="t")
    pilot.plan("q1", blocks, scope=scope)
    plan = pilot.plan("q2", blocks, scope=scope)

    assert plan.dedup_figures.blocks_replaced == 3
    expected = sum(counter.count(b) - counter.count(h) for b, h in zip(blocks, plan.hints))
    assert plan.dedup_figures.tokens_saved == expected
    assert plan.dedup_figures.tokens_in == sum(counter.count(b) for b in blocks)
    totals = pilot.stats()["totals"]
    assert totals["tokens_removed"] == expected and totals["plans"] == 2
    assert totals["blocks_replaced"] == 3


def test_two_tenants_with_one_conversation_id_are_two_conversations() -> None:
    pilot = ContextPilot()
    blocks = _blocks("x")
    removed = {}
    for tenant, turns in (("alice", 3), ("bob", 2)):
        scope = Scope(conversation_id="c", tenant=tenant)
        plans = [pilot.plan(f"q{t}", blocks, scope=scope) for t in range(turns)]
        removed[tenant] = sum(p.dedup_figures.tokens_saved for p in plans)
        pilot.record_usage(plans[-1].rid, 1000, 600 if tenant == "alice" else 100)
    assert removed["alice"] > removed["bob"] > 0
    pilot.record_usage("never-planned", 50, 10)  # counted overall only

    totals = pilot.totals()
    conversations = totals["conversations"]
    assert conversations.keys() == {"alice", "bob"}
    alice, bob = conversations["alice"]["c"], conversations["bob"]["c"]
    assert alice["plans"] == 3 and bob["plans"] == 2
    assert alice["tokens_removed"] == removed["alice"]
    assert bob["tokens_removed"] == removed["bob"]
    assert (alice["cached_tokens"], bob["cached_tokens"]) == (600, 100)
    assert totals["tenants"]["alice"] == alice  # every plan of alice's was in "c"
    assert totals["tokens_removed"] == removed["alice"] + removed["bob"]
    assert totals["cached_tokens"] == 710 and totals["usage_reports"] == 3
    assert pilot.stats()["usage"]["cached_tokens"] == 710  # the engine figures agree

    own = pilot.totals("bob")
    assert own["conversations"] == {"bob": {"c": bob}}
    assert {k: own[k] for k in TOTAL_FIELDS} == bob
    assert pilot.totals("carol") == {**_figures(), "conversations": {}}


def test_a_plan_without_a_conversation_adds_to_its_tenant_only() -> None:
    pilot = ContextPilot()
    plan = pilot.plan("q", _blocks("y"), scope=Scope(tenant="t"))
    pilot.record_usage(plan.rid, 300, 200)
    totals = pilot.totals()
    assert totals["conversations"] == {}
    assert totals["tenants"]["t"] == _figures(
        plans=1, usage_reports=1, prompt_tokens=300, cached_tokens=200
    )


def test_batches_add_each_plan() -> None:
    pilot = ContextPilot()
    blocks = _blocks("z")
    requests = [
        PlanRequest(f"q{i}", blocks, scope=Scope(conversation_id=f"c{i}", tenant="t"))
        for i in range(3)
    ]
    pilot.plan_batch(requests)
    again = pilot.plan_batch(requests)
    removed = sum(p.dedup_figures.tokens_saved for p in again.plans)
    totals = pilot.totals("t")
    assert totals["plans"] == 6 and totals["tokens_removed"] == removed > 0
    assert set(totals["conversations"]["t"]) == {"c0", "c1", "c2"}


def test_the_conversations_kept_are_the_most_recent() -> None:
    pilot = ContextPilot(stats_conversations=2, stats_tenants=1)
    for name in ("one", "two", "three"):
        pilot.plan("q", _blocks(name), scope=Scope(conversation_id=name, tenant=name))
    totals = pilot.totals()
    assert totals["conversations"] == {
        "two": {"two": _figures(plans=1)},
        "three": {"three": _figures(plans=1)},
    }
    assert list(totals["tenants"]) == ["three"]
    assert totals["plans"] == 3  # the overall figures keep everything


@pytest.mark.parametrize("bound", [0, -1, True, 1.5])
def test_bad_bounds_are_refused(bound: object) -> None:
    with pytest.raises(ValueError, match="max_conversations"):
        ConversationTotals(bound)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tenants"):
        ConversationTotals(max_tenants=bound)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"stats_conversations must be an int >= 1, got {bound}"):
        ContextPilot(stats_conversations=bound)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stats_tenants"):
        ContextPilot(stats_tenants=bound)  # type: ignore[arg-type]


def test_each_plan_logs_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    pilot = ContextPilot()
    blocks = _blocks("w")
    scope = Scope(conversation_id="chat 1", tenant="acme")
    with caplog.at_level(logging.INFO, logger="contextpilot_integrations.core.pilot"):
        pilot.plan("q", blocks, scope=scope)
        plan = pilot.plan("q", blocks, scope=scope)
        pilot.plan_batch([PlanRequest("q", blocks), PlanRequest("r", blocks)])
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 4
    assert all("\n" not in line for line in lines)  # ids hold no control characters
    assert f"rid={plan.rid} tenant='acme' conversation='chat 1' turn=2" in lines[1]
    assert f"hints=3 pointers=0 tokens_removed={plan.dedup_figures.tokens_saved}" in lines[1]
    assert "conversation=None" in lines[2] and "tokens_removed=0" in lines[2]
    assert not any(block in line for line in lines for block in blocks)


def test_a_rid_reported_twice_counts_once() -> None:
    # Two reporters of one engine call (the service's proxy and its client) count it once;
    # bad figures are still refused on the repeat.
    pilot = ContextPilot()
    scope = Scope(conversation_id="c", tenant="t")
    plan = pilot.plan("q", _blocks("a"), scope=scope)
    pilot.record_usage(plan.rid, 100, 40)
    pilot.record_usage(plan.rid, 100, 40)
    with pytest.raises(ValueError, match="cached_tokens"):
        pilot.record_usage(plan.rid, 10, 40)
    pilot.record_usage("never-planned", 50, 0)
    pilot.record_usage("never-planned", 50, 0)
    stats = pilot.stats()
    assert stats["usage"]["reports"] == 2
    assert stats["usage"]["prompt_tokens"] == 150
    conversation = pilot.totals()["conversations"]["t"]["c"]
    assert conversation["usage_reports"] == 1 and conversation["prompt_tokens"] == 100
    assert pilot.totals()["usage_reports"] == 2
