"""Two real vLLM CPU replicas behind the real smg gateway behind the proxy, with the replica
router hosted in the proxy (docs/DESIGN.md, "The proxy"): MultiHop-RAG calls with their
documents marked in the body, sent with the real ``openai`` SDK. Each call goes to the gateway
with the router's routing key, smg pins each key to a worker, and each replica's own KV events
tell the proxy's router where each call landed (both keys confirmed, each call's replica known,
each replica's index holding what it served), and each replica's KV capacity is what the
proxy asked of its engine at start. Calls that repeat earlier calls' documents in
another order go to the replica that stored them, and the engines report cache hits there.

Tier ``vllm``: needs ``.venv-vllm`` and ``smg`` (``scripts/setup-vllm-env.sh``,
``scripts/setup-smg-env.sh``) and the MultiHop-RAG sample; skipped without them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from support.engine_marks import NEEDS_SMG, NEEDS_VLLM

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")

from contextpilot_bench.smg_gateway import SmgGateway  # noqa: E402
from contextpilot_bench.vllm_replica_fleet import VllmCpuFleet  # noqa: E402
from support.asgi_server import serve_in_thread  # noqa: E402
from support.vllm_workload import kv_cache_blocks, prepare_multihop  # noqa: E402

from contextpilot_integrations.llm_call.engine_fields import ROUTING_HEADER  # noqa: E402
from contextpilot_integrations.service.app import create_app  # noqa: E402
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig  # noqa: E402
from contextpilot_integrations.service.service_config import ServiceConfig  # noqa: E402

BLOCK_SIZE = 32
KV_SIZE_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")
CALLS = 8
REPEATS = 3  # calls repeating the documents of the first ones, reversed
TOP_K = 4

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
    NEEDS_SMG,
]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("targeted", [False, True], ids=["routing-key", "worker-index"])
def test_calls_through_the_proxy_and_smg_are_routed_by_key_and_followed_per_replica(
    model_dir: Path, targeted: bool
) -> None:
    prepared = prepare_multihop(model_dir, CALLS, TOP_K)
    max_model_len, usable = kv_cache_blocks(model_dir, prepared, BLOCK_SIZE, CALLS + REPEATS)
    requests = prepared.workload.requests
    calls = [(r.query, list(prepared.block_texts(i))) for i, r in enumerate(requests)]
    calls += [(requests[i].query, list(prepared.block_texts(i))[::-1]) for i in range(REPEATS)]
    with (
        VllmCpuFleet(
            model_dir, 2, block_size=BLOCK_SIZE, num_gpu_blocks=usable + 1,
            max_model_len=max_model_len + 512, startup_timeout=600,
        ) as fleet,
        SmgGateway(
            fleet.urls, policy="consistent_hashing", routing_header=None, assignment_mode=None,
        ) if targeted else SmgGateway(
            fleet.urls, policy="round_robin", routing_header=ROUTING_HEADER,
            assignment_mode="delegate",
        ) as gateway,
    ):  # fmt: skip
        before = fleet.counters()
        fleet_config = {
            "mode": "gateway", "replicas": fleet.replica_specs(), "target_workers": targeted,
        }  # fmt: skip
        config = ServiceConfig(proxy=ProxyConfig(f"{gateway.base_url}/v1", fleet=fleet_config))
        app = create_app(config)
        with serve_in_thread(app, lifespan="on", start_timeout_s=20) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            routing = app.state.proxy.routing
            router = routing.router_of(None)
            # Each replica's KV capacity asked of its engine at start: what its log states
            # ("KV cache size: N tokens"), less vLLM's null block.
            logged = {
                name: int(KV_SIZE_LOG.findall(instance.server.log_tail(400))[-1].replace(",", ""))
                - BLOCK_SIZE
                for name, instance in zip(fleet.names, fleet.instances, strict=True)
            }
            assert set(logged.values()) == {usable * BLOCK_SIZE}, logged

            def capacities() -> dict[str, int | None]:
                replicas = router.stats()["replicas"]
                return {
                    n: (r["kv_budget"] or {}).get("capacity_tokens") for n, r in replicas.items()
                }

            assert _wait_for(lambda: capacities() == logged), capacities()
            if targeted:  # each replica's worker index learnt from the gateway's answers
                assert _wait_for(lambda: routing.workers.state != "pending", 60.0)
                assert routing.workers.stats()["state"] == "on", routing.workers.stats()
                assert sorted(routing.workers.stats()["workers"].values()) == [0, 1]
                before = fleet.counters()  # the calibration's calls are not the test's
            planned: dict[str, str] = {}
            rids: list[str] = []
            for i, (query, documents) in enumerate(calls):
                raw = client.chat.completions.with_raw_response.create(
                    model=fleet.model_name,
                    messages=[{"role": "user", "content": query}],
                    max_tokens=1,
                    extra_headers={"x-contextpilot-session": f"call-{i}"},
                    extra_body={"contextpilot": {"documents": documents}},
                )
                rids.append(raw.headers["x-contextpilot-rid"])
                planned[rids[-1]] = raw.headers["x-contextpilot-replica"]
                # The gateway's answer names the worker: the call's replica is known at once.
                worker = routing.workers.replica_at(raw.headers["x-smg-routed-worker-id"])
                assert _wait_for(lambda w=worker: router.replica_of(rids[-1]) == w, 5.0)
                if targeted:  # sent to the planned replica's worker, and it went there
                    assert worker == planned[rids[-1]]
                if i == CALLS - 1:  # the repeats are planned knowing where the first landed
                    assert fleet.wait_for_events()
                    assert _wait_for(lambda: all(router.replica_of(rid) for rid in rids))
            assert fleet.wait_for_events()
            # Each replica's own events named the calls it stored: every call's replica known.
            assert _wait_for(lambda: all(router.replica_of(rid) for rid in planned))
            stats = router.stats()["replicas"]
            # The calls carried the routing keys: each replica's key was seen landing on it.
            assert all(replica["confirmed"] for replica in stats.values()), stats
            landed = {router.replica_of(rid) for rid in planned}
            assert landed == set(fleet.names)
            if targeted:
                assert router.stats()["routing"]["remapped"] == 0
                assert routing.workers.stats()["misrouted"] == 0
            for name in fleet.names:
                assert stats[name]["index"]["requests"] > 0
                assert stats[name]["sync"]["engine_connected"]
            # A repeat goes where its documents are stored.
            for i in range(REPEATS):
                assert router.replica_of(rids[CALLS + i]) == router.replica_of(rids[i])
        after = fleet.counters()
        served = {name: after[name].requests - before[name].requests for name in fleet.names}
        assert sum(served.values()) == CALLS + REPEATS and all(served.values()), served
        assert sum(after[name].hits - before[name].hits for name in fleet.names) > 0
