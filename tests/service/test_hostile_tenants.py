"""A hostile tenant against a real server: two tenants with keys, bob
trying every endpoint against alice's state, and a differential check that nothing he does
changes anything alice sees.

Alice runs a fixed script (plans, batches, conversation turns, usage, evictions) on the real
server while bob interleaves hostile calls: evict and probe her rids (as she named them and as
the engine sees them), plan under them, plan or forget as her, read and add to a conversation
with her conversation id, and send her documents to learn from ``matched_prefix_blocks`` and
the block order whether she has indexed them. Every answer alice gets must be byte-identical to
the answers of a service on which bob never did anything (an in-process twin with the same
keys), and bob's answers identical to those of a service on which alice never did anything:
0 cross-tenant reads, writes or probes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_testing import blocks_of, free_port, wait_for

from contextpilot_integrations.client.schemas import BatchPlanResponse, PlanResponse
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import read_key_file
from contextpilot_integrations.sync.event_publisher import KVEventPublisher
from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch

KEYS = {"alice": "alice-secret-4f9a2c", "bob": "bob-secret-81d3e7"}
ENDPOINTS = [
    ("POST", "/v1/plan", {"query": "q", "blocks": ["x"]}),
    ("POST", "/v1/plan_batch", {"requests": []}),
    ("POST", "/v1/evict", {"rid": "r"}),
    ("POST", "/v1/conversations/forget", {"conversation_id": "c"}),
    ("POST", "/v1/usage", {"rid": "r", "prompt_tokens": 1, "cached_tokens": 0}),
    ("GET", "/v1/usage", None),
    ("POST", "/v1/snapshot", {}),
    ("GET", "/v1/layout", None),
    ("GET", "/v1/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
]


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {t: {"keys": [k]} for t, k in KEYS.items()}}))
    path.chmod(0o600)
    return path


Call = tuple[str, str, dict[str, Any] | None]  # method, path, body
CHAT = {"conversation_id": "c"}


def _plan(query: str, blocks: list[str], rid: str, **scope: Any) -> Call:
    return "POST", "/v1/plan", {"query": query, "blocks": blocks, "rid": rid, "scope": scope}


def _usage(rid: str, prompt: int, cached: int) -> Call:
    return "POST", "/v1/usage", {"rid": rid, "prompt_tokens": prompt, "cached_tokens": cached}


def _alice_script(documents: list[list[str]]) -> list[Call]:
    script = [
        _plan(f"turn {t}", documents[t % 2] + documents[2][: t + 1], f"a-turn-{t}", **CHAT)
        for t in range(3)
    ]
    script.append(_plan("one", documents[3], "same"))
    requests = [{"query": f"b{i}", "blocks": documents[i], "rid": f"a-batch-{i}"} for i in (1, 3)]
    script.append(("POST", "/v1/plan_batch", {"requests": requests}))
    script.append(_usage("same", 900, 400))
    script.append(("POST", "/v1/evict", {"rid": "a-batch-1"}))
    script.append(_plan("again", documents[3], "a-last", **CHAT))
    return script


def _bob_attacks(alice_rid: Callable[[str], str], documents: list[list[str]]) -> list[Call]:
    """What bob tries, given alice's rids as she named them and as the engine sees them."""
    attacks: list[Call] = []
    for rid in ("same", "a-turn-0", alice_rid("same"), alice_rid("a-turn-1")):
        attacks.append(("POST", "/v1/evict", {"rid": rid}))
        attacks.append(_usage(rid, 10, 5))
        attacks.append(_plan("mine", ["bob's"], rid))  # plan under her rid
    for number, document in enumerate(documents):  # does alice have these? (matched prefix)
        attacks.append(_plan("probe", document, f"probe-{number}"))
    attacks.append(_plan("read", documents[0], "read", **CHAT))  # her conversation's records
    attacks.append(_plan("inject", ["bob text"], "inject", turn=2, **CHAT))
    attacks.append(_plan("as alice", ["x"], "as-alice", tenant="alice", **CHAT))
    forget = "POST", "/v1/conversations/forget"
    attacks.append((*forget, {"conversation_id": "c", "tenant": "alice"}))
    attacks.append((*forget, {"conversation_id": "c"}))
    batch = {"query": "q", "blocks": documents[1], "rid": "b", "scope": {"tenant": "alice"}}
    attacks.append(("POST", "/v1/plan_batch", {"requests": [batch]}))
    attacks.append(("POST", "/v1/snapshot", {}))
    attacks.append(("GET", "/v1/stats", None))
    return attacks


def _interleave(first: list[Call], second: list[Call]) -> list[tuple[str, Call]]:
    out: list[tuple[str, Call]] = []
    for i in range(max(len(first), len(second))):
        out += [("alice", c) for c in first[i : i + 1]]
        out += [("bob", c) for c in second[2 * i : 2 * i + 2]]
    return out


def _http(url: str, tenant: str, call: Call) -> tuple[int, Any]:
    method, path, body = call
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
    return response.status_code, response.json()


def _in_process(service: IndexService, tenant: str, call: Call) -> tuple[int, Any]:
    """The same call on an in-process twin (the answers the HTTP layer would encode)."""
    method, path, body = call
    assert body is not None
    if path == "/v1/plan":
        plan = service.plan(_request(body), caller=tenant)
        return 200, json.loads(json.dumps(PlanResponse.encode(plan)))
    if path == "/v1/plan_batch":
        batch = service.plan_batch([_request(r) for r in body["requests"]], caller=tenant)
        return 200, json.loads(json.dumps(BatchPlanResponse.encode(batch)))
    if path == "/v1/usage":
        indexed = service.record_usage(
            body["rid"], body["prompt_tokens"], body["cached_tokens"], caller=tenant
        )
        return 200, {"indexed": indexed}
    if path == "/v1/evict":
        return 200, {"evicted": service.evict(body["rid"], caller=tenant)}
    if path == "/v1/conversations/forget":
        forgotten = service.forget_conversation(
            body.get("tenant", ""), body["conversation_id"], caller=tenant
        )
        return 200, {"forgotten": forgotten}
    raise AssertionError(path)


