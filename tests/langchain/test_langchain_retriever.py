"""ContextPilotRetriever: copies in prompt order with a namespaced entry, pass-through of keywords
and callbacks, conversations from run metadata, errors, and the awkward inputs."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from langchain_support import Bm25sRetriever, ListRetriever, RecordingPilot, RunRecorder
from pydantic import ValidationError

from contextpilot_integrations import (
    ContextPilot,
    Plan,
    PlanRequest,
    Scope,
    TurnVisibility,
    block_id,
)
from contextpilot_integrations.core.placement_metadata import METADATA_KEY, PLACEMENT_KEYS
from contextpilot_integrations.langchain import ContextPilotRetriever, format_documents


def entry(doc: Document) -> dict:
    return doc.metadata[METADATA_KEY]


def plan_of(retriever: ContextPilotRetriever, docs: list[Document]) -> Plan:
    """The plan the documents came from (the retriever's pilot is a RecordingPilot)."""
    return retriever.pilot.plan_for(entry(docs[0])["rid"])


def status(doc: Document) -> str:
    return entry(doc)["status"]


def test_returns_copies_in_prompt_order_with_the_entry(topic_documents):
    pilot = RecordingPilot()
    base = Bm25sRetriever(documents=topic_documents, k=4)
    retriever = ContextPilotRetriever(base_retriever=base, pilot=pilot)
    inner = base.invoke("prefix cache eviction of requests")
    docs = retriever.invoke("prefix cache eviction of requests")
    plan = pilot.plans[-1]

    assert [d.page_content for d in docs] == [b.text for b in plan.blocks]
    assert sorted(d.page_content for d in docs) == sorted(d.page_content for d in inner)
    for position, doc in enumerate(docs):
        e = entry(doc)
        # The one layout of every face, plus the tail format_documents renders and the
        # plan-level figures of the hosted APIs' cache controls; no more.
        hosted = ["shared_prefix_blocks", "conversation", "prompt_cache_key"]
        assert list(e) == [*PLACEMENT_KEYS, "context_tail", *hosted]
        assert e["rid"] == plan.rid and e["status"] == "shown"
        assert e["position"] == position and e["label"] == f"[Doc {position + 1}]"
        assert e["index"] == plan.order[position]
        assert inner[e["index"]].page_content == doc.page_content
        assert e["block_id"] == block_id(doc.page_content)
        assert e["hint"] is None and e["duplicate_of"] is None
        assert e["context_tail"] == plan.context_tail
        assert "original_page_content" not in e
        assert doc.metadata["source"] == inner[e["index"]].metadata["source"]
        assert json.loads(json.dumps(e)) == e  # plain JSON, so tracers can record it
    # The base retriever's own documents are untouched.
    assert all(METADATA_KEY not in d.metadata for d in topic_documents)


def test_second_request_sharing_blocks_is_aligned_to_the_first(topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=RecordingPilot()
    )
    first = retriever.invoke("prefix cache requests share the start")
    second = retriever.invoke("requests sharing a prefix raise the cache hit ratio")
    shared = {d.page_content for d in first} & {d.page_content for d in second}
    assert shared, "the two queries were chosen to share documents"
    assert plan_of(retriever, second).matched_prefix_blocks >= 1
    # The shared documents lead the second prompt, in the first prompt's order.
    lead = [d.page_content for d in second[: len(shared)]]
    assert lead == [d.page_content for d in first if d.page_content in shared][: len(lead)]


def test_keywords_and_k_pass_through_to_the_base_retriever(topic_documents):
    base = Bm25sRetriever(documents=topic_documents, k=5)
    retriever = ContextPilotRetriever(base_retriever=base)
    assert len(retriever.invoke("cache", k=2)) == 2
    assert len(retriever.invoke("cache")) == 5
    assert len(ContextPilotRetriever(base_retriever=base, k=3).invoke("cache")) == 3

    recording = ListRetriever(results={"q": topic_documents[:3]})
    ContextPilotRetriever(base_retriever=recording).invoke("q", filter={"source": "x"}, k=7)
    assert recording.calls == [{"query": "q", "filter": {"source": "x"}, "k": 7}]


def test_inner_run_is_nested_under_the_wrapper_run(topic_documents):
    base = Bm25sRetriever(documents=topic_documents, k=3)
    retriever = ContextPilotRetriever(base_retriever=base)

    def check(recorder: RunRecorder, calls: int) -> None:
        runs = [r for r in recorder.runs if r[0] == "retriever"]
        assert len(runs) == 2 * calls
        outer = {r[2] for r in runs if r[1] == "ContextPilotRetriever"}
        inner = [r for r in runs if r[1] == "Bm25sRetriever"]
        assert len(outer) == calls and len(inner) == calls
        assert {r[3] for r in inner} == outer  # each inner run's parent is a wrapper run

    recorder = RunRecorder()
    retriever.invoke("cache", config={"callbacks": [recorder]})
    check(recorder, 1)
    recorder = RunRecorder()
    asyncio.run(retriever.ainvoke("cache", config={"callbacks": [recorder]}))
    check(recorder, 1)
    recorder = RunRecorder()
    retriever.batch(["cache", "bm25 ranking", "tokenizer"], config={"callbacks": [recorder]})
    check(recorder, 3)
    recorder = RunRecorder()
    asyncio.run(retriever.abatch(["cache", "bm25"], config={"callbacks": [recorder]}))
    check(recorder, 2)


def test_conversation_from_metadata_replaces_repeated_blocks_with_hints(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(
            results={"turn 1": topic_documents[:3], "turn 2": topic_documents[1:5]}
        ),
        pilot=pilot,
    )
    meta = {
        "contextpilot_conversation_id": "c1",
        "contextpilot_visible_turns": "all",
        "contextpilot_tenant": "acme",
    }
    retriever.invoke("turn 1", config={"metadata": meta})
    docs = retriever.invoke("turn 2", config={"metadata": meta})
    plan = pilot.plans[-1]
    # The run metadata became one Scope, passed to the planner as it is.
    assert pilot.calls[-1]["scope"] == Scope("c1", "acme", None, TurnVisibility.all())
    assert plan.scope.conversation_id == "c1" and plan.scope.tenant == "acme"
    assert plan.scope.turn == 2

    replaced = [d for d in docs if status(d) == "replaced"]
    shown = [d for d in docs if status(d) == "shown"]
    assert len(replaced) == 2 and len(shown) == 2  # documents 1 and 2 were shown in turn 1
    assert docs[-len(replaced) :] == replaced  # hints come after the shown blocks
    for hint_position, doc in enumerate(replaced):
        e = entry(doc)
        assert doc.page_content == e["hint"] == plan.placements[e["index"]].hint
        assert e["hint"] == plan.hints[hint_position]  # in the order the hints are rendered
        assert "turn 1" in doc.page_content
        assert e["original_page_content"] == topic_documents[1 + e["index"]].page_content
        assert e["position"] == hint_position and e["label"] is None
        assert e["rid"] == plan.rid
    assert {d.page_content for d in shown} == {d.page_content for d in topic_documents[3:5]}
    # Lossless: every input document is shown, or replaced with its text kept.
    kept = {d.page_content for d in shown} | {entry(d)["original_page_content"] for d in replaced}
    assert kept == {d.page_content for d in topic_documents[1:5]}


def test_no_conversation_other_conversation_or_tenant_never_deduplicates(topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"a": topic_documents[:3], "b": topic_documents[:3]})
    )

    def replaced(query: str, metadata: dict) -> int:
        docs = retriever.invoke(query, config={"metadata": metadata})
        return sum(status(d) == "replaced" for d in docs)

    retriever.invoke(
        "a",
        config={
            "metadata": {"contextpilot_conversation_id": "c1", "contextpilot_visible_turns": "all"}
        },
    )
    assert replaced("b", {}) == 0
    assert (
        replaced("b", {"contextpilot_conversation_id": "c2", "contextpilot_visible_turns": "all"})
        == 0
    )
    assert (
        replaced(
            "b",
            {
                "contextpilot_conversation_id": "c1",
                "contextpilot_visible_turns": "all",
                "contextpilot_tenant": "t",
            },
        )
        == 0
    )
    assert (
        replaced("b", {"contextpilot_conversation_id": "c1", "contextpilot_visible_turns": "all"})
        == 3
    )


