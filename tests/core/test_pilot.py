"""The ContextPilot facade: lossless, deterministic, clear errors, shared prefixes, placements."""

import asyncio
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import (
    ContextPilot,
    OrderingConfig,
    PlacementStatus,
    Planner,
    PlanRequest,
    PromptLayout,
    RidConflictError,
    Scope,
    TurnVisibility,
)

block_texts = st.lists(
    st.one_of(
        st.sampled_from([f"document {i} " + "x" * (i * 7) for i in range(15)]),
        st.sampled_from(["", "  ", "\n"]),
    ),
    min_size=0,
    max_size=8,
)


def _assert_lossless(plan, blocks):
    """Every input has one placement, and the prompt shows each text once or a hint for it."""
    assert [p.index for p in plan.placements] == list(range(len(blocks)))
    assert sorted(p.index for p in plan.output_order()) == list(range(len(blocks)))
    for p in plan.placements:
        assert p.text == blocks[p.index]
        if p.status == PlacementStatus.SHOWN:
            assert p.rendered_text in plan.prompt and plan.blocks[p.position] is p
        elif p.status == PlacementStatus.DUPLICATE:
            first = plan.placements[p.duplicate_of]
            assert first.text == p.text and first.status in ("shown", "replaced")
            assert p.duplicate_of < p.index
        elif p.status == PlacementStatus.REPLACED:
            assert p.hint == plan.hints[p.position] and p.hint in plan.prompt
        else:
            assert p.status == PlacementStatus.SKIPPED and not p.text.strip()
            assert p.block_id is None
    assert [b.text for b in plan.blocks] == [blocks[i] for i in plan.order]


@settings(max_examples=60, deadline=None)
@given(st.lists(block_texts, min_size=1, max_size=12))
def test_plan_and_plan_batch_are_lossless_and_deterministic(requests):
    queries = [f"question {i}" for i in range(len(requests))]
    outputs = []
    for _ in range(2):
        pilot = ContextPilot()
        online = [pilot.plan(q, b, rid=f"o{i}") for i, (q, b) in enumerate(zip(queries, requests))]
        batch = pilot.plan_batch(
            [PlanRequest(q, b, rid=f"r{i}") for i, (q, b) in enumerate(zip(queries, requests))]
        )
        for plan, blocks in zip(online + list(batch.plans), requests + requests):
            _assert_lossless(plan, blocks)
        assert sorted(batch.schedule) == list(range(len(requests)))
        assert [batch.schedule[p] for p in batch.schedule_positions] == list(range(len(requests)))
        outputs.append(([p.prompt for p in online + list(batch.plans)], batch.schedule))
    assert outputs[0] == outputs[1]


def test_the_pilot_meets_the_planner_contract():
    assert isinstance(ContextPilot(), Planner)


def test_shared_blocks_form_a_byte_identical_prefix_and_annotation_comes_after():
    pilot = ContextPilot(ordering=OrderingConfig(reorder="always"))
    first = pilot.plan("q1", ["alpha text", "beta text", "gamma text"])
    second = pilot.plan("q2", ["delta text", "gamma text", "alpha text"])
    shared = {"alpha text", "gamma text"}
    assert {b.text for b in second.blocks[:2]} <= shared | {first.blocks[0].text}
    common = os.path.commonprefix([first.prompt, second.prompt])
    prefix_end = len("".join(second.segments[:2]))  # system + first block
    assert len(common) >= prefix_end
    assert second.prompt.index("priority order") > second.prompt.index("delta text")
    # The annotation restores retriever order: rank 0 ("delta") is named first.
    label_of = {b.text: b.label for b in second.blocks}
    annotation = second.segments[-1]
    assert annotation.index(label_of["delta text"]) < annotation.index(label_of["gamma text"])
    assert [b.label for b in second.blocks] == ["[Doc 1]", "[Doc 2]", "[Doc 3]"]


def test_batch_schedule_runs_requests_sharing_a_prefix_back_to_back():
    pilot = ContextPilot()
    a, c = "shared block A " * 10, "other block C " * 10
    batch = pilot.plan_batch(
        [
            PlanRequest("q0", [a, "u0"]),
            PlanRequest("q1", [c, "u1"]),
            PlanRequest("q2", ["u2", a]),
            PlanRequest("q3", [c, "u3"]),
        ]
    )
    position = batch.schedule_positions
    assert abs(position[0] - position[2]) == 1 and abs(position[1] - position[3]) == 1
    assert batch.plans[2].blocks[0].text == a  # aligned: shared block first


