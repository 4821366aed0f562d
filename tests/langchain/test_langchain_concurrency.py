"""Many threads (and tasks) calling one retriever at once, each in its own conversation: nothing
crosses conversations, every turn sees only its own history, every request gets its own rid."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from langchain_core.documents import Document
from langchain_support import Bm25sRetriever, ListRetriever, RecordingPilot

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import ContextPilotRetriever

THREADS = 8
TURNS = 6


def test_threads_in_different_conversations_stay_isolated(multihop_documents):
    docs = multihop_documents[: 2 * TURNS + 2]
    # Every conversation retrieves overlapping windows: each turn repeats two documents of the
    # turn before (replaced by hints, whatever the other conversations did meanwhile) and
    # brings two new ones.
    results = {f"turn {t}": docs[2 * t : 2 * t + 4] for t in range(TURNS)}
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(base_retriever=ListRetriever(results=results), pilot=pilot)
    barrier = threading.Barrier(THREADS)
    seen: dict[str, list[list[Document]]] = defaultdict(list)
    errors: list[BaseException] = []

    def conversation(n: int) -> None:
        try:
            barrier.wait()
            for t in range(TURNS):
                meta = {
                    "contextpilot_conversation_id": f"c{n}",
                    "contextpilot_visible_turns": "all",
                    "contextpilot_tenant": f"t{n % 2}",
                }
                seen[f"c{n}"].append(retriever.invoke(f"turn {t}", config={"metadata": meta}))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=conversation, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors

    rids = set()
    for name, turns in seen.items():
        shown_before: set[str] = set()
        for t, documents in enumerate(turns):
            entries = [d.metadata[METADATA_KEY] for d in documents]
            (rid,) = {e["rid"] for e in entries}
            scope = pilot.plan_for(rid).scope
            assert (scope.conversation_id, scope.turn) == (name, t + 1)
            for e, doc in zip(entries, documents):
                original = e.get("original_page_content", doc.page_content)
                assert (e["status"] == "replaced") == (original in shown_before)
            shown_before |= {
                d.page_content for d, e in zip(documents, entries) if e["status"] == "shown"
            }
            rids.add(rid)
        replaced = [
            sum(d.metadata[METADATA_KEY]["status"] == "replaced" for d in ts) for ts in turns
        ]
        assert replaced == [0] + [2] * (TURNS - 1)
    assert len(rids) == THREADS * TURNS
    assert pilot.stats()["requests"] == THREADS * TURNS


def test_concurrent_tasks_batches_and_invokes_share_one_index(
    multihop_documents, multihop_questions
):
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=multihop_documents, k=5), pilot=pilot
    )
    questions = multihop_questions[:24]

    async def run() -> list:
        tasks = [retriever.ainvoke(q) for q in questions[:12]]
        tasks.append(retriever.abatch(questions[12:]))
        return await asyncio.gather(*tasks)

    out = asyncio.run(run())
    singles, batch = out[:12], out[12]
    expected = [Bm25sRetriever(documents=multihop_documents, k=5).invoke(q) for q in questions]
    got = singles + batch
    for docs, want in zip(got, expected):
        assert sorted(d.page_content for d in docs) == sorted(d.page_content for d in want)
    rids = {docs[0].metadata[METADATA_KEY]["rid"] for docs in got}
    assert len(rids) == 24 and pilot.stats()["requests"] == 24