def test_thread_id_is_read_only_when_opted_in(topic_documents):
    base = ListRetriever(results={"a": topic_documents[:3]})
    config = {"metadata": {"thread_id": "t1", "user_id": "u1"}}
    default = ContextPilotRetriever(base_retriever=base)
    default.invoke("a", config=config)
    assert all(status(d) == "shown" for d in default.invoke("a", config=config))

    opted = ContextPilotRetriever(
        base_retriever=base,
        pilot=RecordingPilot(),
        conversation_id_keys=("thread_id",),
        tenant_keys=("user_id",),
    )
    config["metadata"]["contextpilot_visible_turns"] = "all"
    opted.invoke("a", config=config)
    docs = opted.invoke("a", config=config)
    assert all(status(d) == "replaced" for d in docs)
    assert plan_of(opted, docs).scope == Scope("t1", "u1", 2, TurnVisibility.all())


def test_turn_and_visible_turns_from_metadata(topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(
            results={"x": topic_documents[:2], "y": topic_documents[4:6], "z": topic_documents[:2]}
        ),
        pilot=RecordingPilot(),
    )
    meta = {"contextpilot_conversation_id": "c", "contextpilot_visible_turns": "all"}
    retriever.invoke("x", config={"metadata": meta})
    retriever.invoke("y", config={"metadata": meta})
    # The app keeps only the last turn in its prompt: turn 1's blocks must not be pointed at.
    docs = retriever.invoke("z", config={"metadata": {**meta, "contextpilot_visible_turns": 1}})
    assert all(status(d) == "shown" for d in docs)
    assert plan_of(retriever, docs).scope.turn == 3
    assert plan_of(retriever, docs).scope.visibility == TurnVisibility.last(1)
    # Retrying turn 3 with all turns visible: turn 1's blocks are pointed at.
    docs = retriever.invoke("z", config={"metadata": {**meta, "contextpilot_turn": 3}})
    assert all(status(d) == "replaced" for d in docs)
    assert plan_of(retriever, docs).scope.turn == 3
    # Without the key, no earlier turn is visible (the usual chain resends no documents).
    docs = retriever.invoke("z", config={"metadata": {"contextpilot_conversation_id": "c"}})
    assert all(status(d) == "shown" for d in docs)
    assert plan_of(retriever, docs).scope.visibility == TurnVisibility.last(0)