def test_bad_input_gets_clear_errors():
    pilot = ContextPilot()
    with pytest.raises(TypeError, match=r"blocks\[0\] must be a str.*int"):
        pilot.plan("q", [3])
    with pytest.raises(TypeError, match="blocks must be a sequence"):
        pilot.plan("q", "a single string")
    with pytest.raises(TypeError, match="query must be a str"):
        pilot.plan(None, ["x"])
    with pytest.raises(ValueError, match="rid"):
        pilot.plan("q", ["x"], rid="")
    with pytest.raises(TypeError, match="scope must be a Scope"):
        pilot.plan("q", ["x"], scope={"conversation_id": "c"})
    with pytest.raises(ValueError, match=r"requests\[1\].rid 'r' repeats requests\[0\]"):
        pilot.plan_batch([PlanRequest("a", ["x"], rid="r"), PlanRequest("b", ["y"], rid="r")])
    with pytest.raises(TypeError, match=r"requests\[1\] must be a PlanRequest"):
        pilot.plan_batch([PlanRequest("a", ["x"]), ("b", ["y"])])
    with pytest.raises(TypeError, match="requests must be a sequence of PlanRequest"):
        pilot.plan_batch(PlanRequest("a", ["x"]))
    assert len(pilot.index) == 0  # nothing half-indexed after a rejected batch


def test_empty_context_repeated_and_empty_blocks_are_placed():
    pilot = ContextPilot()
    empty = pilot.plan("q", [])
    assert empty.blocks == () and empty.prompt.endswith("Question: q\nAnswer:")
    assert "x" not in [r for r in pilot.index.rids()]
    plan = pilot.plan("q", ["same", "  ", "other", "same", ""])
    statuses = [p.status.value for p in plan.placements]
    assert statuses == ["shown", "skipped", "shown", "duplicate", "skipped"]
    assert plan.placements[3].duplicate_of == 0
    assert plan.placements[3].block_id == plan.placements[0].block_id
    assert plan.prompt.count("same\n") == 1
    assert [p.index for p in plan.output_order()] == [0, 2, 3, 1, 4]


def test_tens_of_thousands_of_blocks_in_one_request():
    pilot = ContextPilot()
    blocks = [f"block number {i}" for i in range(30_000)]
    plan = pilot.plan("q", blocks)
    assert len(plan.blocks) == 30_000
    again = pilot.plan("q2", list(reversed(blocks)))
    assert again.matched_prefix_blocks == 30_000


def test_reorder_and_messages():
    pilot = ContextPilot(
        layout=PromptLayout(system_prompt="SYS"), ordering=OrderingConfig(reorder="always")
    )
    pilot.plan("q", ["b1", "b2"])
    plan = pilot.plan("q", ["b0", "b2", "b1"])
    docs = ["D0", "D2", "D1"]
    assert plan.reorder(docs) == [docs[i] for i in plan.order]
    with pytest.raises(ValueError, match="made for 3"):
        plan.reorder(docs[:2])
    messages = plan.messages
    assert messages[0] == {"role": "system", "content": "SYS"}
    assert messages[1]["content"].startswith("[Doc 1]\n")
    assert plan.context == messages[1]["content"].removesuffix("Question: q\nAnswer:")


LONG = [f"passage {i}: " + "words of a long retrieved passage " * 12 for i in range(6)]


def _conversation(conversation_id, tenant="", turn=None, visibility=None):
    return Scope(conversation_id, tenant, turn, visibility)


def test_conversation_turns_replace_repeated_blocks_with_hints_to_visible_turns():
    pilot = ContextPilot()
    first = pilot.plan("q1", LONG[:3], scope=_conversation("c1", "t"))
    assert first.scope.turn == 1 and not first.hints
    second = pilot.plan("q2", [LONG[1], LONG[3]], scope=_conversation("c1", "t"))
    replaced = second.placements[0]
    assert replaced.status == PlacementStatus.REPLACED  # LONG[1] was shown in turn 1
    assert replaced.position == 0 and second.hints == (replaced.hint,)
    assert "of turn 1" in replaced.hint and replaced.hint in second.prompt
    label = replaced.hint.split("Also relevant: ")[1].split(" of turn")[0]
    assert label == first.placements[1].label
    assert second.dedup_figures.blocks_replaced == 1 and second.dedup_figures.tokens_saved > 0
    assert second.scope == Scope("c1", "t", 2)
    # The annotation still names the replaced block, by where it stands.
    assert "of turn 1" in second.segments[-1].split("priority order")[1]
    assert [p.index for p in second.output_order()] == [1, 0]


