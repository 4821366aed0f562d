"""ContextPilotNodePostprocessor on real retrieved nodes: copies, order, metadata, bad input,
concurrency, planners with the same interface."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from llama_index.core.schema import (
    Document,
    ImageNode,
    IndexNode,
    MetadataMode,
    NodeWithScore,
    QueryBundle,
    TextNode,
)

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY, PLACEMENT_KEYS
from contextpilot_integrations.core.plan import BatchPlan, PlacementStatus, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    ConversationSections,
    PlanStore,
)
from contextpilot_integrations.llama_index.request_ids import pending_request

SHOWN = PlacementStatus.SHOWN
DUPLICATE = PlacementStatus.DUPLICATE
SKIPPED = PlacementStatus.SKIPPED

PNG_1x1 = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
    )
).decode()


def _entry(node: NodeWithScore) -> dict:  # type: ignore[type-arg]
    return node.node.metadata[METADATA_KEY]  # type: ignore[no-any-return]


def _statuses(nodes: Sequence[NodeWithScore]) -> list[str]:
    return [_entry(n)["status"] for n in nodes]


def _ranks(nodes: Sequence[NodeWithScore]) -> list[int]:
    return [_entry(n)["index"] for n in nodes]


def _rids(nodes: Sequence[NodeWithScore]) -> set[str]:
    return {_entry(n)["rid"] for n in nodes}


def test_nodes_are_copies_and_render_exactly_like_the_originals(retrieved, questions) -> None:
    nodes = retrieved[0]
    before = [(n.node.metadata.copy(), list(n.node.excluded_llm_metadata_keys)) for n in nodes]
    out = ContextPilotNodePostprocessor().postprocess_nodes(nodes, query_str=questions[0])
    assert len(out) == len(nodes)
    by_id = {n.node.node_id: n for n in nodes}
    for copy in out:
        original = by_id[copy.node.node_id]
        assert copy is not original and copy.node is not original.node
        assert copy.score == original.score
        for mode in (MetadataMode.LLM, MetadataMode.EMBED):
            assert copy.node.get_content(metadata_mode=mode) == original.node.get_content(
                metadata_mode=mode
            )
        # One key, the placement entry, excluded from both renderings.
        assert set(copy.node.metadata) - set(original.node.metadata) == {METADATA_KEY}
        assert tuple(_entry(copy)) == PLACEMENT_KEYS
        assert METADATA_KEY in copy.node.excluded_llm_metadata_keys
        assert METADATA_KEY in copy.node.excluded_embed_metadata_keys
        assert "contextpilot" not in copy.node.get_content(metadata_mode=MetadataMode.LLM)
        assert copy.node.metadata["title"] == original.node.metadata["title"]  # user's kept
    # The retriever's (docstore's) objects are untouched.
    assert [(n.node.metadata, n.node.excluded_llm_metadata_keys) for n in nodes] == before


def test_output_follows_the_plan_and_accounts_for_every_node(retrieved, questions) -> None:
    pp = ContextPilotNodePostprocessor()
    for query, nodes in zip(questions[:10], retrieved[:10]):
        out = pp.postprocess_nodes(nodes, query_str=query)
        plan = pp.plan_for(out)
        assert isinstance(plan, Plan)
        assert _rids(out) == {plan.rid}
        assert sorted(_ranks(out)) == list(range(len(nodes)))
        kept = [n for n in out if _entry(n)["status"] == SHOWN]
        assert _ranks(kept) == plan.order
        assert [_entry(n)["label"] for n in kept] == [f"[Doc {i + 1}]" for i in range(len(kept))]
        assert [_entry(n)["position"] for n in kept] == list(range(len(kept)))
        assert [_entry(n)["block_id"] for n in kept] == [b.block_id for b in plan.blocks]
        assert [b.text for b in plan.blocks] == [
            n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in kept
        ]
        assert plan.query == query


def test_shared_nodes_come_first_in_the_order_an_earlier_request_sent_them(
    retrieved, questions
) -> None:
    pp = ContextPilotNodePostprocessor()
    first = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
    # Question 13 retrieves the same four articles as question 0 (in another order).
    assert {n.node.node_id for n in retrieved[13]} == {n.node.node_id for n in retrieved[0]}
    assert [n.node.node_id for n in retrieved[13]] != [n.node.node_id for n in first]
    second = pp.postprocess_nodes(retrieved[13], query_str=questions[13])
    assert [n.node.node_id for n in second] == [n.node.node_id for n in first]
    assert pp.plan_for(second).matched_prefix_blocks == len(first)  # type: ignore[union-attr]


def test_sync_and_async_give_the_same_plans(retrieved, questions) -> None:
    sync_pp, async_pp = ContextPilotNodePostprocessor(), ContextPilotNodePostprocessor()

    async def run_async() -> list[list[str]]:
        orders = []
        for query, nodes in zip(questions[:12], retrieved[:12]):
            out = await async_pp.apostprocess_nodes(nodes, query_str=query)
            # Finished in this task: its request id is armed here.
            assert pending_request().rid == _entry(out[0])["rid"]  # type: ignore[union-attr]
            orders.append([n.node.node_id for n in out])
        return orders

    sync_orders = [
        [n.node.node_id for n in sync_pp.postprocess_nodes(nodes, query_str=query)]
        for query, nodes in zip(questions[:12], retrieved[:12])
    ]
    assert asyncio.run(run_async()) == sync_orders


def test_query_bundle_and_no_query(retrieved) -> None:
    pp = ContextPilotNodePostprocessor()
    out = pp.postprocess_nodes(retrieved[1], QueryBundle("what happened?"))
    assert pp.plan_for(out).query == "what happened?"  # type: ignore[union-attr]
    out = pp.postprocess_nodes(retrieved[2])
    assert pp.plan_for(out).query == ""  # type: ignore[union-attr]


# --- bad input: defined behaviour, nothing lost ---------------------------------------------


def test_empty_list_gives_an_empty_list_and_disarms() -> None:
    pp = ContextPilotNodePostprocessor()
    assert pp.postprocess_nodes([], query_str="q") == []
    assert pending_request() is None
    assert pp.pilot.stats()["requests"] == 0  # type: ignore[attr-defined]  # nothing indexed


def test_nodes_without_text_pass_through_after_the_blocks(retrieved) -> None:
    image = NodeWithScore(node=ImageNode(image=PNG_1x1, image_mimetype="image/png"), score=0.9)
    blank = NodeWithScore(node=TextNode(text="   \n "), score=0.8)
    nodes = [image, retrieved[3][0], blank, retrieved[3][1]]
    pp = ContextPilotNodePostprocessor()
    out = pp.postprocess_nodes(nodes, query_str="q")
    assert _statuses(out) == [SHOWN, SHOWN, SKIPPED, SKIPPED]
    assert _ranks(out)[2:] == [0, 2]
    assert [_entry(n)["block_id"] for n in out[2:]] == [None, None]
    assert out[2].node.image == PNG_1x1 and out[2].score == 0.9
    assert len(pp.plan_for(out).blocks) == 2  # type: ignore[union-attr]
    # Only nodes without text: the core skips them all, all returned, nothing indexed or armed.
    requests = pp.pilot.stats()["requests"]  # type: ignore[attr-defined]
    only = pp.postprocess_nodes([image, blank], query_str="q")
    assert _statuses(only) == [SKIPPED, SKIPPED]
    assert pp.plan_for(only).blocks == ()  # type: ignore[union-attr]
    assert pp.pilot.stats()["requests"] == requests  # type: ignore[attr-defined]
    assert pending_request() is None


def test_repeated_nodes_are_kept_and_point_to_the_first(retrieved) -> None:
    a, b = retrieved[4][0], retrieved[4][1]
    same_text_other_id = NodeWithScore(
        node=a.node.model_copy(update={"id_": "another-id"}), score=None
    )
    nodes = [a, b, a, same_text_other_id]
    out = ContextPilotNodePostprocessor().postprocess_nodes(nodes, query_str="q")
    assert sorted(_ranks(out)) == [0, 1, 2, 3]
    duplicates = [n for n in out if _entry(n)["status"] == DUPLICATE]
    assert _ranks(duplicates) == [2, 3]
    assert [_entry(n)["duplicate_of"] for n in duplicates] == [0, 0]
    assert out[-2:] == duplicates  # after the shown blocks
    assert duplicates[1].node.node_id == "another-id"


def test_missing_scores_and_mixed_node_types(retrieved) -> None:
    text = retrieved[5][0].node.get_content()
    nodes = [
        NodeWithScore(node=TextNode(text="plain text node about antitrust law"), score=None),
        NodeWithScore(node=Document(text=text[:200], metadata={"source": "doc"})),
        NodeWithScore(node=ImageNode(text="a chart of search market shares", image=PNG_1x1)),
        NodeWithScore(node=IndexNode(text="summary of an index", index_id="sub-index")),
        retrieved[5][1],
    ]
    out = ContextPilotNodePostprocessor().postprocess_nodes(nodes, query_str="q")
    assert sorted(_ranks(out)) == [0, 1, 2, 3, 4]
    assert set(_statuses(out)) == {SHOWN}
    assert [type(n.node) for n in sorted(out, key=lambda n: _entry(n)["index"])] == [
        TextNode,
        Document,
        ImageNode,
        IndexNode,
        type(retrieved[5][1].node),
    ]
    assert [n.score for n in out if _entry(n)["index"] == 0] == [None]


def test_nodes_planned_before_are_planned_afresh(retrieved) -> None:
    pp = ContextPilotNodePostprocessor()
    first = pp.postprocess_nodes(retrieved[6], query_str="q")
    # A stale contextpilot key that is no longer excluded must not reach the LLM text.
    stale = [
        NodeWithScore(
            node=n.node.model_copy(update={"excluded_llm_metadata_keys": []}), score=n.score
        )
        for n in first
    ]
    again = pp.postprocess_nodes(stale, query_str="q")
    assert _rids(again) != _rids(first)
    for node in again:
        assert "contextpilot" not in node.node.get_content(metadata_mode=MetadataMode.LLM)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("some text", "nodes must be a list of NodeWithScore"),
        (None, "nodes must be a list of NodeWithScore"),
        ([TextNode(text="bare node")], r"nodes\[0\] must be a NodeWithScore, got TextNode"),
    ],
)
def test_bad_node_lists_raise_type_error(nodes: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        ContextPilotNodePostprocessor().postprocess_nodes(nodes, query_str="q")  # type: ignore[arg-type]


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="conversation_id must be a non-empty str"):
        ContextPilotNodePostprocessor().for_conversation("")
    with pytest.raises(TypeError, match="tenant must be a str"):
        ContextPilotNodePostprocessor().for_conversation("c", tenant=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scope must be a Scope"):
        ContextPilotNodePostprocessor(scope={"conversation_id": "c"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scope.turn and scope.visibility are set per call"):
        ContextPilotNodePostprocessor(scope=Scope("c", turn=2))
    with pytest.raises(
        TypeError, match=r"must implement the Planner protocol .*object has no layout, no plan"
    ):
        ContextPilotNodePostprocessor(pilot=object())  # type: ignore[arg-type]

    class SyncOnly:  # what the old protocol allowed: the async path would block the loop
        layout = PromptLayout()

        def plan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
            raise AssertionError("not called")

    with pytest.raises(
        TypeError, match="SyncOnly has no aplan, no plan_batch, no aplan_batch, no evict"
    ):
        ContextPilotNodePostprocessor(pilot=SyncOnly())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plans must be a PlanStore"):
        ContextPilotNodePostprocessor(plans={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sections must be a ConversationSections"):
        ContextPilotNodePostprocessor(sections={})  # type: ignore[arg-type]


class DelegatingPlanner:
    """A complete Planner around an in-process pilot that records which twin was called, and
    on which thread; ``aplan`` is a native coroutine (like the async service client)."""

    def __init__(self) -> None:
        self.inner = ContextPilot()
        self.calls: list[tuple[str, int]] = []

    @property
    def layout(self) -> PromptLayout:
        return self.inner.layout

    def plan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
        self.calls.append(("plan", threading.get_ident()))
        return self.inner.plan(query, blocks, **kwargs)  # type: ignore[arg-type]

    async def aplan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
        self.calls.append(("aplan", threading.get_ident()))
        return self.inner.plan(query, blocks, **kwargs)  # type: ignore[arg-type]

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        return self.inner.plan_batch(requests)

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        return self.inner.plan_batch(requests)

    def evict(self, rid: str) -> bool:
        return self.inner.evict(rid)


def test_a_planner_that_loses_a_block_is_an_error_not_a_lost_node(retrieved) -> None:
    class Lossy(DelegatingPlanner):
        def plan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
            plan = super().plan(query, blocks, **kwargs)
            return dataclasses.replace(plan, placements=plan.placements[1:])

    with pytest.raises(RuntimeError, match="does not account for each"):
        ContextPilotNodePostprocessor(Lossy()).postprocess_nodes(retrieved[7], query_str="q")


# --- siblings, planners, concurrency --------------------------------------------------------


def test_for_conversation_shares_pilot_and_stores() -> None:
    pp = ContextPilotNodePostprocessor(scope=Scope(tenant="acme"))
    a, b = pp.for_conversation(), pp.for_conversation("chat-7", tenant="other")
    assert a.pilot is pp.pilot is b.pilot
    assert a.plans is pp.plans is b.plans and a.sections is pp.sections is b.sections
    other = pp.for_conversation().scope.conversation_id
    assert a.scope.conversation_id and a.scope.conversation_id != other
    assert (a.scope.tenant, b.scope.tenant, b.scope.conversation_id) == ("acme", "other", "chat-7")
    assert pp.scope.conversation_id is None
    assert ContextPilotNodePostprocessor.class_name() == "ContextPilotNodePostprocessor"
    assert pp.to_dict()["scope"]["conversation_id"] is None
    assert b.to_dict()["scope"] == {
        "conversation_id": "chat-7",
        "tenant": "other",
        "turn": None,
        "visibility": None,
    }


def test_sync_calls_plan_and_async_awaits_aplan_off_the_loop(retrieved) -> None:
    reference = ContextPilotNodePostprocessor()
    expected = [n.node.node_id for n in reference.postprocess_nodes(retrieved[0], query_str="q")]
    planner = DelegatingPlanner()
    pp = ContextPilotNodePostprocessor(planner)  # type: ignore[arg-type]
    assert [n.node.node_id for n in pp.postprocess_nodes(retrieved[0], query_str="q")] == expected
    out = asyncio.run(pp.apostprocess_nodes(retrieved[1], query_str="q"))
    assert pp.plan_for(out) is not None
    assert [name for name, _ in planner.calls] == ["plan", "aplan"]
    # The in-process pilot's aplan plans in a worker thread: the event loop is never blocked.
    pilot = ContextPilot()
    threads: set[int] = set()
    original = pilot.plan

    def plan(*args: object, **kwargs: object) -> Plan:
        threads.add(threading.get_ident())
        return original(*args, **kwargs)  # type: ignore[arg-type]

    pilot.plan = plan  # type: ignore[method-assign]
    out = asyncio.run(ContextPilotNodePostprocessor(pilot).apostprocess_nodes(retrieved[0]))
    assert [n.node.node_id for n in out] == expected
    assert threads and threading.get_ident() not in threads


def test_concurrent_requests_keep_their_own_plans(retrieved, questions) -> None:
    pp = ContextPilotNodePostprocessor()
    jobs = [(questions[i % len(questions)], retrieved[i % len(retrieved)]) for i in range(160)]

    def run(job: tuple[str, list[NodeWithScore]]) -> tuple[str, list[NodeWithScore], str | None]:
        out = pp.postprocess_nodes(job[1], query_str=job[0])
        armed = pending_request()
        return job[0], out, armed.rid if armed else None

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run, jobs))
    rids = set()
    for (query, nodes), (_, out, armed) in zip(jobs, results):
        (rid,) = _rids(out)
        assert armed == rid  # each thread's own request, not another thread's
        rids.add(rid)
        plan = pp.plan_for(out)
        assert plan is not None and plan.query == query
        assert sorted(_ranks(out)) == list(range(len(nodes)))
    assert len(rids) == len(jobs)
    assert pp.pilot.stats()["requests"] == len(jobs)  # type: ignore[attr-defined]

    async def gather() -> list[list[NodeWithScore]]:
        return await asyncio.gather(
            *(pp.apostprocess_nodes(nodes, query_str=q) for q, nodes in jobs[:40])
        )

    outs = asyncio.run(gather())
    assert len({_entry(o[0])["rid"] for o in outs}) == 40


def test_stores_are_bounded() -> None:
    store = PlanStore(max_plans=3)
    pp = ContextPilotNodePostprocessor(plans=store)
    outs = [
        pp.postprocess_nodes(
            [NodeWithScore(node=TextNode(text=f"block number {i}"))], query_str="q"
        )
        for i in range(5)
    ]
    assert len(store) == 3
    assert pp.plan_for(outs[0]) is None and pp.plan_for(outs[4]) is not None
    # The oldest plan is gone by digest too: a template no longer finds it.
    assert store.find("block number 0") is None and store.find("block number 4") is not None
    with pytest.raises(ValueError, match="max_plans must be an int >= 1"):
        PlanStore(max_plans=0)
    sections = ConversationSections(max_conversations=2, history_tokens=100)
    for conversation in ("a", "b", "c"):
        sections.record("t", conversation, 1, "text", 10)
    assert len(sections) == 2 and sections.begin_turn("t", "a") == (1, ())
    # Past the token budget the oldest turns go until at most half of it is left.
    for turn in range(2, 12):
        sections.record("t", "c", turn, f"turn {turn}", 10)
    turn, shown = sections.begin_turn("t", "c")
    assert turn == 12 and [t for t, _ in shown] == [7, 8, 9, 10, 11]
    # Recording a turn again drops the later ones (numbers never go back).
    sections.record("t", "c", 9, "retried", 10)
    assert sections.begin_turn("t", "c") == (13, ((7, "turn 7"), (8, "turn 8"), (9, "retried")))
    assert sections.forget("t", "c") and not sections.forget("t", "c")
    with pytest.raises(ValueError, match="history_tokens must be an int >= 1"):
        ConversationSections(history_tokens=0)
