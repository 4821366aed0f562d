"""Every face over every planner, on the sync and the async path.

Faces: the LangChain retriever, the LlamaIndex node post-processor, the Mem0 memory wrapper and
the Mem0 agent middleware (LangChain ``create_agent``). Planners: the in-process
``ContextPilot``; the index service's ``ContextPilotClient`` against a real server process; and
the same client with the service down (its local fallback). Calls: sync and async.

Each run sends two requests that share two texts through a spy around the planner, and checks
that the face called the right twin (``plan`` when called synchronously, ``aplan`` when
awaited: a blocking plan on the event loop fails the test), that every input came back once
with the one metadata entry of its placement, and that the second request was aligned behind
the first (its shared texts first, ``matched_prefix_blocks == 2``).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hashed_embeddings import DIMENSIONS, HashedWordEmbeddings
from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode
from mem0 import AsyncMemory, Memory

from contextpilot_integrations import ContextPilot, Plan, PlanRequest, PromptLayout
from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.placement_metadata import (
    METADATA_KEY,
    PLACEMENT_KEYS,
    placement_entry,
)
from contextpilot_integrations.core.plan import BatchPlan
from contextpilot_integrations.langchain import ContextPilotRetriever
from contextpilot_integrations.llama_index import ContextPilotNodePostprocessor
from contextpilot_integrations.mem0 import (
    MEMORY_LAYOUT,
    AsyncContextPilotMemory,
    ContextPilotMemory,
)
from contextpilot_integrations.mem0.langchain_middleware import Mem0MemoryMiddleware
from contextpilot_integrations.mem0.local_config import local_mem0_config

FACES = ("langchain", "llama_index", "mem0", "middleware")
PLANNERS = ("in_process", "client", "client_fallback")
MODES = ("sync", "async")


class SpyPlanner:
    """A complete planner around another that records which twin was called, and on which
    thread (an async twin runs on the event loop's thread; a sync call made from a coroutine
    would show up as ``plan`` there)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int]] = []
        self.plans: list[Plan] = []

    @property
    def layout(self) -> PromptLayout:
        return self.inner.layout

    def plan(self, query: str, blocks: Sequence[str], **kwargs: Any) -> Plan:
        self.calls.append(("plan", threading.get_ident()))
        plan = self.inner.plan(query, blocks, **kwargs)
        self.plans.append(plan)
        return plan

    async def aplan(self, query: str, blocks: Sequence[str], **kwargs: Any) -> Plan:
        self.calls.append(("aplan", threading.get_ident()))
        plan = await self.inner.aplan(query, blocks, **kwargs)
        self.plans.append(plan)
        return plan

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        self.calls.append(("plan_batch", threading.get_ident()))
        return self.inner.plan_batch(requests)

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        self.calls.append(("aplan_batch", threading.get_ident()))
        return await self.inner.aplan_batch(requests)

    def evict(self, rid: str) -> bool:
        return self.inner.evict(rid)


def _texts(tag: str) -> tuple[list[str], list[str]]:
    """Two requests' texts (retriever order): the second shares two texts with the first, in
    another order, behind a text of its own."""
    shared = [
        f"{tag} shared memory {i}: the team meets on day {i} to plan the launch" for i in (1, 2)
    ]
    first = [*shared, f"{tag} first own text: the launch needs a venue"]
    second = [f"{tag} second own text: the venue holds 40 people", shared[1], shared[0]]
    return first, second


# ---------------------------------------------------------------------------------- the faces
class FixedRetriever(BaseRetriever):
    """A LangChain retriever with fixed results per query."""

    results: dict[str, list[Document]]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return list(self.results[query])


def run_langchain(
    pilot: SpyPlanner, mode: str, texts: list[list[str]], _: Path
) -> list[list[dict]]:
    queries = [f"question {i}" for i in range(len(texts))]
    base = FixedRetriever(
        results={
            q: [Document(page_content=t, id=f"d{j}") for j, t in enumerate(ts)]
            for q, ts in zip(queries, texts)
        }
    )
    retriever = ContextPilotRetriever(base_retriever=base, pilot=pilot)
    outputs = []
    for query in queries:
        docs = retriever.invoke(query) if mode == "sync" else asyncio.run(retriever.ainvoke(query))
        outputs.append([{**d.metadata[METADATA_KEY], "text": d.page_content} for d in docs])
    return outputs


def run_llama_index(
    pilot: SpyPlanner, mode: str, texts: list[list[str]], _: Path
) -> list[list[dict]]:
    postprocessor = ContextPilotNodePostprocessor(pilot=pilot)
    outputs = []
    for i, ts in enumerate(texts):
        nodes = [
            NodeWithScore(node=TextNode(text=t, id_=f"n{i}-{j}"), score=1.0 - j / 10)
            for j, t in enumerate(ts)
        ]
        if mode == "sync":
            out = postprocessor.postprocess_nodes(nodes, query_str=f"question {i}")
        else:
            out = asyncio.run(postprocessor.apostprocess_nodes(nodes, query_str=f"question {i}"))
        outputs.append(
            [{**n.node.metadata[METADATA_KEY], "text": n.node.get_content()} for n in out]
        )
    return outputs


def _mem0_config(directory: Path) -> dict[str, Any]:
    return local_mem0_config(
        directory, embeddings=HashedWordEmbeddings(), embedding_dims=DIMENSIONS
    )