def test_no_conversation_and_other_tenants_never_deduplicate():
    pilot = ContextPilot()
    pilot.plan("q1", LONG[:2], scope=_conversation("c1", "alice"))
    assert not pilot.plan("q2", LONG[:2]).hints
    assert not pilot.plan("q3", LONG[:2], scope=_conversation("c1", "bob")).hints
    assert not pilot.plan("q4", LONG[:2], scope=_conversation("c2", "alice")).hints
    assert pilot.plan("q5", LONG[:2], scope=_conversation("c1", "alice")).hints


def test_hints_only_point_at_turns_the_app_still_sends():
    pilot = ContextPilot()
    pilot.plan("q1", [LONG[0]], scope=_conversation("c", turn=1))
    pilot.plan("q2", [LONG[1]], scope=_conversation("c", turn=2))
    third = pilot.plan(
        "q3",
        [LONG[0], LONG[1]],
        scope=_conversation("c", turn=3, visibility=TurnVisibility.last(1)),
    )
    statuses = [p.status.value for p in third.placements]
    assert statuses == ["shown", "replaced"] and "turn 2" in third.placements[1].hint


def test_batch_with_conversations():
    pilot = ContextPilot()
    pilot.plan("q0", [LONG[0]], scope=_conversation("a"))
    batch = pilot.plan_batch(
        [
            PlanRequest("q1", [LONG[0], LONG[1]], scope=_conversation("a")),
            PlanRequest("q2", [LONG[0], LONG[2]]),
        ]
    )
    assert batch.plans[0].placements[0].status == PlacementStatus.REPLACED
    assert not batch.plans[1].hints
    with pytest.raises(ValueError, match="same conversation 'z'"):
        pilot.plan_batch(
            [
                PlanRequest("x", [LONG[3]], scope=_conversation("z")),
                PlanRequest("y", [LONG[4]], scope=_conversation("z")),
            ]
        )


def test_batch_takes_turns_and_visibility_per_request():
    pilot = ContextPilot()
    pilot.plan("q1", [LONG[0]], scope=_conversation("a", turn=1))
    pilot.plan("q2", [LONG[1]], scope=_conversation("a", turn=2))
    batch = pilot.plan_batch(
        [
            PlanRequest(
                "q3",
                [LONG[0], LONG[1]],
                scope=_conversation("a", turn=3, visibility=TurnVisibility.last(1)),
            ),
            PlanRequest("q4", [LONG[0]], scope=_conversation("b")),
        ]
    )
    assert batch.plans[0].scope.turn == 3
    assert [p.status.value for p in batch.plans[0].placements] == ["shown", "replaced"]
    assert batch.plans[1].scope.turn == 1 and not batch.plans[1].hints


def test_unencodable_text_and_context_tail():
    pilot = ContextPilot(ordering=OrderingConfig(reorder="always"))
    with pytest.raises(ValueError, match=r"blocks\[1\] cannot be encoded as UTF-8"):
        pilot.plan("q", ["fine", "bad \ud800"])
    pilot.plan("warm", ["b text"])
    plan = pilot.plan("the question", ["a text", "b text"])  # "b text" is moved first
    assert plan.order == [1, 0]
    assert plan.segments[-1] == plan.context_tail + "Question: the question\nAnswer:"
    assert plan.context_tail.startswith("Read the documents")


def test_no_annotation_when_the_prompt_already_shows_relevance_order():
    pilot = ContextPilot()
    plan = pilot.plan("q", ["first text", "second text"])
    assert plan.order == [0, 1] and plan.annotation_labels == ()
    assert "priority order" not in plan.prompt


