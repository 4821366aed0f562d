"""The ContextPilot facade: lossless, deterministic, clear errors, shared prefixes."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import ContextPilot, PromptLayout

block_texts = st.lists(
    st.sampled_from([f"document {i} " + "x" * (i * 7) for i in range(15)]), min_size=0, max_size=8
)


def _assert_lossless(plan, blocks):
    assert sorted(plan.order + list(plan.duplicates)) == list(range(len(blocks)))
    for i, first in plan.duplicates.items():
        assert blocks[i] == blocks[first] and first in plan.order
    assert [b.text for b in plan.blocks] == [blocks[i] for i in plan.order]
    prompt = plan.prompt
    for text in blocks:
        assert text in prompt


@settings(max_examples=60, deadline=None)
@given(st.lists(block_texts, min_size=1, max_size=12))
def test_plan_and_plan_batch_are_lossless_and_deterministic(requests):
    queries = [f"question {i}" for i in range(len(requests))]
    rids = [f"r{i}" for i in range(len(requests))]
    outputs = []
    for _ in range(2):
        pilot = ContextPilot()
        online = [pilot.plan(q, b, rid=f"o{i}") for i, (q, b) in enumerate(zip(queries, requests))]
        batch = pilot.plan_batch(queries, requests, rids=rids)
        for plan, blocks in zip(online + batch.plans, requests + requests):
            _assert_lossless(plan, blocks)
        assert sorted(batch.schedule) == list(range(len(requests)))
        outputs.append(([p.prompt for p in online + batch.plans], batch.schedule))
    assert outputs[0] == outputs[1]


def test_shared_blocks_form_a_byte_identical_prefix_and_annotation_comes_after():
    pilot = ContextPilot()
    first = pilot.plan("q1", ["alpha text", "beta text", "gamma text"])
    second = pilot.plan("q2", ["delta text", "gamma text", "alpha text"])
    shared = {"alpha text", "gamma text"}
    assert {b.text for b in second.blocks[:2]} <= shared | {first.blocks[0].text}
    common = os.path.commonprefix([first.prompt, second.prompt])
    prefix_end = len("".join(second.segments[:2]))  # system + first block
    assert len(common) >= prefix_end
    assert second.prompt.index("priority order") > second.prompt.index("delta text")
    # The annotation restores retriever order: rank 0 ("delta") is named first.
    label_of = {b.text: f"[Doc {i + 1}]" for i, b in enumerate(second.blocks)}
    annotation = second.segments[-1]
    assert annotation.index(label_of["delta text"]) < annotation.index(label_of["gamma text"])


def test_batch_schedule_runs_requests_sharing_a_prefix_back_to_back():
    pilot = ContextPilot()
    a, c = "shared block A " * 10, "other block C " * 10
    batch = pilot.plan_batch(
        ["q0", "q1", "q2", "q3"],
        [[a, "u0"], [c, "u1"], ["u2", a], [c, "u3"]],
    )
    position = {rid: i for i, rid in enumerate(batch.schedule)}
    assert abs(position[0] - position[2]) == 1 and abs(position[1] - position[3]) == 1
    assert batch.plans[2].blocks[0].text == a  # aligned: shared block first


def test_bad_input_gets_clear_errors():
    pilot = ContextPilot()
    with pytest.raises(ValueError, match=r"blocks\[1\] is empty"):
        pilot.plan("q", ["ok", "  "])
    with pytest.raises(TypeError, match=r"blocks\[0\] must be a str.*int"):
        pilot.plan("q", [3])
    with pytest.raises(TypeError, match="blocks must be a sequence"):
        pilot.plan("q", "a single string")
    with pytest.raises(TypeError, match="query must be a str"):
        pilot.plan(None, ["x"])
    with pytest.raises(ValueError, match="rid"):
        pilot.plan("q", ["x"], rid="")
    with pytest.raises(ValueError, match="queries has 2 entries but blocks has 1"):
        pilot.plan_batch(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="unique"):
        pilot.plan_batch(["a", "b"], [["x"], ["y"]], rids=["r", "r"])
    with pytest.raises(ValueError, match=r"blocks\[1\]\[0\]"):
        pilot.plan_batch(["a", "b"], [["x"], [""]])
    assert len(pilot.index) == 0  # nothing half-indexed after a rejected batch


def test_empty_context_and_repeated_blocks_are_defined():
    pilot = ContextPilot()
    empty = pilot.plan("q", [])
    assert empty.blocks == [] and empty.prompt.endswith("Question: q\nAnswer:")
    repeated = pilot.plan("q", ["same", "other", "same"])
    assert repeated.duplicates == {2: 0}
    assert repeated.prompt.count("same\n") == 1


def test_tens_of_thousands_of_blocks_in_one_request():
    pilot = ContextPilot()
    blocks = [f"block number {i}" for i in range(30_000)]
    plan = pilot.plan("q", blocks)
    assert len(plan.blocks) == 30_000
    again = pilot.plan("q2", list(reversed(blocks)))
    assert again.matched_prefix_blocks == 30_000


def test_reorder_and_messages():
    pilot = ContextPilot(layout=PromptLayout(system_prompt="SYS"))
    pilot.plan("q", ["b1", "b2"])
    plan = pilot.plan("q", ["b0", "b2", "b1"])
    docs = ["D0", "D2", "D1"]
    assert plan.reorder(docs) == [docs[i] for i in plan.order]
    with pytest.raises(ValueError, match="made for 3"):
        plan.reorder(docs[:2])
    messages = plan.messages
    assert messages[0] == {"role": "system", "content": "SYS"}
    assert messages[1]["content"].startswith("[Doc 1]\n")


LONG = [f"passage {i}: " + "words of a long retrieved passage " * 12 for i in range(6)]


def test_conversation_turns_replace_repeated_blocks_with_hints_to_visible_turns():
    pilot = ContextPilot()
    first = pilot.plan("q1", LONG[:3], conversation_id="c1", tenant="t")
    assert first.turn == 1 and not first.replaced
    second = pilot.plan("q2", [LONG[1], LONG[3]], conversation_id="c1", tenant="t")
    assert list(second.replaced) == [0]  # LONG[1] was shown in turn 1
    assert "of turn 1" in second.replaced[0] and second.replaced[0] in second.prompt
    _label = second.replaced[0].split("Also relevant: ")[1].split(" of turn")[0]
    shown = first.blocks[[b.text for b in first.blocks].index(LONG[1])]
    assert first.layout.label(first.blocks.index(shown)) == _label
    assert second.dedup["blocks_replaced"] == 1 and second.dedup["tokens_saved"] > 0
    assert sorted(second.order + list(second.replaced)) == [0, 1]
    # The annotation still names the replaced block, by where it stands.
    assert "of turn 1" in second.segments[-1].split("priority order")[1]


def test_no_conversation_and_other_tenants_never_deduplicate():
    pilot = ContextPilot()
    pilot.plan("q1", LONG[:2], conversation_id="c1", tenant="alice")
    assert not pilot.plan("q2", LONG[:2]).replaced
    assert not pilot.plan("q3", LONG[:2], conversation_id="c1", tenant="bob").replaced
    assert not pilot.plan("q4", LONG[:2], conversation_id="c2", tenant="alice").replaced
    assert pilot.plan("q5", LONG[:2], conversation_id="c1", tenant="alice").replaced


def test_hints_only_point_at_turns_the_app_still_sends():
    from contextpilot_integrations.core.conversation import TurnVisibility

    pilot = ContextPilot()
    pilot.plan("q1", [LONG[0]], conversation_id="c", turn=1)
    pilot.plan("q2", [LONG[1]], conversation_id="c", turn=2)
    third = pilot.plan(
        "q3", [LONG[0], LONG[1]], conversation_id="c", turn=3, visibility=TurnVisibility.last(1)
    )
    assert list(third.replaced) == [1] and "turn 2" in third.replaced[1]


def test_batch_with_conversations():
    pilot = ContextPilot()
    pilot.plan("q0", [LONG[0]], conversation_id="a")
    batch = pilot.plan_batch(
        ["q1", "q2"], [[LONG[0], LONG[1]], [LONG[0], LONG[2]]], conversation_ids=["a", None]
    )
    assert list(batch.plans[0].replaced) == [0] and not batch.plans[1].replaced
    with pytest.raises(ValueError, match="appears twice"):
        pilot.plan_batch(["x", "y"], [[LONG[3]], [LONG[4]]], conversation_ids=["z", "z"])


def test_batch_takes_turns_and_visibility_per_request():
    from contextpilot_integrations.core.conversation import TurnVisibility

    pilot = ContextPilot()
    pilot.plan("q1", [LONG[0]], conversation_id="a", turn=1)
    pilot.plan("q2", [LONG[1]], conversation_id="a", turn=2)
    batch = pilot.plan_batch(
        ["q3", "q4"],
        [[LONG[0], LONG[1]], [LONG[0]]],
        conversation_ids=["a", "b"],
        turns=[3, None],
        visibilities=[TurnVisibility.last(1), None],
    )
    assert batch.plans[0].turn == 3 and list(batch.plans[0].replaced) == [1]
    assert batch.plans[1].turn == 1 and not batch.plans[1].replaced
    with pytest.raises(ValueError, match="turns has 1 entries"):
        pilot.plan_batch(["x", "y"], [[LONG[3]], [LONG[4]]], turns=[1])


def test_unencodable_text_and_context_tail():
    pilot = ContextPilot()
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
    assert plan.order == [0, 1] and plan.annotation_labels == []
    assert "priority order" not in plan.prompt


def test_more_bad_input_names_the_field():
    pilot = ContextPilot()
    with pytest.raises(ValueError, match="query cannot be encoded"):
        pilot.plan("q\udfff", ["a"])
    with pytest.raises(TypeError, match=r"queries\[1\] must be a str"):
        pilot.plan_batch(["q1", None], [["a"], ["b"]])
    with pytest.raises(TypeError, match="rid must be a str, got int"):
        pilot.plan("q", ["a"], rid=5)
    with pytest.raises(TypeError, match="rid must be a str"):
        pilot.evict(None)