def _stored(memory: Any, user: str, texts: Sequence[str], mode: str) -> None:
    for text in dict.fromkeys(texts):
        if mode == "sync":
            memory.add(text, user_id=user, infer=False)
        else:
            asyncio.run(memory.add(text, user_id=user, infer=False))


def _results_in_mem0_order(found: dict) -> list[dict]:
    return [{**r[METADATA_KEY], "text": r["memory"]} for r in found["results"]]


def run_mem0(
    pilot: SpyPlanner, mode: str, texts: list[list[str]], directory: Path
) -> list[list[dict]]:
    outputs = []
    for i, ts in enumerate(texts):
        user = f"user-{uuid.uuid4().hex}"  # one user per request: Mem0 returns exactly its texts
        if mode == "sync":
            memory = Memory.from_config(_mem0_config(directory / f"sync-{i}"))
            _stored(memory, user, ts, mode)
            found = ContextPilotMemory(memory, pilot=pilot).search(
                ts[0], filters={"user_id": user}, top_k=10, threshold=0.0
            )
        else:
            memory = AsyncMemory.from_config(_mem0_config(directory / f"async-{i}"))
            _stored(memory, user, ts, mode)
            found = asyncio.run(
                AsyncContextPilotMemory(memory, pilot=pilot).search(
                    ts[0], filters={"user_id": user}, top_k=10, threshold=0.0
                )
            )
        memory.close()
        outputs.append(_results_in_mem0_order(found))
    return outputs


def run_middleware(
    pilot: SpyPlanner, mode: str, texts: list[list[str]], directory: Path
) -> list[list[dict]]:
    outputs = []
    for i, ts in enumerate(texts):
        user = f"user-{uuid.uuid4().hex}"
        memory_class = Memory if mode == "sync" else AsyncMemory
        memory = memory_class.from_config(_mem0_config(directory / f"mw-{mode}-{i}"))
        _stored(memory, user, ts, mode)
        wrapped = (ContextPilotMemory if mode == "sync" else AsyncContextPilotMemory)(
            memory, pilot=pilot
        )
        model = FakeMessagesListChatModel(responses=[AIMessage(content="ok")])
        agent = create_agent(
            model,
            tools=[],
            middleware=[
                Mem0MemoryMiddleware(
                    wrapped, filters={"user_id": user}, top_k=10, search_kwargs={"threshold": 0.0}
                )
            ],
        )
        message = {"messages": [HumanMessage(content=ts[0])]}
        result = agent.invoke(message) if mode == "sync" else asyncio.run(agent.ainvoke(message))
        assert result["messages"][-1].content == "ok"
        memory.close()
        plan = pilot.plans[-1]
        outputs.append([{**_entry(plan, p), "text": p.text} for p in plan.output_order()])
    return outputs


def _entry(plan: Plan, placement: Any) -> dict:
    return placement_entry(plan, placement)


RUNNERS: dict[str, Callable[..., list[list[dict]]]] = {
    "langchain": run_langchain,
    "llama_index": run_llama_index,
    "mem0": run_mem0,
    "middleware": run_middleware,
}


# ---------------------------------------------------------------------------------- planners
@pytest.fixture
def make_planner(service_url: str, unreachable_url: str) -> Callable[[str, str], SpyPlanner]:
    clients: list[ContextPilotClient] = []

    def make(kind: str, face: str) -> SpyPlanner:
        layout = MEMORY_LAYOUT if face in ("mem0", "middleware") else PromptLayout()
        if kind == "in_process":
            return SpyPlanner(ContextPilot(layout=layout))
        url = service_url if kind == "client" else unreachable_url
        client = ContextPilotClient(url, timeout=2.0, fallback_layout=layout)
        clients.append(client)
        return SpyPlanner(client)

    yield make
    for client in clients:
        client.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("face", FACES)
def test_every_face_over_every_planner_sync_and_async(
    face: str,
    planner: str,
    mode: str,
    make_planner: Callable[[str, str], SpyPlanner],
    tmp_path: Path,
) -> None:
    pilot = make_planner(planner, face)
    first, second = _texts(f"{face}-{planner}-{mode}-{uuid.uuid4().hex[:8]}")
    outputs = RUNNERS[face](pilot, mode, [first, second], tmp_path)

    expected_twin = "plan" if mode == "sync" else "aplan"
    assert [name for name, _ in pilot.calls] == [expected_twin, expected_twin]
    if mode == "async" and face in ("langchain", "llama_index"):
        # the async twin ran on the caller's event-loop thread, awaited, never in a worker
        assert all(thread == threading.get_ident() for _, thread in pilot.calls)
    assert len(pilot.plans) == 2
    for texts, plan, output in zip((first, second), pilot.plans, outputs):
        assert sorted(e["index"] for e in output) == list(range(len(texts)))
        for e in output:
            assert set(PLACEMENT_KEYS) <= set(e) and e["rid"] == plan.rid
            placement = plan.placements[e["index"]]
            assert e["status"] == placement.status.value == "shown"
            assert e["block_id"] == placement.block_id and e["label"] == placement.label
        assert [e["index"] for e in output] == [p.index for p in plan.output_order()]
    shown_second = [e["text"] for e in outputs[1]]
    assert pilot.plans[1].matched_prefix_blocks == 2, "the second request was not aligned"
    assert set(shown_second[:2]) == set(first[:2]), shown_second