def test_turn_after_a_fully_replaced_turn_gets_the_next_number(topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"x": topic_documents[:2], "y": topic_documents[4:6]}),
        pilot=RecordingPilot(),
    )
    meta = {"metadata": {"contextpilot_conversation_id": "c", "contextpilot_visible_turns": "all"}}
    retriever.invoke("x", config=meta)
    assert all(status(d) == "replaced" for d in retriever.invoke("x", config=meta))  # turn 2
    third = retriever.invoke("y", config=meta)
    assert plan_of(retriever, third).scope.turn == 3


@pytest.mark.parametrize(
    ("metadata", "error", "names"),
    [
        (
            {"contextpilot_conversation_id": 3.5, "contextpilot_visible_turns": "all"},
            TypeError,
            "contextpilot_conversation_id",
        ),
        (
            {"contextpilot_conversation_id": "", "contextpilot_visible_turns": "all"},
            ValueError,
            "contextpilot_conversation_id",
        ),
        (
            {
                "contextpilot_conversation_id": "c",
                "contextpilot_visible_turns": "all",
                "contextpilot_tenant": ["x"],
            },
            TypeError,
            "contextpilot_tenant",
        ),
        (
            {
                "contextpilot_conversation_id": "c",
                "contextpilot_visible_turns": "all",
                "contextpilot_turn": "2",
            },
            TypeError,
            "contextpilot_turn",
        ),
        (
            {
                "contextpilot_conversation_id": "c",
                "contextpilot_visible_turns": -1,
            },
            ValueError,
            "contextpilot_visible_turns",
        ),
        ({"contextpilot_turn": 2}, ValueError, "needs a conversation id"),
    ],
)
def test_bad_metadata_values_get_errors_naming_the_key(topic_documents, metadata, error, names):
    base = ListRetriever(results={"q": topic_documents})
    retriever = ContextPilotRetriever(base_retriever=base)
    with pytest.raises(error, match=names):
        retriever.invoke("q", config={"metadata": metadata})
    with pytest.raises(error, match=names):
        asyncio.run(retriever.ainvoke("q", config={"metadata": metadata}))
    assert base.calls == []  # checked before the base retriever ran
    with pytest.raises(error, match=names):
        retriever.batch(["q"], config={"metadata": metadata})


