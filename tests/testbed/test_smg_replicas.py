"""Two real vLLM CPU replicas behind the real Shepherd Model Gateway, end to end.

One fleet of two servers for the module (random weights, block size 32, a KV cache of a few
requests each, so that each replica evicts), :class:`ReplicaRouter` over them with one engine
link per replica on that replica's own KV events:

- through ``smg launch`` routing on the plans' routing keys, each request lands on one replica,
  the replica the router learns from that replica's events, every key's requests on one replica,
  and the engines report cache hits;
- evictions of each replica reach only its own index (what left a replica's index is what its
  own link evicted);
- a replica stopped mid-run is marked down (its events stopped), its requests are evicted, and
  the rest of the run is planned for, and served by, the other;
- ``contextpilot-bench --engine vllm-cpu --replicas 2`` runs the comparison in one command and
  stops everything it started.

Skips without a Python that runs vLLM (``scripts/setup-vllm-env.sh``), without ``smg``
(``scripts/setup-smg-env.sh``) or without the MultiHop-RAG data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.engine_marks import NEEDS_SMG, NEEDS_VLLM

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")

from contextpilot_bench.methods import PreparedWorkload  # noqa: E402
from contextpilot_bench.smg_gateway import SmgGateway  # noqa: E402
from contextpilot_bench.testbed.process_group import process_group_members  # noqa: E402
from contextpilot_bench.vllm_replica_fleet import VllmCpuFleet  # noqa: E402
from support.data_dir import MULTIHOP_RAG, dataset_dir_or_skip  # noqa: E402
from support.vllm_workload import kv_cache_blocks, prepare_multihop  # noqa: E402

from contextpilot_integrations.core.plan import Plan  # noqa: E402
from contextpilot_integrations.core.replicas.routing import ReplicaRouter  # noqa: E402
from contextpilot_integrations.core.request import PlanRequest  # noqa: E402
from contextpilot_integrations.llm_call.engine_fields import (  # noqa: E402
    ROUTING_HEADER,
    engine_base_url,
    engine_headers,
)
from contextpilot_integrations.sync.engine_link import EngineLink  # noqa: E402

BLOCK_SIZE = 32
SLICE = 24  # MultiHop-RAG requests
TOP_K = 6
CACHE_REQUESTS = 3  # each replica's KV cache holds this many requests of max_model_len tokens

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
    NEEDS_SMG,
]


@pytest.fixture(scope="module")
def prepared(model_dir: Path) -> PreparedWorkload:
    return prepare_multihop(model_dir, SLICE, TOP_K)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, prepared: PreparedWorkload) -> Iterator[VllmCpuFleet]:
    """Two servers for the module; both process groups are checked gone at its end."""
    max_model_len, usable = kv_cache_blocks(model_dir, prepared, BLOCK_SIZE, CACHE_REQUESTS)
    with VllmCpuFleet(
        model_dir, 2, block_size=BLOCK_SIZE, num_gpu_blocks=usable + 1, max_model_len=max_model_len
    ) as running:
        pids = [instance.server.pid for instance in running.instances]
        assert all(pid is not None and process_group_members(pid) for pid in pids)
        yield running
    assert all(process_group_members(pid) == [] for pid in pids if pid is not None)


def _requests(prepared: PreparedWorkload, prefix: str, part: slice = slice(None)) -> list:
    requests = list(enumerate(prepared.workload.requests))[part]
    return [PlanRequest(r.query, prepared.block_texts(i), f"{prefix}-{r.id}") for i, r in requests]


def _landing_watch(fleet: VllmCpuFleet) -> tuple[list[EngineLink], dict[str, set[str]]]:
    """One link per replica that records the rids its engine's stored blocks carry."""
    landed: dict[str, set[str]] = defaultdict(set)
    links = []
    for name, instance in zip(fleet.names, fleet.instances, strict=True):
        links.append(
            EngineLink(instance.cache_sync)
            .bind(lambda rid: False, on_session=landed[name].add)
            .start()
        )
    return links, landed


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _send_direct(fleet: VllmCpuFleet, plans: list[Plan]) -> tuple[int, int]:
    """Send each plan to its replica's URL; (prompt tokens, cached tokens)."""
    prompt = cached = 0
    for plan in plans:
        answer = fleet.client_for(engine_base_url(plan) or "").chat(plan.messages, rid=plan.rid)
        prompt += answer.prompt_tokens
        cached += answer.cached_tokens or 0
    return prompt, cached


