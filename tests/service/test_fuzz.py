"""Fuzz of every endpoint from the service's own OpenAPI document (schemathesis).

Valid and invalid bodies, headers and methods are generated from the schema; every response
must be a declared status with a body that matches its declared model (never a 5xx), invalid
input must be refused with a 4xx whose ``message`` names what is wrong, and requests planned
before the fuzz are still indexed after it (no state lost).
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
from contextpilot_integrations.service.index_service import ServiceConfig

API_KEY = "fuzz-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

app = create_app(ServiceConfig(api_key=API_KEY))
service = app.state.service

# State planned before the fuzz; the last test checks it survived.
SEEDED_RIDS = [f"seed-{uuid.uuid4().hex}" for _ in range(3)]
SEEDED_CONVERSATION = f"seed-conversation-{uuid.uuid4().hex}"
for number, seeded_rid in enumerate(SEEDED_RIDS):
    service.plan(
        PlanRequest(
            f"question {number}",
            [f"shared block of the seeded requests {i}" for i in range(4)]
            + [f"own block {number}"],
            seeded_rid,
            Scope(SEEDED_CONVERSATION if number == 0 else None, "seed-tenant"),
        )
    )

schema = schemathesis.openapi.from_asgi("/openapi.json", app)
# CONTEXTPILOT_FUZZ_EXAMPLES=400 for a longer run (400 per operation passed when written).
EXAMPLES = int(os.environ.get("CONTEXTPILOT_FUZZ_EXAMPLES", "60"))
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES
)


# Rules JSON Schema cannot state (a field that needs another, uniqueness across array items,
# one field bounded by another): the core's checks. Schema-valid bodies may break them and get
# a 422 with the core's message naming the rule.
NEEDS_A_CONVERSATION = "needs a scope.conversation_id"
SEMANTIC_RULES = {
    "POST /v1/plan": (NEEDS_A_CONVERSATION,),
    "POST /v1/plan_batch": (
        NEEDS_A_CONVERSATION,
        "rids must be unique within a batch",
        "are turns of the same conversation",
    ),
    "POST /v1/usage": ("need 0 <= cached_tokens <= prompt_tokens",),
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


def test_state_planned_before_the_fuzz_is_still_there() -> None:
    for seeded_rid in SEEDED_RIDS:
        assert seeded_rid in service.pilot.index
    assert ("seed-tenant", SEEDED_CONVERSATION) in service.pilot.deduplicator.store
