"""ContextPilotNodePostprocessor on real retrieved nodes: copies, order, metadata, bad input,
concurrency, planners with the same interface."""

from __future__ import annotations

import asyncio
import base64
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
from contextpilot_integrations.core.pilot import Plan
from contextpilot_integrations.llama_index import (
    METADATA_KEYS,
    RID_METADATA_KEY,
    STATUS_DUPLICATE,
    STATUS_KEPT,
    STATUS_NO_TEXT,
    ContextPilotNodePostprocessor,
    PlanStore,
)
from contextpilot_integrations.llama_index.request_ids import pending_request

PNG_1x1 = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
    )
).decode()


def _statuses(nodes: Sequence[NodeWithScore]) -> list[str]:
    return [n.node.metadata["contextpilot_status"] for n in nodes]


def _ranks(nodes: Sequence[NodeWithScore]) -> list[int]:
    return [n.node.metadata["contextpilot_rank"] for n in nodes]


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
        for key in METADATA_KEYS:
            assert key in copy.node.excluded_llm_metadata_keys
            assert key in copy.node.excluded_embed_metadata_keys
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
        assert {n.node.metadata[RID_METADATA_KEY] for n in out} == {plan.rid}
        assert sorted(_ranks(out)) == list(range(len(nodes)))
        kept = [n for n in out if n.node.metadata["contextpilot_status"] == STATUS_KEPT]
        assert _ranks(kept) == plan.order  # every BM25 node has text: block index == rank
        assert [n.node.metadata["contextpilot_label"] for n in kept] == [
            f"[Doc {i + 1}]" for i in range(len(kept))
        ]
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
            assert pending_request().rid == out[0].node.metadata[RID_METADATA_KEY]  # type: ignore[union-attr]
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
    assert len(pp.store) == 0


def test_nodes_without_text_pass_through_after_the_blocks(retrieved) -> None:
    image = NodeWithScore(node=ImageNode(image=PNG_1x1, image_mimetype="image/png"), score=0.9)
    blank = NodeWithScore(node=TextNode(text="   \n "), score=0.8)
    nodes = [image, retrieved[3][0], blank, retrieved[3][1]]
    pp = ContextPilotNodePostprocessor()
    out = pp.postprocess_nodes(nodes, query_str="q")
    assert _statuses(out) == [STATUS_KEPT, STATUS_KEPT, STATUS_NO_TEXT, STATUS_NO_TEXT]
    assert _ranks(out)[2:] == [0, 2]
    assert out[2].node.image == PNG_1x1 and out[2].score == 0.9
    assert len(pp.plan_for(out).blocks) == 2  # type: ignore[union-attr]
    # Only nodes without text: nothing to plan, all returned.
    only = pp.postprocess_nodes([image, blank], query_str="q")
    assert _statuses(only) == [STATUS_NO_TEXT, STATUS_NO_TEXT]
    assert RID_METADATA_KEY not in only[0].node.metadata