def test_more_bad_input_names_the_field():
    pilot = ContextPilot()
    with pytest.raises(ValueError, match="query cannot be encoded"):
        pilot.plan("q\udfff", ["a"])
    with pytest.raises(TypeError, match="rid must be a str, got int"):
        pilot.plan("q", ["a"], rid=5)
    with pytest.raises(TypeError, match="rid must be a str"):
        pilot.evict(None)
    with pytest.raises(ValueError, match=r"scope.turn=3 needs a scope.conversation_id"):
        Scope(turn=3)
    with pytest.raises(TypeError, match="scope.turn must be an int"):
        Scope("c", turn=True)
    with pytest.raises(ValueError, match="scope.conversation_id must be a non-empty str"):
        Scope("")
    with pytest.raises(TypeError, match="scope.visibility must be a TurnVisibility"):
        Scope("c", visibility=3)
    with pytest.raises(ValueError, match="cached_tokens"):
        pilot.record_usage("r", 5, 6)


def test_an_indexed_rid_conflicts():
    pilot = ContextPilot()
    pilot.plan("q", ["a text"], rid="r1")
    with pytest.raises(RidConflictError, match="already indexed"):
        pilot.plan("q", ["b text"], rid="r1")
    with pytest.raises(RidConflictError, match="already indexed"):
        pilot.plan_batch([PlanRequest("q", ["c text"], rid="r1")])