def test_requests_with_the_routing_key_land_where_the_router_learns(
    fleet: VllmCpuFleet, prepared: PreparedWorkload
) -> None:
    fleet.reset()
    links, landed = _landing_watch(fleet)
    router = ReplicaRouter(
        fleet.replica_specs(),
        mode="gateway",
        layout=prepared.layout,
        token_counter=prepared.counter,
        link_factory=EngineLink,
    )
    try:
        batch = router.plan_batch(_requests(prepared, "key"))
        keys = {plan.rid: plan.routing_key for plan in batch.plans}
        assert all(keys.values()) and len(set(keys.values())) == 2  # one probe key per replica
        with SmgGateway(
            fleet.urls,
            policy="round_robin",
            routing_header=ROUTING_HEADER,
            assignment_mode="delegate",
        ) as gateway:
            from contextpilot_bench.engine_client import EngineClient

            with EngineClient(gateway.base_url, model=fleet.model_name) as client:
                prompt = cached = 0
                for plan in batch.scheduled():
                    assert engine_headers(plan) == {ROUTING_HEADER: plan.routing_key}
                    answer = client.chat(plan.messages, rid=plan.rid, headers=engine_headers(plan))
                    prompt += answer.prompt_tokens
                    cached += answer.cached_tokens or 0
        assert fleet.wait_for_events()
        sent = set(keys)
        assert _wait_for(lambda: sum(len(landed[n] & sent) for n in fleet.names) >= len(sent) // 2)
        where = {rid: name for name in fleet.names for rid in landed[name] & sent}
        # A request's blocks are stored by one replica only.
        assert len(where) == sum(len(landed[n] & sent) for n in fleet.names)
        # The router learnt each landing from that replica's events.
        assert all(router.replica_of(rid) == name for rid, name in where.items()), where
        # Every key's requests went to one replica, and both replicas got a key.
        by_key: dict[str, set[str]] = defaultdict(set)
        for rid, name in where.items():
            by_key[keys[rid]].add(name)
        assert all(len(names) == 1 for names in by_key.values()), by_key
        assert set(where.values()) == set(fleet.names)
        stats = router.stats()
        assert all(r["confirmed"] for r in stats["replicas"].values())
        assert cached > 0 and cached / prompt > 0.05
    finally:
        router.close()
        for link in links:
            link.stop()


def test_evictions_from_each_replica_reach_only_its_index(
    fleet: VllmCpuFleet, prepared: PreparedWorkload
) -> None:
    fleet.reset()
    with ReplicaRouter(
        fleet.replica_specs(),
        mode="direct",
        layout=prepared.layout,
        token_counter=prepared.counter,
        link_factory=EngineLink,
    ) as router:
        batch = router.plan_batch(_requests(prepared, "evict"))
        _send_direct(fleet, batch.scheduled())
        assert fleet.wait_for_events()
        time.sleep(0.5)  # the router's own links apply the same batches
        stats = router.stats()["replicas"]
        sent = {name: {p.rid for p in batch.plans if p.replica == name} for name in fleet.names}
        applied_somewhere = 0
        for name in fleet.names:
            index = router._fleet.replicas[name].pilot.index
            held = {rid for rid in sent[name] if rid in index}
            applied = int(stats[name]["sync"]["evictions"].get("kv-events", 0))
            # What left this replica's index is exactly what its own link evicted.
            assert len(sent[name]) - len(held) == applied, name
            assert stats[name]["index"]["requests"] == len(held)
            other = [n for n in fleet.names if n != name][0]
            assert not any(rid in index for rid in sent[other])
            applied_somewhere += applied
        assert applied_somewhere > 0, "the caches were meant to be small enough to evict"


def test_cli_runs_two_replicas_behind_smg_in_one_command(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    env = {**os.environ, "CONTEXTPILOT_DATA_DIR": str(dataset_dir_or_skip(MULTIHOP_RAG))}
    cli = subprocess.run(
        [
            sys.executable, "-m", "contextpilot_bench", "--engine", "vllm-cpu",
            "--replicas", "2", "--router", "smg", "--workload", "multihop-rag", "--limit", "8",
            "-k", "4", "--engine-kv-tokens", "0.5", "--out", str(out), "--no-plot",
        ],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {row["method"]: row for row in document["rows"]}
    assert set(rows) == {
        "baseline-round_robin",
        "baseline-cache_aware",
        "contextpilot-cache_aware",
        "contextpilot-routed-smg",
    }
    for row in rows.values():
        assert row["requests"] == 8
        assert sum(row["replica_requests"].values()) == 8  # the workers' own counters
        assert row["ttft_p50_s"] > 0
    assert rows["baseline-round_robin"]["replica_requests"] == {"replica-0": 4, "replica-1": 4}
    assert "contextpilot-routed-smg: max/min prompt tokens per replica" in cli.stdout
    leftover = subprocess.run(["pgrep", "-f", str(out.parent)], capture_output=True, text=True)
    assert leftover.stdout == ""


def test_a_replica_stopped_mid_run_is_marked_down_and_routing_goes_on(
    fleet: VllmCpuFleet, prepared: PreparedWorkload
) -> None:
    """Last in the module: it stops the second server."""
    fleet.reset()
    half = SLICE // 2
    with ReplicaRouter(
        fleet.replica_specs(engine_grace_s=1.0),
        mode="direct",
        layout=prepared.layout,
        token_counter=prepared.counter,
        link_factory=EngineLink,
    ) as router:
        first = router.plan_batch(_requests(prepared, "down", slice(0, half)))
        _send_direct(fleet, first.scheduled())
        assert fleet.wait_for_events()
        stopped, survivor = fleet.names[1], fleet.names[0]
        assert _wait_for(lambda: router.stats()["replicas"][stopped]["index"]["requests"] > 0)
        fleet.instances[1].stop()
        assert _wait_for(lambda: not router.stats()["replicas"][stopped]["up"])
        down = router.stats()["replicas"][stopped]
        assert down["index"]["requests"] == 0 and down["down_evictions"] > 0
        second = router.plan_batch(_requests(prepared, "down", slice(half, None)))
        assert {plan.replica for plan in second.plans} == {survivor}
        prompt, cached = _send_direct(fleet, second.scheduled())
        assert prompt > 0 and cached > 0
        assert router.stats()["replicas"][survivor]["up"]
