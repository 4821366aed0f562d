"""The app in process (ASGI, no network): the wire format, error bodies, body limits, metrics,
health, the layout, the snapshot endpoint, apps that share nothing, and the service object's
own checks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from service_testing import blocks_of, saved_requests

from contextpilot_integrations.core.conversations.turns import MAX_TURN
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    config = ServiceConfig(
        snapshot_path=tmp_path / "index.json",
        max_body_bytes=20_000,
        layout=PromptLayout(system_prompt="Custom system prompt."),
    )
    with TestClient(create_app(config)) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"query": "q", "blocks": ["a", 5]}, "body.blocks[1]", "valid string"),
        ({"query": "q"}, "body.blocks", "Field required"),
        (
            {"query": "q", "blocks": [], "scope": {"conversation_id": "c", "turn": -2}},
            "body.scope.turn",
            "greater than or equal to 0",
        ),
        (
            {"query": "q", "blocks": [], "scope": {"conversation_id": "c", "turn": MAX_TURN + 1}},
            "body.scope.turn",
            "less than or equal to",
        ),
        (
            {"query": "q", "blocks": [], "scope": {"conversation_id": "c", "turn": True}},
            "body.scope.turn",
            "valid integer",
        ),
        ({"query": "q", "blocks": [], "rid": ""}, "body.rid", "at least 1 character"),
        ({"query": "q", "blocks": [], "rid": "r" * 513}, "body.rid", "at most 512 characters"),
        ({"query": "q", "blocks": [], "colour": "red"}, "body.colour", "Extra inputs"),
        # The scope travels as one value: the old flat keywords are refused.
        ({"query": "q", "blocks": [], "conversation_id": "c"}, "body.conversation_id", "Extra"),
        (
            {"query": "q", "blocks": [], "scope": {"conversation_id": "c", "colour": 1}},
            "body.scope.colour",
            "Extra inputs",
        ),
        (
            {
                "query": "q",
                "blocks": [],
                "scope": {"conversation_id": "c", "visibility": {"last": 1, "turns": [1]}},
            },
            "body.scope.visibility",
            "",
        ),
        # JSON with a lone surrogate escape is refused by the parser itself.
        ({"query": "q\ud800", "blocks": []}, "body", "invalid JSON"),
    ],
)
def test_invalid_plans_get_a_422_naming_the_field_and_value(client, body, field, words) -> None:  # type: ignore[no-untyped-def]
    raw = json.dumps(body).encode()  # json.dumps keeps a lone surrogate as \\ud800
    response = client.post("/v1/plan", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    error = response.json()
    assert error["message"].startswith(field) and words in error["message"], error
    assert error["error_type"] == "ValueError"
    assert error["fields"][0]["field"].startswith(field)
    assert client.get("/v1/stats").json()["inserts"] == 0


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        (
            "/v1/plan",
            {"query": "q", "blocks": ["a"], "scope": {"turn": 3}},
            "scope.turn=3 needs a scope.conversation_id",
        ),
        (
            "/v1/plan",
            {"query": "q", "blocks": ["a"], "scope": {"visibility": {"last": 1}}},
            "needs a scope.conversation_id",
        ),
        (
            "/v1/plan_batch",
            {"requests": [{"query": "a", "blocks": ["x"], "rid": "s"}] * 2},
            "rids must be unique within a batch",
        ),
        (
            "/v1/plan_batch",
            {"requests": [{"query": "a", "blocks": ["x"], "scope": {"conversation_id": "k"}}] * 2},
            "are turns of the same conversation 'k'",
        ),
        ("/v1/usage", {"rid": "r", "prompt_tokens": 10, "cached_tokens": 11}, "cached_tokens"),
    ],
)
def test_rules_across_fields_are_the_cores_and_get_its_message(client, path, body, words) -> None:  # type: ignore[no-untyped-def]
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert words in error["message"] and error["error_type"] == "ValueError", error
    stats = client.get("/v1/stats").json()
    assert stats["inserts"] == 0 and stats["conversations"]["conversations"] == 0
    assert stats["usage"]["reports"] == 0


def test_the_wire_format_is_the_core_request_and_plan(client) -> None:  # type: ignore[no-untyped-def]
    texts = ["a first block", "", "a second block", "a first block", " \t\n"]
    body = {
        "query": "q",
        "blocks": texts,
        "rid": "wire",
        "scope": {"conversation_id": "c", "tenant": "t", "turn": 4, "visibility": {"last": 2}},
    }
    plan = client.post("/v1/plan", json=body).json()
    assert plan["rid"] == "wire"
    assert plan["scope"] == {
        "conversation_id": "c",
        "tenant": "t",
        "turn": 4,
        "visibility": {"last": 2},
    }
    # Every input has its placement, empty and whitespace-only ones skipped (not refused).
    statuses = {p["index"]: p["status"] for p in plan["placements"]}
    assert statuses == {0: "shown", 1: "skipped", 2: "shown", 3: "duplicate", 4: "skipped"}
    duplicate = plan["placements"][3]
    assert (
        duplicate["duplicate_of"] == 0
        and duplicate["block_id"] == plan["placements"][0]["block_id"]
    )
    assert int(plan["placements"][0]["block_id"]) >= 0  # a decimal string
    assert plan["placements"][1]["block_id"] is None
    assert plan["dedup_figures"]["blocks_kept"] == 2
    assert plan["segments"][0] == "Custom system prompt.\n"


def test_two_apps_in_one_process_share_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = TestClient(create_app(ServiceConfig(api_key="one")))
    second = TestClient(create_app(ServiceConfig()))
    with first, second:
        headers = {"Authorization": "Bearer one"}
        body = {"query": "q", "blocks": blocks_of(1), "rid": "only-in-the-first"}
        assert first.post("/v1/plan", json=body, headers=headers).status_code == 200
        assert second.post("/v1/plan", json=body).status_code == 200  # not a conflict
        assert (
            second.post("/v1/plan", json={"query": "q", "blocks": blocks_of(2)}).status_code == 200
        )
        assert first.get("/v1/stats", headers=headers).json()["requests"] == 1
        assert second.get("/v1/stats").json()["requests"] == 2
        assert first.get("/v1/stats").status_code == 401 and second.get("/health").status_code
        assert (
            'contextpilot_plans_total{kind="single"} 1.0'
            in first.get("/metrics", headers=headers).text
        )


def test_malformed_json_and_oversized_bodies_are_refused(client) -> None:  # type: ignore[no-untyped-def]
    bad = client.post(
        "/v1/plan",
        content=b'{"query": "q", "blocks": [',
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 422 and "invalid JSON" in bad.json()["message"]
    not_utf8 = client.post(
        "/v1/plan", content=b'{"query": "\xff"}', headers={"content-type": "application/json"}
    )
    assert not_utf8.status_code == 422 and not_utf8.json()["message"].startswith("body")
    big = {"query": "q", "blocks": ["x" * 30_000]}
    declared = client.post("/v1/plan", json=big)
    assert declared.status_code == 413 and "20000 bytes" in declared.json()["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as it streams
        yield json.dumps(big).encode()[:15_000]
        yield json.dumps(big).encode()[15_000:]

    streamed = client.post(
        "/v1/plan_batch", content=chunks(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413 and "limit" in streamed.json()["message"]
    unknown = client.get("/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "HTTPError"
    wrong_method = client.get("/v1/plan")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


def test_metrics_count_requests_evictions_and_index_size(client) -> None:  # type: ignore[no-untyped-def]
    for number in range(3):
        assert (
            client.post(
                "/v1/plan", json={"query": "q", "blocks": blocks_of(number), "rid": f"m{number}"}
            ).status_code
            == 200
        )
    assert client.post("/v1/plan", json={"query": 1, "blocks": []}).status_code == 422
    assert client.post("/v1/evict", json={"rid": "m1"}).json() == {"evicted": True}
    assert client.post(
        "/v1/usage", json={"rid": "m0", "prompt_tokens": 100, "cached_tokens": 40}
    ).json() == {"indexed": True}
    text = client.get("/metrics").text
    for line in (
        'contextpilot_http_requests_total{endpoint="/v1/plan",status="200"} 3.0',
        'contextpilot_http_requests_total{endpoint="/v1/plan",status="422"} 1.0',
        'contextpilot_plans_total{kind="single"} 3.0',
        'contextpilot_evictions_total{source="api"} 1.0',
        "contextpilot_index_requests 2.0",
        "contextpilot_index_evictions_total 1.0",
        "contextpilot_usage_prompt_tokens_total 100.0",
        "contextpilot_usage_cached_tokens_total 40.0",
        "contextpilot_conversations 0.0",
    ):
        assert line in text, line
    assert 'contextpilot_http_request_duration_seconds_count{endpoint="/v1/plan"} 4.0' in text


def test_health_layout_and_snapshot_endpoints(client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["cache_model"] == "none"
    assert health["engine_connected"] is None and health["resync_pending"] is False
    layout = client.get("/v1/layout").json()
    assert (
        layout["system_prompt"] == "Custom system prompt."
        and layout["label_template"] == "[Doc {position}]"
        and layout["turn_header"] == PromptLayout().turn_header
    )
    plan = client.post("/v1/plan", json={"query": "q", "blocks": blocks_of(0)}).json()
    assert plan["segments"][0] == "Custom system prompt.\n"
    assert client.post("/v1/snapshot").json() == {"saved": True}
    assert [entry["rid"] for entry in saved_requests(tmp_path / "index.json")] == [plan["rid"]]


def test_after_the_largest_turn_an_unnumbered_turn_is_refused_naming_what_was_sent(client) -> None:  # type: ignore[no-untyped-def]
    scope = {"conversation_id": "long chat", "turn": MAX_TURN}
    assert (
        client.post("/v1/plan", json={"query": "q", "blocks": ["a"], "scope": scope}).json()[
            "scope"
        ]["turn"]
        == MAX_TURN
    )
    body = {"query": "q", "blocks": ["b"], "scope": {"conversation_id": "long chat"}}
    refused = client.post("/v1/plan", json=body)
    assert refused.status_code == 422
    message = refused.json()["message"]
    assert "'long chat' is at turn 2147483647" in message and str(MAX_TURN + 1) not in message


def test_a_batch_with_some_rids_gets_new_ones_for_the_rest(client) -> None:  # type: ignore[no-untyped-def]
    body = {
        "requests": [
            {"query": "a", "blocks": blocks_of(1), "rid": "given"},
            {"query": "b", "blocks": blocks_of(2)},
        ]
    }
    plans = client.post("/v1/plan_batch", json=body).json()["plans"]
    assert plans[0]["rid"] == "given" and plans[1]["rid"].startswith("cp-")
    again = client.post("/v1/plan_batch", json=body)
    assert again.status_code == 409 and "already indexed" in again.json()["message"]
    assert again.json()["error_type"] == "RidConflictError"


def test_service_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_requests"):
        ServiceConfig(max_requests=0)
    with pytest.raises(ValueError, match="api_key"):
        ServiceConfig(api_key="")
    with pytest.raises(ValueError, match="capacity_tokens"):
        IndexService(ServiceConfig(cache_sync={"kind": "capacity"}))
    with pytest.raises(ValueError, match="unknown|colour"):
        ServiceConfig(cache_sync={"kind": "ttl", "ttl_s": 5, "colour": 1})
    with pytest.raises(ValueError, match="engine_grace_s"):  # part of the engine link's mapping
        ServiceConfig(
            cache_sync={"kind": "kv-events", "endpoint": "tcp://h:1", "engine_grace_s": 0}
        )
    with pytest.raises(TypeError, match="engine_grace_s"):
        ServiceConfig(engine_grace_s=1.0)  # type: ignore[call-arg]


def test_the_service_object_plans_without_http() -> None:
    service = IndexService(
        ServiceConfig(cache_sync={"kind": "capacity", "capacity_tokens": 10_000})
    )
    service.start()
    try:
        plans = [service.plan(PlanRequest(f"q{i}", blocks_of(i), f"x{i}")) for i in range(40)]
        stats = service.stats()
    finally:
        service.stop()
    # The capacity model keeps the index within the engine's token budget.
    assert stats["sync"]["source"]["used_tokens"] <= 10_000
    assert stats["requests"] == stats["sync"]["source"]["requests"] < 40
    index = service.pilot_of().index
    assert plans[-1].rid in index and plans[0].rid not in index
    # The capacity model's evictions are the engine link's, counted by cause.
    assert stats["sync"]["evictions"] == {"capacity": 40 - stats["requests"]}
