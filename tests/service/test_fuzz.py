"""Fuzz of every endpoint from the service's own OpenAPI document (schemathesis), with
authentication on: two tenants, the fuzz sends alice's key.

Valid and invalid bodies, headers and methods are generated from the schema; every response
must be a declared status with a body that matches its declared model (never a 5xx), invalid
input must be refused with a 4xx whose ``message`` names what is wrong, and the requests and
conversations planned before the fuzz are still there after it, bob's unchanged (no state lost,
none crossed tenants).
"""

from __future__ import annotations

import os
import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys

API_KEY = "fuzz-secret-of-alice"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

app = create_app(
    ServiceConfig(
        tenants={"alice": TenantKeys((API_KEY,)), "bob": TenantKeys(("fuzz-secret-of-bob",))}
    )
)
service = app.state.service

# State planned before the fuzz, by both tenants; the last test checks it survived.
SEEDED_RIDS = [f"seed-{uuid.uuid4().hex}" for _ in range(3)]
SEEDED_CONVERSATION = f"seed-conversation-{uuid.uuid4().hex}"
SEEDED: dict[str, list[str]] = {"alice": [], "bob": []}
for tenant in SEEDED:
    for number, seeded_rid in enumerate(SEEDED_RIDS):
        plan = service.plan(
            PlanRequest(
                f"question {number}",
                [f"shared block of the seeded requests {i}" for i in range(4)]
                + [f"own block {number}"],
                seeded_rid,
                Scope(SEEDED_CONVERSATION if number == 0 else None),
            ),
            caller=tenant,
        )
        SEEDED[tenant].append(plan.rid)
BOB_BEFORE = service.stats(caller="bob")

schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
# CONTEXTPILOT_FUZZ_EXAMPLES=400 for a longer run (400 per operation passed when written).
EXAMPLES = int(os.environ.get("CONTEXTPILOT_FUZZ_EXAMPLES", "60"))
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES
)


# Rules JSON Schema cannot state (a field that needs another, uniqueness across array items,
# one field bounded by another): the core's checks. Schema-valid bodies may break them and get
# a 422 with the core's message naming the rule.
# With tenant keys, a schema-valid body may also name another tenant than the key's (a 403
# naming the field) or give a rid too long once the tenant's tag is put before it.
NEEDS_A_CONVERSATION = "needs a scope.conversation_id"
ANOTHER_TENANT = "is not the tenant of this API key"
TAGGED_RID = "the service puts the tenant's 13-character tag before it"  # rids over 499 chars
SEMANTIC_RULES = {
    "POST /v1/plan": (NEEDS_A_CONVERSATION, ANOTHER_TENANT, TAGGED_RID),
    "POST /v1/plan_batch": (
        NEEDS_A_CONVERSATION,
        ANOTHER_TENANT,
        TAGGED_RID,
        "rids must be unique within a batch",
        "are turns of the same conversation",
    ),
    "POST /v1/usage": ("need 0 <= cached_tokens",),  # (+ cache_write_tokens) <= prompt_tokens
    "POST /v1/conversations/forget": (ANOTHER_TENANT,),
}


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_endpoint_fuzz_never_fails_and_explains_refusals(case: schemathesis.Case) -> None:
    rules = SEMANTIC_RULES.get(case.operation.label)
    excluded = [schemathesis.checks.positive_data_acceptance] if rules else []
    response = case.call_and_validate(headers=AUTH, excluded_checks=excluded)
    assert response.status_code < 500, response.text
    if rules and response.status_code == 422 and "body" not in response.json()["message"]:
        # Not a schema error: it must be one of the operation's own rules.
        assert any(rule in response.json()["message"] for rule in rules), response.text
    if response.status_code == 403:
        assert ANOTHER_TENANT in response.json()["message"], response.text
        assert "tenant" in response.json()["message"], response.text
    if 400 <= response.status_code < 500:
        body = response.json()
        assert isinstance(body.get("message"), str) and body["message"], response.text
        assert body.get("error_type"), response.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_fuzzed_app_refuses_requests_without_the_key(headers: dict[str, str]) -> None:
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        response = client.post("/v1/plan", json={"query": "q", "blocks": ["b"]}, headers=headers)
    assert response.status_code == 401
    assert "API key" in response.json()["message"]


def test_fuzzed_app_serves_no_api_documents_without_a_key() -> None:
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/openapi.json").status_code == 401
        assert client.get("/openapi.json", headers=AUTH).json()["paths"]
        assert client.get("/docs", headers=AUTH).status_code == 404  # a browser sends no key
        assert client.get("/redoc", headers=AUTH).status_code == 404
        assert client.get("/health").status_code == 200


def test_state_planned_before_the_fuzz_is_still_there() -> None:
    for tenant, rids in SEEDED.items():
        pilot = service.pilot_of(tenant)
        assert all(rid in pilot.index for rid in rids), tenant
        assert (tenant, SEEDED_CONVERSATION) in pilot.deduplicator.store
    bob = service.stats(caller="bob")
    for section in ("index", "conversations", "usage"):
        assert bob[section] == BOB_BEFORE[section], section  # alice's fuzz never reached bob
