"""Tenants from credentials, in process: key files and the environment,
what each tenant gets (rid tag, cache_salt), the isolation modes, and a request's tenant taken
from its key, never from its body."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from service_testing import blocks_of

from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.llm_call.engine_fields import engine_body_fields
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.server import build_parser, config_from_args
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import (
    Tenancy,
    TenantKeys,
    TenantMismatchError,
    parse_key_list,
    read_key_file,
)

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
TENANTS = {"alice": TenantKeys((ALICE,)), "bob": TenantKeys((BOB,))}


def _key_file(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(content) if not isinstance(content, str) else content)
    path.chmod(0o600)
    return path


def test_a_key_file_and_the_environment_map_keys_to_tenants(tmp_path: Path) -> None:
    path = _key_file(
        tmp_path,
        {"tenants": {"alice": {"keys": [ALICE], "cache_salt": "salt-a"}, "bob": {"keys": [BOB]}}},
    )
    args = build_parser().parse_args(["--api-keys", str(path)])
    config = config_from_args(args, {"CONTEXTPILOT_API_KEYS": "carol=carol-key,alice=alice-2"})
    assert set(config.tenants or {}) == {"alice", "bob", "carol"}
    assert config.tenants is not None and config.tenants["alice"].keys == (ALICE, "alice-2")
    assert config.tenants["alice"].cache_salt == "salt-a"
    tenancy = config.tenancy
    assert tenancy.mode == "partitioned"
    assert [tenancy.tenant_of(k) for k in (ALICE, "alice-2", BOB, "carol-key", "nope")] == [
        "alice",
        "alice",
        "bob",
        "carol",
        None,
    ]
    # The one key shared by everyone is the tenant "".
    shared = config_from_args(build_parser().parse_args([]), {"CONTEXTPILOT_API_KEY": "old"})
    assert shared.tenancy.mode == "single" and shared.tenancy.tenant_of("old") == ""
    assert config_from_args(build_parser().parse_args([]), {}).tenancy.mode == "open"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "cannot be read as JSON"),
        ("[" * 200_000, "cannot be read as JSON"),
        ({"alice": {"keys": ["k"]}}, '{"tenants"'),
        ({"tenants": {"alice": {"keys": "k"}}}, "keys must be a list"),
        ({"tenants": {"alice": {"keys": []}}}, "keys must not be empty"),
        ({"tenants": {"alice": {"keys": [" k"]}}}, "tenants['alice']: keys[0] must be"),
        # A key goes in an HTTP header: printable ASCII without whitespace only.
        ({"tenants": {"alice": {"keys": ["k1", "clé-secrète"]}}}, "keys[1] must be"),
        ({"tenants": {"alice": {"keys": ["two words"]}}}, "printable ASCII characters without"),
        ({"tenants": {"alice": {"keys": ["tab\tkey"]}}}, "printable ASCII characters without"),
        # JSON keeps the last of two equal names: the first entry's keys would stop working.
        (
            '{"tenants": {"alice": {"keys": ["first-key"]}, "alice": {"keys": ["second-key"]}}}',
            "tenant 'alice' is named twice",
        ),
        (
            '{"tenants": {"alice": {"keys": ["first-key"], "keys": ["second-key"]}}}',
            "tenants['alice'] gives the field 'keys' twice",
        ),
        ('{"tenants": {}, "tenants": {"alice": {"keys": ["k"]}}}', "field 'tenants' is given"),
        ({"tenants": {"alice": {"keys": ["k"], "colour": 1}}}, "unknown fields ['colour']"),
        ({"tenants": {"": {"keys": ["k"]}}}, "tenant name must be a str of 1.."),
        ({"tenants": {"alice": {"keys": ["k"], "cache_salt": ""}}}, "cache_salt"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_fault_never_a_key(
    tmp_path: Path, content: object, words: str
) -> None:
    with pytest.raises(ValueError) as raised:
        read_key_file(_key_file(tmp_path, content))
    assert words in str(raised.value)
    assert "keys.json" in str(raised.value)
    for secret in ("clé-secrète", "two words", "first-key", "second-key"):
        assert secret not in str(raised.value)  # never a key


def test_the_environment_list_and_the_tenancy_refuse_ambiguous_keys() -> None:
    assert parse_key_list(" alice = a1 , bob=b1,, alice=a2 ") == {
        "alice": TenantKeys(("a1", "a2")),
        "bob": TenantKeys(("b1",)),
    }
    with pytest.raises(ValueError, match="entry 1 must be name=key"):
        parse_key_list("alice=a1,bob")
    with pytest.raises(ValueError, match=r"tenant 'bob': keys\[0\] must be .* ASCII") as raised:
        parse_key_list("alice=a1,bob=böb-key")
    assert "böb-key" not in str(raised.value)
    with pytest.raises(ValueError, match="also a key of tenant 'alice'"):
        Tenancy({"alice": TenantKeys(("same",)), "bob": TenantKeys(("same",))})
    with pytest.raises(ValueError, match="the same cache_salt"):
        Tenancy({"alice": TenantKeys(("a",), "s"), "bob": TenantKeys(("b",), "s")})
    with pytest.raises(ValueError, match="prefixes are shared"):
        Tenancy({"alice": TenantKeys(("a",), "s")}, share_prefixes=True)
    with pytest.raises(ValueError, match="needs tenant keys"):
        Tenancy({}, share_prefixes=True)


def test_a_key_file_readable_by_others_is_warned_about(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    path = _key_file(tmp_path, {"tenants": {"alice": {"keys": [ALICE]}}})
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        read_key_file(path)
    assert "readable by other users" in caplog.text and ALICE not in caplog.text


def test_salts_and_rid_tags_are_secret_stable_and_distinct() -> None:
    tenancy = Tenancy(TENANTS)
    again = Tenancy(dict(TENANTS))  # a restart with the same keys
    assert tenancy.cache_salt("alice") == again.cache_salt("alice")
    assert tenancy.rid_tag("alice") == again.rid_tag("alice")
    assert tenancy.cache_salt("alice") != tenancy.cache_salt("bob")
    assert tenancy.rid_tag("alice") != tenancy.rid_tag("bob")
    # Derived from the key (not guessable from the name): another key, another salt and tag.
    other = Tenancy({"alice": TenantKeys(("another-key",)), "bob": TENANTS["bob"]})
    assert other.cache_salt("alice") != tenancy.cache_salt("alice")
    assert other.rid_tag("alice") != tenancy.rid_tag("alice")
    # A key file's cache_salt is used as given, and survives key rotation (the tag too).
    pinned = Tenancy({"alice": TenantKeys(("k1",), "pinned"), "bob": TENANTS["bob"]})
    rotated = Tenancy({"alice": TenantKeys(("k2",), "pinned"), "bob": TENANTS["bob"]})
    assert pinned.cache_salt("alice") == rotated.cache_salt("alice") == "pinned"
    assert pinned.rid_tag("alice") == rotated.rid_tag("alice")
    shared = Tenancy(TENANTS, share_prefixes=True)
    assert shared.mode == "shared" and shared.cache_salt("alice") is None
    assert shared.rid_tag("alice") == tenancy.rid_tag("alice")


def _service(**settings: object) -> IndexService:
    return IndexService(ServiceConfig(tenants=TENANTS, **settings))  # type: ignore[arg-type]


def test_the_tenant_comes_from_the_caller_never_from_the_body() -> None:
    service = _service()
    plan = service.plan(PlanRequest("q", blocks_of(1), "r1", Scope("c")), caller="alice")
    assert plan.scope.tenant == "alice"
    assert plan.rid == f"{service.tenancy.rid_tag('alice')}.r1"  # the engine-facing rid
    assert plan.cache_salt == service.tenancy.cache_salt("alice")
    assert engine_body_fields(plan)["cache_salt"] == plan.cache_salt
    assert service.plan(PlanRequest("q", ["x"], scope=Scope("c", "alice")), caller="alice")
    with pytest.raises(TenantMismatchError, match=r"scope\.tenant 'bob' is not the tenant"):
        service.plan(PlanRequest("q", ["x"], "r2", Scope("c", "bob")), caller="alice")
    with pytest.raises(TenantMismatchError, match=r"requests\[1\]\.scope\.tenant 'bob'"):
        service.plan_batch(
            [PlanRequest("q", ["x"]), PlanRequest("q", ["y"], scope=Scope("d", "bob"))],
            caller="alice",
        )
    with pytest.raises(TenantMismatchError, match="tenant 'bob' is not the tenant"):
        service.forget_conversation("bob", "c", caller="alice")
    with pytest.raises(TenantMismatchError, match="not a tenant of this service"):
        service.plan(PlanRequest("q", ["x"]), caller=None)
    with pytest.raises(TenantMismatchError, match="not a tenant of this service"):
        service.plan(PlanRequest("q", ["x"]), caller="mallory")
    # Nothing of the refused calls was recorded for bob (nor for alice beyond her two plans).
    assert service.stats(caller="bob")["requests"] == 0
    assert service.stats(caller="bob")["conversations"]["conversations"] == 0
    assert service.stats(caller="alice")["requests"] == 2


def test_rids_are_resolved_within_the_callers_tenant() -> None:
    service = _service()
    alice = service.plan(PlanRequest("q", blocks_of(1), "same"), caller="alice")
    bob = service.plan(PlanRequest("q", blocks_of(2), "same"), caller="bob")  # no 409
    assert alice.rid != bob.rid
    assert service.record_usage(bob.rid, 100, 50, caller="alice") is False  # no probe
    assert service.evict(bob.rid, caller="alice") is False
    assert service.evict("same", caller="alice") is True  # alice's own, by her rid ...
    assert service.evict(bob.rid, caller="bob") is True  # ... or by the plan's rid
    assert service.stats(caller="bob")["usage"]["reports"] == 0
    assert service.stats(caller="alice")["service"]["evictions"] == {"api": 1}
    long_rid = "r" * 500
    with pytest.raises(ValueError, match="rid is longer than 499 characters"):
        service.plan(PlanRequest("q", ["x"], long_rid), caller="alice")
    assert service.evict(long_rid, caller="alice") is False  # a look-up only misses


def test_partitions_share_nothing_and_the_shared_mode_shares_the_index() -> None:
    partitioned = _service()
    assert partitioned.pilot_of("alice") is not partitioned.pilot_of("bob")
    secret = blocks_of(7)
    partitioned.plan(PlanRequest("q", secret), caller="bob")
    probe = partitioned.plan(PlanRequest("q", secret), caller="alice")
    assert probe.matched_prefix_blocks == 0  # bob's documents leave no trace for alice

    shared = _service(share_prefixes_across_tenants=True)
    assert shared.pilot_of("alice") is shared.pilot_of("bob")
    shared.plan(PlanRequest("q", secret, "r", Scope("c")), caller="bob")
    probe = shared.plan(PlanRequest("q", secret, "r", Scope("c")), caller="alice")
    assert probe.matched_prefix_blocks == len(secret)  # the documented side channel
    assert probe.cache_salt is None and probe.scope.turn == 1  # conversations stay apart
    assert not probe.hints


def test_the_api_documents_need_a_key_when_keys_are_configured() -> None:
    keyed = TestClient(create_app(ServiceConfig(tenants=TENANTS)))
    with keyed:
        assert keyed.get("/openapi.json").status_code == 401
        wrong = keyed.get("/openapi.json", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        schema = keyed.get("/openapi.json", headers={"Authorization": f"Bearer {ALICE}"})
        assert schema.status_code == 200 and "/v1/plan" in schema.json()["paths"]
        for page in ("/docs", "/redoc"):
            assert keyed.get(page, headers={"Authorization": f"Bearer {ALICE}"}).status_code == 404
        assert keyed.get("/health").status_code == 200
    with TestClient(create_app(ServiceConfig())) as open_app:
        assert open_app.get("/openapi.json").status_code == 200
        assert open_app.get("/docs").status_code == 200


def test_over_http_the_key_decides_and_another_tenant_is_a_403() -> None:
    with TestClient(create_app(ServiceConfig(tenants=TENANTS))) as client:
        as_alice = {"Authorization": f"Bearer {ALICE}"}
        body = {"query": "q", "blocks": ["x"], "scope": {"conversation_id": "c", "tenant": "bob"}}
        refused = client.post("/v1/plan", json=body, headers=as_alice)
        assert refused.status_code == 403
        assert refused.json()["error_type"] == "TenantMismatchError"
        assert "scope.tenant 'bob'" in refused.json()["message"]
        forget = client.post(
            "/v1/conversations/forget",
            json={"conversation_id": "c", "tenant": "bob"},
            headers=as_alice,
        )
        assert forget.status_code == 403
        body["scope"] = {"conversation_id": "c"}
        plan = client.post("/v1/plan", json=body, headers=as_alice).json()
        assert plan["scope"]["tenant"] == "alice" and plan["cache_salt"]
        assert client.post("/v1/plan", json=body).status_code == 401
        assert client.get("/v1/stats", headers=as_alice).json()["service"]["isolation"] == (
            "partitioned"
        )
