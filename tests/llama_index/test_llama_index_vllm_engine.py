"""A real engine (vLLM's CPU build, random weights) behind ``ContextPilotOpenAILike``: the plan's
rid reaches the engine (it names the response and the engine's KV-cache events carry it as the
session id), and a second query sharing the nodes hits the engine's prefix cache. The pilot is
the one-line change with engine sync, ``ContextPilot(engine=EngineLink(server.cache_sync))``:
its own engine link attributes the engine's cached blocks to the plan rids.

Needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``); skipped without it. Marked ``vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from contextpilot_bench.testbed.vllm_server import VllmCpuServer
from llama_index.core.query_engine import RetrieverQueryEngine
from support.engine_marks import NEEDS_VLLM

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    ContextPilotOpenAILike,
    text_qa_template,
)
from contextpilot_integrations.sync.engine_link import EngineLink
from contextpilot_integrations.sync.kv_events import BlockStored, KVEventDecoder

BLOCK_SIZE = 32

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCpuServer]:
    model_dir = prepare_model_dir(tmp_path_factory.mktemp("model"), seed=0)
    with VllmCpuServer(model_dir, block_size=BLOCK_SIZE, max_model_len=4096) as running:
        yield running


def _stored_sessions(socket: zmq.Socket, topic: bytes, want: set[str], timeout: float) -> set[str]:  # type: ignore[type-arg]
    decoder, seen = KVEventDecoder(), set()
    deadline = time.monotonic() + timeout
    while not want <= seen and time.monotonic() < deadline:
        if socket.poll(200):
            frame_topic, _, payload = socket.recv_multipart()
            assert frame_topic == topic
            for event in decoder.decode(payload).events:
                if isinstance(event, BlockStored) and event.session_id:
                    seen.add(event.session_id)
    return seen


def test_rid_reaches_vllm_and_shared_nodes_hit_its_prefix_cache(
    server: VllmCpuServer, bm25, questions, recorder
) -> None:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, server.kv_events_topic.encode())
    socket.connect(server.kv_events_endpoint)
    pilot = ContextPilot(engine=EngineLink(server.cache_sync))
    time.sleep(0.5)  # ZMQ slow joiner (this socket and the pilot's subscriber)
    try:
        llm = ContextPilotOpenAILike(
            model=server.model_name,
            api_base=f"{server.base_url}/v1",
            api_key="none",
            is_chat_model=True,
            context_window=4096,
            max_tokens=2,
            timeout=120,
        )
        pp = ContextPilotNodePostprocessor(pilot)
        engine = RetrieverQueryEngine.from_args(
            bm25, llm=llm, node_postprocessors=[pp], text_qa_template=text_qa_template(pp)
        )
        server.reset_prefix_cache()
        # Questions 0 and 13 retrieve the same articles in different orders.
        responses = [engine.query(questions[0]), engine.query(questions[13])]
        rids = [r.source_nodes[0].node.metadata["contextpilot"]["rid"] for r in responses]
        first, second = recorder.records
        # vLLM names the response after the request_id it was sent.
        assert first.response_id == f"chatcmpl-{rids[0]}"
        assert second.response_id == f"chatcmpl-{rids[1]}"
        # The second prompt repeats the first one's system prompt and blocks byte for byte:
        # the engine serves them from its prefix cache, in whole 32-token blocks.
        # (up to the last block's separator: the annotation is left out when in order)
        shared = first.text[: first.text.rindex("-----\n") + len("-----\n")]
        assert second.text.startswith(shared)
        plans = [pp.plan_for(r.source_nodes) for r in responses]
        tokens = [server.tokenize(plan.messages) for plan in plans]  # type: ignore[union-attr]
        common = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), min(map(len, tokens)))
        assert common >= len(server.tokenize(shared)) - 16  # the blocks, in tokens
        assert first.cached_tokens == 0
        assert second.cached_tokens == common // BLOCK_SIZE * BLOCK_SIZE
        # The KV-cache events attribute the stored blocks to each plan's rid (session_id).
        topic = server.kv_events_topic.encode()
        assert _stored_sessions(socket, topic, set(rids), timeout=20) >= set(rids)
        # ... and the pilot's own engine link follows them: both requests are cached.
        mirror = pilot.engine.source.mirror  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while not set(rids) <= mirror.cached_requests() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(rids) <= mirror.cached_requests()
        assert pilot.stats()["sync"]["engine_connected"]
        assert all(rid in pilot.index for rid in rids)
    finally:
        pilot.close()
        socket.close()