def _request(body: dict[str, Any]) -> PlanRequest:
    scope = body.get("scope", {})
    return PlanRequest(
        body["query"],
        body["blocks"],
        body.get("rid"),
        Scope(scope.get("conversation_id"), scope.get("tenant", ""), scope.get("turn")),
    )


def _own_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {key: stats[key] for key in ("index", "conversations", "usage", "totals")}


def test_a_hostile_tenant_reaches_nothing_of_another(server_factory, key_file) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--api-keys", str(key_file))
    url = server.base_url
    documents = [blocks_of(n, shared=0, own=3) for n in range(4)]
    # Without a key (or with a wrong one) every endpoint but /health answers 401.
    for method, path, body in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer not-a-key"}):
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, response.text)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/docs").status_code == 404

    tenancy = IndexService(ServiceConfig(tenants=read_key_file(key_file))).tenancy
    alice_script = _alice_script(documents)
    bob_script = _bob_attacks(lambda rid: f"{tenancy.rid_tag('alice')}.{rid}", documents)
    answers: dict[str, list[tuple[int, Any]]] = {"alice": [], "bob": []}
    for tenant, call in _interleave(alice_script, bob_script):
        answers[tenant].append(_http(url, tenant, call))

    effects = 0
    # Alice's answers are those of a service where bob did nothing, and bob's those of one
    # where alice did nothing (plans, placements, order, matched prefixes, turns, salts).
    for tenant, script in (("alice", alice_script), ("bob", bob_script)):
        twin = IndexService(ServiceConfig(tenants=read_key_file(key_file)))
        for call, (status, answer) in zip(script, answers[tenant]):
            if call[1] in ("/v1/snapshot", "/v1/stats"):
                continue
            if status == 403:  # refused: naming another tenant
                assert "is not the tenant of this API key" in answer["message"], answer
                continue
            effects += (status, answer) != _in_process(twin, tenant, call)
        server_stats = _http(url, tenant, ("GET", "/v1/stats", None))[1]
        effects += _own_stats(server_stats) != _own_stats(twin.stats(caller=tenant))
        effects += _http(url, tenant, ("GET", "/v1/usage", None))[1] != twin.usage(caller=tenant)
    print(f"cross-tenant effects: {effects}")
    assert effects == 0

    # The refusals bob got, and what he saw of alice's conversation and rids.
    statuses = [status for status, _ in answers["bob"]]
    assert statuses.count(403) == 3  # plan as alice, forget as alice, batch as alice
    assert 409 not in statuses  # no rid of alice's is "already indexed" for him
    read = answers["bob"][[c[2] and c[2].get("rid") for c in bob_script].index("read")][1]
    assert read["hints"] == [] and read["scope"]["turn"] == 1 and read["scope"]["tenant"] == "bob"
    assert all(answer.get("evicted") is not True for _, answer in answers["bob"])
    assert all(answer.get("indexed") is not True for _, answer in answers["bob"])
    probes = [
        a for c, (_, a) in zip(bob_script, answers["bob"]) if c[2] and c[2].get("query") == "probe"
    ]
    assert len(probes) == 4 and all(a["matched_prefix_blocks"] == 0 for a in probes)
    salts = {a["cache_salt"] for t in answers for _, a in answers[t] if "cache_salt" in a}
    assert len(salts) == 2  # one per tenant, never shared
    # Alice's conversation survived bob's forget and injection: her last turn goes on.
    last = answers["alice"][-1][1]
    assert last["scope"]["turn"] == 4 and last["scope"]["tenant"] == "alice"


def test_the_engine_evicts_only_the_tenant_whose_rid_it_names(server_factory, key_file) -> None:  # type: ignore[no-untyped-def]
    publisher, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with KVEventPublisher(publisher, replay) as engine:
        server = server_factory(
            "--api-keys", str(key_file), "--kv-events", publisher, "--kv-events-replay", replay
        )
        url = server.base_url
        wait_for(lambda: httpx.get(f"{url}/health").json()["engine_connected"])
        plans = {tenant: _http(url, tenant, _plan("q", blocks_of(1), "same"))[1] for tenant in KEYS}
        assert plans["alice"]["rid"] != plans["bob"]["rid"]  # the engine tells them apart
        for number, tenant in enumerate(KEYS):  # each tenant's request cached by the engine
            stored = BlockStored(
                block_hashes=[100 + number], parent_block_hash=None, session_id=plans[tenant]["rid"]
            )
            engine.publish(KVEventBatch(ts=time.time(), events=[stored]))

        def mirrored() -> int:
            stats = _http(url, "alice", ("GET", "/v1/stats", None))[1]
            return int(stats["sync"]["source"]["mirror"]["blocks"])

        def indexed(tenant: str) -> bool:
            return bool(_http(url, tenant, _usage("same", 1, 0))[1]["indexed"])

        wait_for(lambda: mirrored() == 2, what="both requests cached")
        engine.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[100])]))
        wait_for(lambda: not indexed("alice"), what="alice's request evicted")
        assert indexed("bob")