class Boom(RuntimeError):
    pass


def test_inner_retriever_raising_reaches_the_caller_unchanged(topic_documents):
    failure = Boom("index offline")

    def fail(query: str) -> list[Document]:
        raise failure

    retriever = ContextPilotRetriever(base_retriever=RunnableLambda(fail))
    recorder = RunRecorder()
    with pytest.raises(Boom) as caught:
        retriever.invoke("q", config={"callbacks": [recorder]})
    assert caught.value is failure and failure in recorder.errors
    with pytest.raises(Boom) as caught:
        asyncio.run(retriever.ainvoke("q"))
    assert caught.value is failure
    with pytest.raises(Boom) as caught:
        retriever.batch(["q", "r"])
    assert caught.value is failure
    with pytest.raises(Boom) as caught:
        asyncio.run(retriever.abatch(["q"]))
    assert caught.value is failure


def test_batch_with_return_exceptions_plans_the_others(topic_documents):
    pilot = RecordingPilot()
    base = ListRetriever(results={"a": topic_documents[:3], "b": topic_documents[2:5]})
    retriever = ContextPilotRetriever(base_retriever=base, pilot=pilot)
    out = retriever.batch(["a", "missing", "b"], return_exceptions=True)
    assert isinstance(out[1], KeyError)
    assert [len(out[0]), len(out[2])] == [3, 3]
    assert len(pilot.batches) == 1 and len(pilot.batches[0].plans) == 2
    positions = sorted(entry(out[i][0])["schedule_position"] for i in (0, 2))
    assert positions == [0, 1]


