"""The whole loop through LangChain with a real engine: vLLM's CPU build (random weights).

The retriever's pilot is an in-process
``ContextPilot(engine=EngineLink({"kind": "kv-events", ...}))``: the one-line change with engine
sync, nothing wired by hand. The chain sends each plan's rid as
``session_id`` through ``ChatOpenAI``; vLLM echoes it on its ``BlockStored`` KV events; the
pilot's engine link attributes the cached blocks to the rids and drops the requests the engine
evicts from the index. A second, independent subscriber on the same event stream is the witness
of what the engine evicted: the pilot must have dropped exactly those requests. The
engine's own ``cached_tokens`` compare the baseline chain with the ContextPilot chain.
Needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``); marked ``vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from contextpilot_bench.testbed.vllm_server import VllmCpuServer
from langchain_core.runnables import RunnablePassthrough
from langchain_openai import ChatOpenAI
from langchain_support import Bm25sRetriever, RecordingPilot
from support.engine_marks import NEEDS_VLLM

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotRetriever,
    RAGInputs,
    format_documents,
    with_plan_fields,
)
from contextpilot_integrations.sync.engine_link import EngineLink
from contextpilot_integrations.sync.kv_event_source import KVEventSource

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]

BLOCK_SIZE = 32
QUESTIONS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCpuServer]:
    model = prepare_model_dir(
        tmp_path_factory.mktemp("model"),
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate=512,
    )
    # 240 blocks of 32 tokens: room for about a dozen prompts, so the run evicts.
    with VllmCpuServer(model, block_size=BLOCK_SIZE, num_gpu_blocks=240) as running:
        yield running


def chat_model(server: VllmCpuServer) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="none",
        model=server.model_name,
        max_tokens=1,
        temperature=0,
        max_retries=0,
    )


def hit_ratio(answers: list) -> float:
    prompt = sum(a.usage_metadata["input_tokens"] for a in answers)
    cached = sum(a.usage_metadata["input_token_details"]["cache_read"] for a in answers)
    return cached / prompt


def test_the_retriever_over_an_engine_synced_pilot_drops_exactly_the_evicted_requests(
    server: VllmCpuServer, multihop_documents: list, multihop_questions: list[str]
) -> None:
    questions = multihop_questions[:QUESTIONS]
    bm25 = Bm25sRetriever(documents=multihop_documents, k=5)

    server.reset_prefix_cache()
    baseline = (
        {"context": bm25 | format_documents, "question": RunnablePassthrough()}
        | CONTEXTPILOT_PROMPT
        | chat_model(server)
    )
    baseline_answers = [baseline.invoke(q) for q in questions]

    server.reset_prefix_cache()
    witnessed: list[str] = []  # rids whose cached prefix the engine's events removed
    witness = KVEventSource(
        server.kv_events_endpoint,
        witnessed.append,
        replay_endpoint=server.replay_endpoint,
        topic=server.kv_events_topic,
        page_size=server.block_size,
    )
    witness.start()
    try:
        # The one-line change with engine sync: {"kind": "kv-events", "endpoint": ...,
        # "replay_endpoint": ..., "topic": ..., "page_size": ...}.
        with ContextPilot(engine=EngineLink(server.cache_sync)) as pilot:
            time.sleep(0.5)  # the subscriptions reach the publisher (ZMQ slow joiner)
            recording = RecordingPilot(pilot)
            retriever = ContextPilotRetriever(base_retriever=bm25, pilot=recording)
            chain = (
                RAGInputs(retriever=retriever)
                | CONTEXTPILOT_PROMPT
                | with_plan_fields(chat_model(server))
            )
            answers = chain.batch(questions, config={"max_concurrency": 1})
            plan_rids = {plan.rid for plan in recording.plans}

            def evicted() -> set[str]:
                return set(witnessed) & plan_rids

            def dropped() -> set[str]:
                return {rid for rid in plan_rids if rid not in pilot.index}

            deadline = time.monotonic() + 30
            while len((witness.mirror.cached_requests() | evicted()) & plan_rids) < len(plan_rids):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            seen = (witness.mirror.cached_requests() | evicted()) & plan_rids
            deadline = time.monotonic() + 10  # the pilot's subscriber runs on its own thread
            while dropped() != evicted() and time.monotonic() < deadline:
                time.sleep(0.2)
            gone, dropped_rids = evicted(), dropped()
            sync = pilot.stats()["sync"]
    finally:
        witness.stop()

    assert len(answers) == QUESTIONS == len(plan_rids)
    # The engine echoed the plan rids (sent as session_id) on its BlockStored events; a request
    # whose new tokens fill no whole block stores nothing, so allow a few.
    assert len(seen) >= 0.8 * QUESTIONS, f"{len(seen)} of {QUESTIONS} rids seen in KV events"
    assert gone, "the small cache evicted planned requests"
    # The pilot behind the retriever dropped exactly the requests the engine evicted: none it
    # still holds, none the engine still caches.
    assert dropped_rids == gone
    assert sum(sync["evictions"].values()) == len(gone) and sync["engine_connected"]
    assert hit_ratio(answers) > hit_ratio(baseline_answers)
