"""End to end with a real engine: vLLM on the CPU (random weights) publishes its KV-cache events
over ``ipc://``; ``contextpilot-server`` follows them; an app plans through the service, calls
the engine with the real ``openai`` client carrying the plan's ids, and reads the engine's
cached tokens back. A prefix-cache reset on the engine evicts the requests from the index.

Tier ``vllm`` (and ``slow``): needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``); skipped
without it. About a minute on 2 cores (the engine's start dominates).
"""

from __future__ import annotations

import random
import signal

import httpx
import openai
import pytest
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from contextpilot_bench.testbed.vllm_server import VllmCpuServer
from service_testing import wait_for
from support.engine_marks import NEEDS_VLLM

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.llm_call.engine_fields import (
    CacheUsageTracker,
    create_chat_completion,
    read_usage,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    NEEDS_VLLM,
]

BLOCK_SIZE = 32
WORDS = [
    "cache",
    "engine",
    "prefix",
    "block",
    "token",
    "request",
    "model",
    "index",
    "shared",
    "context",
    "document",
    "answer",
]


def _passages(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Passage {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."
        for i in range(count)
    ]


def test_the_service_follows_a_real_engine(tmp_path, server_factory) -> None:  # type: ignore[no-untyped-def]
    model_dir = prepare_model_dir(tmp_path / "model", seed=0)
    # A generous start timeout: the engine starts in ~30 s alone, minutes on a loaded machine.
    with VllmCpuServer(
        model_dir, block_size=BLOCK_SIZE, max_model_len=4096, startup_timeout=600
    ) as engine:
        service = server_factory(
            "--kv-events", engine.kv_events_endpoint,
            "--kv-events-replay", engine.replay_endpoint,
            "--kv-events-topic", engine.kv_events_topic,
        )  # fmt: skip
        wait_for(lambda: httpx.get(f"{service.base_url}/health").json()["engine_connected"])
        llm = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="none", timeout=120)
        passages = _passages(5, 60, seed=1)
        with ContextPilotClient(service.base_url, fallback=False) as pilot:
            tracker = CacheUsageTracker(pilot)

            def ask(question: str, texts: list[str]):  # type: ignore[no-untyped-def]
                plan = pilot.plan(question, texts)
                response = create_chat_completion(
                    llm, plan, tracker=tracker, model=engine.model_name, max_tokens=1
                )
                return plan, read_usage(response)

            first, first_usage = ask("What do the passages say about caches?", passages)
            # The same passages retrieved in another order: the pilot aligns them to the
            # prefix the engine holds, and the engine serves it from its cache.
            second, second_usage = ask("And about tokens?", passages[::-1])
            assert second.order != list(range(5)) and [b.text for b in second.blocks] == [
                b.text for b in first.blocks
            ]
            assert second.matched_prefix_blocks == 5  # the whole prefix the index holds
            assert first_usage is not None and second_usage is not None
            # The passages are most of the prompt (the system prompt and the tail ~60 tokens).
            assert first_usage.cached_tokens == 0
            assert second_usage.cached_tokens >= first_usage.prompt_tokens // 2
            # vLLM echoed the plan's rid as session_id on BlockStored: both are attributed.
            wait_for(
                lambda: pilot.stats()["sync"]["source"]["mirror"]["attributed_requests"] >= 2,
                timeout_s=30,
            )
            assert pilot.stats()["requests"] == 2

            engine.reset_prefix_cache()  # AllBlocksCleared, published with the next step
            third, _ = ask("Unrelated?", _passages(2, 30, seed=7))
            # The reset evicted the two attributed requests; the third is planned after it.
            wait_for(lambda: pilot.stats()["requests"] == 1, timeout_s=30)
            stats = pilot.stats()
            assert stats["usage"]["reports"] == 3
            assert stats["usage"]["cached_tokens"] == tracker.stats()["cached_tokens"] > 0
            assert stats["sync"]["failures"] == {}
            # The reset's evictions are the engine link's, by cause (the metric reads them).
            assert stats["sync"]["evictions"] == {"kv-events": 2}
            assert [pilot.evict(p.rid) for p in (first, second, third)] == [False, False, True]
        service.stop(signal.SIGTERM)