def test_empty_results(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(base_retriever=ListRetriever(results={"q": []}), pilot=pilot)
    assert retriever.invoke("q") == []
    assert asyncio.run(retriever.ainvoke("q")) == []
    assert retriever.batch(["q", "q"]) == [[], []]
    assert format_documents.invoke([]) == ""
    assert pilot.plans and all(p.blocks == () for p in pilot.plans)


def test_documents_without_ids_get_stable_block_ids_from_their_text(topic_documents):
    base = Bm25sRetriever(documents=topic_documents, k=4)
    first = ContextPilotRetriever(base_retriever=base).invoke("cache prefix")
    again = ContextPilotRetriever(base_retriever=base).invoke("cache prefix")
    assert all(d.id is None for d in first)
    assert {entry(d)["block_id"] for d in first} == {entry(d)["block_id"] for d in again}
    assert all(entry(d)["block_id"] == block_id(d.page_content) for d in first)
    # Framework ids are kept, for reporting only: the same text under another id is one block.
    with_ids = [d.model_copy(update={"id": f"id-{i}"}) for i, d in enumerate(first)]
    docs = ContextPilotRetriever(base_retriever=ListRetriever(results={"q": with_ids})).invoke("q")
    assert {d.id for d in docs} == {d.id for d in with_ids}
    assert {entry(d)["block_id"] for d in docs} == {entry(d)["block_id"] for d in first}


def test_duplicate_documents_in_one_result_come_back_marked_and_render_once(topic_documents):
    a, b, c = topic_documents[:3]
    dup = Document(page_content=a.page_content, metadata={"source": "mirror"}, id="other")
    retriever = ContextPilotRetriever(base_retriever=ListRetriever(results={"q": [a, b, dup, c]}))
    docs = retriever.invoke("q")
    shown = [d for d in docs if status(d) == "shown"]
    assert sorted(d.page_content for d in shown) == sorted(x.page_content for x in (a, b, c))
    # Not lost: the duplicate comes back after the shown blocks, with its own id and metadata,
    # pointing at the input that stands for it.
    assert len(docs) == 4 and docs[-1].id == "other" and status(docs[-1]) == "duplicate"
    assert docs[-1].page_content == a.page_content and docs[-1].metadata["source"] == "mirror"
    e = entry(docs[-1])
    assert (e["index"], e["duplicate_of"], e["position"], e["label"]) == (2, 0, None, None)
    assert e["block_id"] == entry(next(d for d in shown if entry(d)["index"] == 0))["block_id"]
    # The prompt shows the text once.
    assert format_documents.invoke(docs).count(a.page_content) == 1


def test_metadata_that_is_not_json_serialisable_is_kept_as_is(topic_documents):
    lock = threading.Lock()
    odd = {"lock": lock, "tags": {"a", "b"}, "callback": print}
    doc = Document(page_content="a block with odd metadata", metadata=odd)
    retriever = ContextPilotRetriever(base_retriever=ListRetriever(results={"q": [doc]}))
    (out,) = retriever.invoke("q")
    assert out.metadata["lock"] is lock and out.metadata["callback"] is print
    assert out.metadata["tags"] == {"a", "b"}
    assert METADATA_KEY not in doc.metadata
    json.dumps(entry(out))
    assert retriever.batch(["q"])[0][0].metadata["lock"] is lock


def test_bad_results_and_bad_arguments_get_clear_errors(topic_documents):
    empty = Document(page_content="   ", id="blank")
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"q": [topic_documents[0], empty]})
    )
    # A document without text is not a context block: it comes back last, marked, unplanned.
    out = retriever.invoke("q")
    assert [d.id for d in out][-1] == "blank" and out[-1].page_content == "   "
    assert status(out[-1]) == "skipped" and entry(out[-1])["block_id"] is None
    assert entry(out[0])["rid"] == entry(out[-1])["rid"]
    assert format_documents.invoke(out).count("[Doc ") == 1  # not rendered as a block
    not_docs = ContextPilotRetriever(base_retriever=RunnableLambda(lambda q: ["text"]))
    with pytest.raises(TypeError, match=r"result \[0\] must be a Document, got str"):
        not_docs.invoke("q")
    not_list = ContextPilotRetriever(base_retriever=RunnableLambda(lambda q: "text"))
    with pytest.raises(TypeError, match="must return a list of Document, got str"):
        not_list.invoke("q")
    with pytest.raises(TypeError, match="pilot must implement the Planner protocol"):
        ContextPilotRetriever(base_retriever=RunnableLambda(lambda q: []), pilot=object())
    with pytest.raises(ValidationError, match="k must be >= 1"):
        ContextPilotRetriever(base_retriever=RunnableLambda(lambda q: []), k=0)
    with pytest.raises(TypeError, match="query must be a str"):
        ContextPilotRetriever(base_retriever=RunnableLambda(lambda q: [])).invoke(3)  # type: ignore[arg-type]