def test_two_threads_planning_one_rid_leave_no_phantom_turn():
    """Exactly one of two concurrent plans with the same explicit rid wins, and the loser
    records no conversation turn (it fails before planning)."""

    def plan(pilot, scope, barrier, outcomes, query: str) -> None:
        barrier.wait()
        try:
            outcomes.append(pilot.plan(query, [LONG[0], query * 40], rid="same", scope=scope))
        except RidConflictError as exc:
            outcomes.append(exc)

    for attempt in range(50):
        pilot = ContextPilot()
        scope = Scope(f"c{attempt}")
        barrier = threading.Barrier(2)
        outcomes: list[object] = []
        threads = [
            threading.Thread(target=plan, args=(pilot, scope, barrier, outcomes, q))
            for q in ("first", "other")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wins = [o for o in outcomes if not isinstance(o, Exception)]
        assert len(wins) == 1
        assert pilot.deduplicator.store.stats()["turns"] == 1
        assert pilot.plan("next", [LONG[1]], scope=scope).scope.turn == 2


def test_async_twins_plan_in_a_worker_thread():
    pilot = ContextPilot()

    async def main():
        loop_thread = threading.get_ident()
        seen = []
        original = pilot.plan

        def spy(*args, **kwargs):
            seen.append(threading.get_ident())
            return original(*args, **kwargs)

        pilot.plan = spy  # type: ignore[method-assign]
        plan = await pilot.aplan("q", ["a text", "b text"], scope=Scope("c"))
        batch = await pilot.aplan_batch([PlanRequest("q2", ["b text", "c text"])])
        return loop_thread, seen, plan, batch

    loop_thread, seen, plan, batch = asyncio.run(main())
    assert seen and loop_thread not in seen
    assert plan.scope.turn == 1 and len(batch.plans) == 1
    assert batch.plans[0].matched_prefix_blocks >= 0


def test_record_usage_counts_and_touches():
    pilot = ContextPilot()
    old = pilot.plan("q", ["old text"], rid="old")
    pilot.plan("q", ["new text"], rid="new")
    assert pilot.index.rids() == ["old", "new"]
    assert pilot.record_usage(old.rid, 10, 4) is True
    assert pilot.index.rids() == ["new", "old"]  # a hit marks it used
    assert pilot.record_usage("unknown", 10, 0) is False
    usage = pilot.stats()["usage"]
    assert usage["prompt_tokens"] == 20 and usage["cached_tokens"] == 4
    assert usage["hit_ratio"] == pytest.approx(0.2)


def test_check_planner_refuses_sync_only_and_async_in_sync_clothes():
    from contextpilot_integrations.core.planner_protocol import check_planner

    check_planner(ContextPilot())

    class AsyncOnly:  # the old async client: passed the sync protocol, nothing awaited
        layout = PromptLayout()

        async def plan(self, *args, **kwargs): ...
        async def aplan(self, *args, **kwargs): ...
        async def plan_batch(self, *args, **kwargs): ...
        async def aplan_batch(self, *args, **kwargs): ...
        def evict(self, rid): ...

    with pytest.raises(TypeError, match=r"plan is a coroutine function \(use aplan\)"):
        check_planner(AsyncOnly())

    class Lazy:  # a property is never evaluated by the check
        @property
        def layout(self):
            raise AssertionError("evaluated")

        plan = plan_batch = evict = ContextPilot.plan
        aplan, aplan_batch = ContextPilot.aplan, ContextPilot.aplan_batch

    check_planner(Lazy())
    with pytest.raises(TypeError, match="retriever must implement"):
        check_planner(object(), "retriever")


def test_a_request_is_reordered_only_when_the_reuse_it_expects_pays_for_the_annotation():
    pilot = ContextPilot()  # OrderingConfig(reorder="cost-aware")
    tiny = ["alpha text", "beta text"]
    pilot.plan("q1", tiny)
    kept = pilot.plan("q2", ["delta text", *tiny])  # 5 tokens to gain, ~20 to annotate
    assert kept.order == [0, 1, 2] and not kept.annotation_labels
    long = [f"long shared passage {i}: " + "words " * 60 for i in range(2)]
    pilot.plan("q3", long)
    moved = pilot.plan("q4", ["delta text again", *long])  # ~130 tokens to gain
    assert moved.order == [1, 2, 0] and moved.annotation_labels
    assert moved.matched_prefix_tokens > 100
    # Already the best order: nothing moves, so it pays whatever it gains.
    same = pilot.plan("q5", [*long, "another own text"])
    assert same.order == [0, 1, 2] and not same.annotation_labels
    with pytest.raises(ValueError, match="reorder must be"):
        OrderingConfig(reorder="never")  # type: ignore[arg-type]


def test_the_shared_prefix_is_where_another_indexed_request_parts_ways():
    pilot = ContextPilot(ordering=OrderingConfig(reorder="always"))
    a, b, c = (f"passage {x}: " + "words " * 40 for x in "abc")
    first = pilot.plan("q1", [a, b])
    assert (first.shared_prefix_blocks, first.shared_prefix_tokens) == (0, 0)  # alone
    second = pilot.plan("q2", [a, c])
    assert second.shared_prefix_blocks == 1  # [a] is shared, then they part
    assert second.shared_prefix_tokens == second.blocks[0].tokens
    again = pilot.plan("q3", [a, b])  # the same context as the first: all of it is shared
    assert again.shared_prefix_blocks == 2
    x, y, z = (f"new passage {n}: " + "other words " * 30 for n in "xyz")
    batch = pilot.plan_batch([PlanRequest("q4", [x, y]), PlanRequest("q5", [y, x, z])])
    # Read once the whole batch is indexed: each shares its two common blocks with the other.
    assert [p.shared_prefix_blocks for p in batch.plans] == [2, 2]
    assert pilot.plan("q6", []).shared_prefix_blocks == 0


@pytest.mark.parametrize(
    "block_template",
    [
        "{label}\n{text}\n-----\n",
        "{{{label}}} {{braces}}\n{text}}}\n-----\n",  # braces in the literals
        "{label}\n{text}{text!r:.3}\n-----\n",
        "<{text}> {{braces}} %s {label}{label!r:>12}\n-----\n",
        "<{text}> {label}\n-----\n",
        "{label}{label} {text}\n-----\n",
        "{label.__class__}{label}\n{text}\n-----\n",  # an attribute: the keyword form
    ],
)
def test_blocks_render_as_the_block_template_formats_them(block_template: str) -> None:
    layout = PromptLayout(block_template=block_template)
    blocks = ["alpha {x} 100%", "beta"]
    segments = layout.render_segments(blocks, "q?")
    labels = [layout.label(0), layout.label(1)]
    assert segments[1:3] == [
        block_template.format(label=label, text=text) for label, text in zip(labels, blocks)
    ]


def test_a_plan_takes_its_fields_in_order_and_stays_frozen() -> None:
    import dataclasses
    import inspect

    from contextpilot_integrations.core.plan import Plan

    parameters = list(inspect.signature(Plan.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Plan)
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default for f in fields
    ]
    plan = ContextPilot().plan("q", ["alpha", "beta"], rid="r1")
    assert vars(plan) == {f.name: getattr(plan, f.name) for f in fields}
    assert dataclasses.replace(plan) == plan
    assert dataclasses.replace(plan, replica="a").replica == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rid = "r2"  # type: ignore[misc]
