"""The service's running totals over HTTP: ``GET /v1/usage`` answers the caller tenant's own
tokens removed and engine cached tokens, per conversation, never another tenant's (two tenants
using one conversation id included), and ``/metrics`` the service-wide counters without a
name, rid or conversation in its labels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_testing import blocks_of

from contextpilot_integrations.client.schemas import UsageTotalsResponse
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
TENANTS = {"alice": TenantKeys((ALICE,)), "bob": TenantKeys((BOB,))}
AS = {"alice": {"Authorization": f"Bearer {ALICE}"}, "bob": {"Authorization": f"Bearer {BOB}"}}


@pytest.fixture(params=[False, True], ids=["partitioned", "shared"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    config = ServiceConfig(tenants=TENANTS, share_prefixes_across_tenants=request.param)
    with TestClient(create_app(config)) as test_client:
        yield test_client


def _turn(client: TestClient, tenant: str, rid: str, conversation: str = "chat") -> Any:
    body = {
        "query": "q",
        "blocks": blocks_of(1),
        "rid": rid,
        "scope": {"conversation_id": conversation},
    }
    response = client.post("/v1/plan", json=body, headers=AS[tenant])
    assert response.status_code == 200, response.text
    return response.json()


def _report(client: TestClient, tenant: str, rid: str, prompt: int, cached: int) -> None:
    body = {"rid": rid, "prompt_tokens": prompt, "cached_tokens": cached}
    response = client.post("/v1/usage", json=body, headers=AS[tenant])
    # (a turn whose every block became a hint shows none: nothing of it is indexed)
    assert response.status_code == 200, response.text


def _usage(client: TestClient, tenant: str) -> dict[str, Any]:
    response = client.get("/v1/usage", headers=AS[tenant])
    assert response.status_code == 200, response.text
    return UsageTotalsResponse.model_validate(response.json()).model_dump()


def test_each_tenant_reads_its_own_totals_only(client: TestClient) -> None:
    assert client.get("/v1/usage").status_code == 401
    plans = [_turn(client, "alice", f"a{t}") for t in range(3)]
    plans += [_turn(client, "alice", "a-other", conversation="other")]
    _report(client, "alice", "a2", 1000, 700)
    bob_plans = [_turn(client, "bob", f"b{t}") for t in range(2)]  # the same conversation id
    _report(client, "bob", "b1", 800, 100)

    removed = sum(p["dedup_figures"]["tokens_saved"] for p in plans[:3])
    bob_removed = sum(p["dedup_figures"]["tokens_saved"] for p in bob_plans)
    assert removed > bob_removed > 0

    alice = _usage(client, "alice")
    assert alice["tenant"] == "alice"
    assert alice["conversations"].keys() == {"alice"}
    assert alice["conversations"]["alice"].keys() == {"chat", "other"}
    chat = alice["conversations"]["alice"]["chat"]
    assert chat["plans"] == 3 and chat["tokens_removed"] == removed
    assert (chat["usage_reports"], chat["prompt_tokens"], chat["cached_tokens"]) == (1, 1000, 700)
    assert alice["plans"] == 4 and alice["cached_tokens"] == 700

    bob = _usage(client, "bob")
    assert bob["conversations"] == {"bob": {"chat": bob["conversations"]["bob"]["chat"]}}
    mine = bob["conversations"]["bob"]["chat"]
    assert mine["plans"] == 2 and mine["tokens_removed"] == bob_removed
    assert mine["cached_tokens"] == bob["cached_tokens"] == 100
    figures = {k: v for k, v in bob.items() if k not in ("tenant", "conversations")}
    assert figures == mine  # nothing of alice's in bob's totals

    # /v1/stats shows the same totals, the caller's own.
    stats = client.get("/v1/stats", headers=AS["bob"]).json()
    assert stats["totals"] == client.get("/v1/usage", headers=AS["bob"]).json()

    # Bob reporting usage for alice's rid reaches nothing of hers.
    body = {"rid": "a2", "prompt_tokens": 10, "cached_tokens": 5}
    assert client.post("/v1/usage", json=body, headers=AS["bob"]).json() == {"indexed": False}
    assert _usage(client, "alice") == alice


def test_metrics_count_service_wide_without_names(client: TestClient) -> None:
    plans = [_turn(client, tenant, f"{tenant}{t}") for tenant in AS for t in range(2)]
    _report(client, "alice", "alice1", 500, 300)
    _report(client, "bob", "bob1", 400, 100)
    text = client.get("/metrics", headers=AS["bob"]).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    removed = sum(p["dedup_figures"]["tokens_saved"] for p in plans)
    replaced = sum(p["dedup_figures"]["blocks_replaced"] for p in plans)
    assert removed > 0
    assert values["contextpilot_dedup_tokens_removed_total"] == removed
    assert values["contextpilot_dedup_blocks_replaced_total"] == replaced
    assert values["contextpilot_dedup_sub_blocks_replaced_total"] == 0
    assert values["contextpilot_usage_cached_tokens_total"] == 400
    for secret in ("alice", "bob", "chat", ALICE, BOB):
        assert secret not in text


def test_without_keys_the_totals_have_no_tenant() -> None:
    with TestClient(create_app(ServiceConfig())) as client:
        for tenant in ("x", "y"):
            body = {
                "query": "q",
                "blocks": blocks_of(1),
                "scope": {"conversation_id": "c", "tenant": tenant},
            }
            for _ in range(2):
                assert client.post("/v1/plan", json=body).status_code == 200
        usage = UsageTotalsResponse.model_validate(client.get("/v1/usage").json())
    assert usage.tenant is None and usage.plans == 4
    assert usage.conversations.keys() == {"x", "y"}
    assert usage.conversations["x"]["c"].plans == usage.conversations["y"]["c"].plans == 2
    assert (
        usage.tokens_removed == sum(c["c"].tokens_removed for c in usage.conversations.values()) > 0
    )


def test_a_method_the_usage_path_does_not_serve_lists_both_it_does() -> None:
    with TestClient(create_app(ServiceConfig())) as client:
        response = client.put("/v1/usage", json={})
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, POST"
        assert client.put("/v1/stats").headers["allow"] == "GET"