def test_batch_rejects_one_conversation_twice_and_takes_per_turn_settings(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(
            results={"a": topic_documents[:2], "b": topic_documents[2:4], "c": topic_documents[:4]}
        ),
        pilot=pilot,
    )
    meta = {"metadata": {"contextpilot_conversation_id": "c", "contextpilot_visible_turns": "all"}}
    with pytest.raises(ValueError, match="turns of the same conversation 'c'"):
        retriever.batch(["a", "b"], config=[meta, meta])
    # Different conversations in one batch are fine.
    other = {"metadata": {"contextpilot_conversation_id": "e", "contextpilot_visible_turns": "all"}}
    out = retriever.batch(["a", "b"], config=[meta, other])
    requests = pilot.calls[-1]["requests"]  # one PlanRequest per input
    assert all(isinstance(r, PlanRequest) for r in requests)
    assert [r.scope.conversation_id for r in requests] == ["c", "e"]
    assert [plan_of(retriever, docs).scope.conversation_id for docs in out] == ["c", "e"]
    retriever.batch(["b"], config=[meta])  # turn 2 of c
    # Turn 3 of c keeps only turn 2 in its prompt: a and b's turn-1 blocks stay, b's are hints.
    last = {"metadata": {**meta["metadata"], "contextpilot_visible_turns": 1}}
    plain = {
        "metadata": {
            "contextpilot_conversation_id": "f",
            "contextpilot_visible_turns": "all",
            "contextpilot_turn": 4,
        }
    }
    out = retriever.batch(["c", "c"], config=[last, plain])
    replaced = {d.page_content for d in out[0] if status(d) == "replaced"}
    assert {entry(d)["original_page_content"] for d in out[0] if status(d) == "replaced"} == {
        d.page_content for d in topic_documents[2:4]
    }
    assert replaced and plan_of(retriever, out[0]).scope.turn == 3
    assert plan_of(retriever, out[1]).scope.turn == 4
    assert all(status(d) == "shown" for d in out[1])


def test_async_and_batch_paths_give_the_same_documents_as_sync(
    multihop_documents, multihop_questions
):
    questions = multihop_questions[:12]
    base = Bm25sRetriever(documents=multihop_documents, k=5)

    def run(mode: str) -> list[list[Document]]:
        retriever = ContextPilotRetriever(base_retriever=base, pilot=ContextPilot())
        if mode == "invoke":
            return [retriever.invoke(q) for q in questions]
        if mode == "ainvoke":

            async def all_() -> list[list[Document]]:
                return [await retriever.ainvoke(q) for q in questions]

            return asyncio.run(all_())
        if mode == "batch":
            return retriever.batch(questions)
        return asyncio.run(retriever.abatch(questions))

    def strip(results: list[list[Document]]) -> list[list[tuple]]:
        return [
            [
                (d.page_content, d.metadata["title"], entry(d)["index"], entry(d)["label"])
                for d in docs
            ]
            for docs in results
        ]

    sync, async_ = run("invoke"), run("ainvoke")
    assert strip(sync) == strip(async_)  # same index state, same order
    batch, abatch = run("batch"), run("abatch")
    assert strip(batch) == strip(abatch)
    # Joint planning may order a request's documents differently; the documents are the same.
    assert [sorted(d.page_content for d in docs) for docs in batch] == [
        sorted(d.page_content for d in docs) for docs in sync
    ]
    inner = [base.invoke(q) for q in questions]
    assert [sorted(d.page_content for d in docs) for docs in inner] == [
        sorted(d.page_content for d in docs) for docs in sync
    ]


@pytest.mark.parametrize(("k", "error"), [(0, ValueError), ("3", TypeError), (True, TypeError)])
def test_bad_k_fails_before_the_base_retriever_runs(topic_documents, k, error):
    base = ListRetriever(results={"q": topic_documents})
    retriever = ContextPilotRetriever(base_retriever=base)
    with pytest.raises(error, match="k must be"):
        retriever.invoke("q", k=k)
    with pytest.raises(error, match="k must be"):
        retriever.batch(["q"], k=k)
    assert base.calls == []


def test_async_paths_await_the_async_twins(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=pilot
    )
    docs = asyncio.run(retriever.ainvoke("kv cache"))
    out = asyncio.run(retriever.abatch(["bm25", "eviction"]))
    assert [c["method"] for c in pilot.calls] == ["aplan", "aplan_batch"]
    assert entry(docs[0])["rid"] == pilot.plans[0].rid
    assert [entry(o[0])["rid"] for o in out] == [p.rid for p in pilot.batches[0].plans]
