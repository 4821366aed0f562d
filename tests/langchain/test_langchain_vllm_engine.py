"""The whole loop through LangChain with a real engine: vLLM's CPU build (random weights).

The ContextPilot chain sends each plan's rid as ``session_id`` through ``ChatOpenAI``; vLLM echoes
it on its ``BlockStored`` KV events; the team's ``KVEventSubscriber`` and ``CacheMirror`` attribute
the cached blocks to the rids and report evictions, which go back to ``ContextPilot.evict``. The
engine's own ``cached_tokens`` compare the baseline chain with the ContextPilot chain.
Needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``); marked ``vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from langchain_core.runnables import RunnablePassthrough
from langchain_openai import ChatOpenAI
from langchain_support import Bm25sRetriever, RecordingPilot

from contextpilot_integrations.engines.vllm_cpu import (
    VllmCpuServer,
    find_vllm_python,
    prepare_model_dir,
)
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotRetriever,
    RAGInputs,
    format_documents,
    with_request_id,
)
from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.subscriber import KVEventSubscriber

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        find_vllm_python() is None,
        reason="no vLLM environment: run scripts/setup-vllm-env.sh (makes .venv-vllm)",
    ),
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


def test_rids_reach_the_engine_events_and_evictions_reach_the_pilot(
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

    pilot = RecordingPilot()
    evicted: list[str] = []

    def on_evict(rid: str) -> None:
        evicted.append(rid)
        pilot.evict(rid)

    mirror = CacheMirror(on_evict=on_evict)
    server.reset_prefix_cache()
    with KVEventSubscriber(
        server.kv_events_endpoint,
        server.replay_endpoint,
        topic=server.kv_events_topic,
        on_batch=mirror.apply_batch,
        on_resync=mirror.resync,
    ):
        time.sleep(0.5)  # the subscription reaches the publisher (ZMQ slow joiner)
        retriever = ContextPilotRetriever(base_retriever=bm25, pilot=pilot)
        chain = (
            RAGInputs(retriever=retriever)
            | CONTEXTPILOT_PROMPT
            | with_request_id(chat_model(server))
        )
        answers = chain.batch(questions, config={"max_concurrency": 1})
        plan_rids = {plan.rid for plan in pilot.plans}
        deadline = time.monotonic() + 30
        while len((mirror.cached_requests() | set(evicted)) & plan_rids) < len(plan_rids):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        seen = (mirror.cached_requests() | set(evicted)) & plan_rids

    assert len(answers) == QUESTIONS == len(plan_rids)
    # The engine echoed the plan rids (sent as session_id) on its BlockStored events; a request
    # whose new tokens fill no whole block stores nothing, so allow a few.
    assert len(seen) >= 0.8 * QUESTIONS, f"{len(seen)} of {QUESTIONS} rids seen in KV events"
    gone = set(evicted) & plan_rids
    assert gone, "the small cache evicted planned requests"
    assert not any(rid in pilot.pilot.index for rid in gone)  # the evictions reached the pilot
    assert hit_ratio(answers) > hit_ratio(baseline_answers)