def test_repeated_nodes_are_kept_and_point_to_the_first(retrieved) -> None:
    a, b = retrieved[4][0], retrieved[4][1]
    same_text_other_id = NodeWithScore(
        node=a.node.model_copy(update={"id_": "another-id"}), score=None
    )
    nodes = [a, b, a, same_text_other_id]
    out = ContextPilotNodePostprocessor().postprocess_nodes(nodes, query_str="q")
    assert sorted(_ranks(out)) == [0, 1, 2, 3]
    duplicates = [n for n in out if n.node.metadata["contextpilot_status"] == STATUS_DUPLICATE]
    assert _ranks(duplicates) == [2, 3]
    assert [n.node.metadata["contextpilot_duplicate_of"] for n in duplicates] == [0, 0]
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
    assert set(_statuses(out)) == {STATUS_KEPT}
    assert [
        type(n.node) for n in sorted(out, key=lambda n: n.node.metadata["contextpilot_rank"])
    ] == [
        TextNode,
        Document,
        ImageNode,
        IndexNode,
        type(retrieved[5][1].node),
    ]
    assert [n.score for n in out if n.node.metadata["contextpilot_rank"] == 0] == [None]


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
    assert {n.node.metadata[RID_METADATA_KEY] for n in again} != {
        n.node.metadata[RID_METADATA_KEY] for n in first
    }
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
        ContextPilotNodePostprocessor(conversation_id="")
    with pytest.raises(TypeError, match="tenant must be a str"):
        ContextPilotNodePostprocessor(tenant=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pilot must have a plan"):
        ContextPilotNodePostprocessor(pilot=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="store must be a PlanStore"):
        ContextPilotNodePostprocessor(store={})  # type: ignore[arg-type]


def test_a_planner_that_loses_a_block_is_an_error_not_a_lost_node(retrieved) -> None:
    class Lossy:
        def __init__(self) -> None:
            self.inner = ContextPilot()

        def plan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
            plan = self.inner.plan(query, blocks, **kwargs)  # type: ignore[arg-type]
            return Plan(**{**plan.__dict__, "order": plan.order[1:]})

    with pytest.raises(RuntimeError, match="does not account for each"):
        ContextPilotNodePostprocessor(Lossy()).postprocess_nodes(retrieved[7], query_str="q")


# --- siblings, planners, concurrency --------------------------------------------------------


def test_for_conversation_shares_pilot_and_store() -> None:
    pp = ContextPilotNodePostprocessor(tenant="acme")
    a, b = pp.for_conversation(), pp.for_conversation("chat-7", tenant="other")
    assert a.pilot is pp.pilot is b.pilot and a.store is pp.store is b.store
    assert a.conversation_id and a.conversation_id != pp.for_conversation().conversation_id
    assert (a.tenant, b.tenant, b.conversation_id) == ("acme", "other", "chat-7")
    assert pp.conversation_id is None
    assert ContextPilotNodePostprocessor.class_name() == "ContextPilotNodePostprocessor"
    assert pp.to_dict()["conversation_id"] is None


def test_any_planner_with_the_interface_sync_and_async(retrieved, questions) -> None:
    class ThreadedPlanner:  # plan() only: the async path runs it in a worker thread
        def __init__(self) -> None:
            self.inner = ContextPilot()
            self.threads: set[int] = set()

        def plan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
            self.threads.add(threading.get_ident())
            return self.inner.plan(query, blocks, **kwargs)  # type: ignore[arg-type]

    class AsyncPlanner(ThreadedPlanner):
        async def aplan(self, query: str, blocks: Sequence[str], **kwargs: object) -> Plan:
            self.awaited = True
            return self.inner.plan(query, blocks, **kwargs)  # type: ignore[arg-type]

    threaded, awaited = ThreadedPlanner(), AsyncPlanner()
    reference = ContextPilotNodePostprocessor()
    expected = [n.node.node_id for n in reference.postprocess_nodes(retrieved[0], query_str="q")]
    for planner in (threaded, awaited):
        pp = ContextPilotNodePostprocessor(planner)  # type: ignore[arg-type]
        out = asyncio.run(pp.apostprocess_nodes(retrieved[0], query_str="q"))
        assert [n.node.node_id for n in out] == expected
    assert threaded.threads and threading.get_ident() not in threaded.threads
    assert awaited.awaited and not awaited.threads


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
        (rid,) = {n.node.metadata[RID_METADATA_KEY] for n in out}
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
    assert len({o[0].node.metadata[RID_METADATA_KEY] for o in outs}) == 40


def test_store_is_bounded() -> None:
    store = PlanStore(max_plans=3)
    pp = ContextPilotNodePostprocessor(store=store)
    outs = [
        pp.postprocess_nodes(
            [NodeWithScore(node=TextNode(text=f"block number {i}"))], query_str="q"
        )
        for i in range(5)
    ]
    assert len(store) == 3
    assert pp.plan_for(outs[0]) is None and pp.plan_for(outs[4]) is not None
    with pytest.raises(ValueError, match="max_plans must be >= 1"):
        PlanStore(max_plans=0)
