"""The ``contextpilot-server`` command line: options wired to the service configuration, and
inconsistent options refused with a message naming them; a key source that holds no key stops
the server rather than leave it open."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_testing import free_port

from contextpilot_integrations.service import server as server_module
from contextpilot_integrations.service.server import (
    FreezeSurvivors,
    build_parser,
    config_from_args,
    main,
)
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.sync.configuration import CacheSyncConfig


def _config(argv: list[str], environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(argv), environ or {})


def test_kv_events_options_build_the_event_source_config() -> None:
    config = _config(
        [
            "--kv-events", "tcp://127.0.0.1:5557",
            "--kv-events-replay", "tcp://127.0.0.1:5558",
            "--kv-events-topic", "kv-events",
            "--dp-size", "2",
            "--max-requests", "500",
        ]
    )  # fmt: skip
    assert isinstance(config.cache_sync, CacheSyncConfig)
    assert config.cache_sync.kind == "kv-events"
    assert config.cache_sync.endpoint == "tcp://127.0.0.1:5557"
    assert config.cache_sync.replay_endpoint == "tcp://127.0.0.1:5558"
    assert (config.cache_sync.topic, config.cache_sync.dp_size) == ("kv-events", 2)
    assert config.max_requests == 500 and config.api_key is None
    assert config.cache_sync.engine_grace_s == CacheSyncConfig(kind="kv-events").engine_grace_s
    grace = _config(["--kv-events", "tcp://127.0.0.1:5557", "--engine-grace", "0.3"])
    assert grace.cache_sync.engine_grace_s == 0.3  # the engine link's setting


def test_capacity_ttl_and_no_model() -> None:
    capacity = _config(["--cache-model", "capacity", "--capacity-tokens", "200000"]).cache_sync
    assert (capacity.kind, capacity.capacity_tokens) == ("capacity", 200_000)
    ttl = _config(["--cache-model", "ttl", "--ttl-provider", "anthropic"]).cache_sync
    assert (ttl.kind, ttl.provider) == ("ttl", "anthropic")
    assert _config([]).cache_sync is None


def test_api_key_from_the_environment_or_the_flag() -> None:
    assert _config([], {"CONTEXTPILOT_API_KEY": "from-env"}).api_key == "from-env"
    assert _config(["--api-key", "flag"], {"CONTEXTPILOT_API_KEY": "env"}).api_key == "flag"


def test_tenant_keys_sharing_and_the_shutdown_timeout(tmp_path: Path) -> None:
    environ = {"CONTEXTPILOT_API_KEYS": "alice=k1,bob=k2"}
    config = _config(["--shutdown-timeout", "3"], environ)
    assert config.tenancy.mode == "partitioned" and config.shutdown_timeout_s == 3.0
    shared = _config(["--share-prefixes-across-tenants"], environ)
    assert shared.tenancy.mode == "shared" and shared.tenancy.cache_salt("alice") is None


def test_layout_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"system_prompt": "Be brief."}))
    assert _config(["--layout", str(path)]).layout.system_prompt == "Be brief."
    path.write_text(json.dumps({"block_template": "{text}"}))
    with pytest.raises(ValueError, match="--layout .*block_template must contain"):
        _config(["--layout", str(path)])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--cache-model", "events"], "--cache-model events needs --kv-events"),
        (["--cache-model", "capacity"], "--cache-model capacity needs --capacity-tokens N"),
        (["--cache-model", "ttl"], "--cache-model ttl needs --ttl-provider or --ttl-seconds"),
        (
            ["--cache-model", "capacity", "--capacity-tokens", "5", "--kv-events", "tcp://h:1"],
            "--kv-events options",
        ),
        (["--engine-grace", "2"], "--engine-grace need --cache-model events"),
        (["--kv-events-topic", "kv"], "--dp-size and --engine-grace need --cache-model events"),
        (["--ttl-seconds", "60"], "--ttl-seconds needs --cache-model ttl, got None"),
        (["--capacity-tokens", "1000"], "--capacity-tokens needs --cache-model capacity"),
        (
            ["--cache-model", "capacity", "--capacity-tokens", "9", "--min-cached-tokens", "1"],
            "--min-cached-tokens needs --cache-model ttl, got 'capacity'",
        ),
        (
            ["--kv-events", "tcp://h:1", "--engine-grace", "0"],
            "--engine-grace: must be a number > 0",
        ),
        (
            ["--snapshot-interval", "0"],
            "--snapshot-interval: must be a number > 0 (seconds, at most 604800), got '0'",
        ),
        (["--snapshot-interval", "inf"], "--snapshot-interval: must be a finite number"),
        (
            ["--max-requests", "0"],
            "--max-requests: must be an int >= 1 (at most 1000000000), got '0'",
        ),
        (["--window-ms", "nan"], "--window-ms: must be a finite number, got 'nan'"),
        (["--window-ms", "1e9"], "--window-ms: must be a number from 0 to 60000, got '1e9'"),
        (["--cache-model", "ttl", "--ttl-seconds", "inf"], "--ttl-seconds: must be a finite"),
        (["--kv-events", "tcp://h:1", "--dp-size", "0"], "--dp-size: must be an int >= 1"),
        (
            ["--upstream", "http://h", "--upstream-timeout", "0"],
            "--upstream-timeout: must be a number > 0 (seconds, at most 604800), got '0'",
        ),
        (
            ["--upstream", "http://h", "--upstream-connections", "0"],
            "--upstream-connections: must be an int >= 1",
        ),
        (
            ["--upstream", "http://h", "--upstream-pool-timeout", "inf"],
            "--upstream-pool-timeout: must be a finite",
        ),
        (
            [
                "--upstream",
                "http://h",
                "--upstream-connections",
                "8",
                "--upstream-tenant-connections",
                "9",
            ],
            "--upstream-tenant-connections 9 is over --upstream-connections 8",
        ),
        (
            ["--replica", "http://h:1/v1", "--replica", "http://h:1"],
            "--replica: fleet.replicas[1].base_url 'http://h:1' is also replica 'replica-0''s",
        ),
        (["--kv-events", "tcp://127.0.0.1:x"], "tcp://host:port"),
        (["--api-keys", "/nonexistent/keys.json"], "key file '/nonexistent/keys.json'"),
        (["--share-prefixes-across-tenants"], "needs tenant keys"),
        (
            ["--shutdown-timeout", "0"],
            "--shutdown-timeout: must be a number > 0 (seconds, at most 604800), got '0'",
        ),
    ],
)
def test_inconsistent_options_exit_with_a_message(argv, words, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def _empty_key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {}}))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    ("argv", "environ", "words"),
    [
        ([], {"CONTEXTPILOT_API_KEY": ""}, "$CONTEXTPILOT_API_KEY is set but empty"),
        ([], {"CONTEXTPILOT_API_KEY": " k "}, "$CONTEXTPILOT_API_KEY must be printable ASCII"),
        ([], {"CONTEXTPILOT_API_KEYS": ""}, "$CONTEXTPILOT_API_KEYS is set but lists no"),
        ([], {"CONTEXTPILOT_API_KEYS": " , "}, "$CONTEXTPILOT_API_KEYS is set but lists no"),
        (["--api-key", ""], {}, "--api-key is set but empty"),
        (["--no-auth", "--api-key", "k"], {}, "keys are given by --api-key"),
        (["--no-auth"], {"CONTEXTPILOT_API_KEYS": "a=k"}, "keys are given by $CONTEXTPILOT"),
    ],
)
def test_a_key_source_without_a_key_is_refused_naming_it(  # type: ignore[no-untyped-def]
    argv, environ, words, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("CONTEXTPILOT_API_KEY", raising=False)
    monkeypatch.delenv("CONTEXTPILOT_API_KEYS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)

    def started(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the server started")

    monkeypatch.setattr(server_module.uvicorn, "run", started)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert words in err and " k " not in err
    assert "--no-auth" in err or "printable ASCII" in err  # how to run open on purpose


def test_the_server_serves_under_its_collection_policy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # docs/DESIGN.md, "The proxy": the modules and the app are frozen out of the collector's
    # full passes when uvicorn starts serving (the app, made by main, among them).
    # While it serves, a full pass's survivors are frozen too (every 8th lets the next walk
    # them all); the hook leaves gc.callbacks when serving ends.
    seen: list[tuple[int, bool, list[int]]] = []

    def started(app, **kwargs):  # type: ignore[no-untyped-def]
        frozen_app = gc.is_tracked(app) and all(o is not app for o in gc.get_objects())
        hooks = [h.walk_all_every for h in gc.callbacks if isinstance(h, FreezeSurvivors)]
        seen.append((gc.get_freeze_count(), frozen_app, hooks))

    monkeypatch.setattr(server_module.uvicorn, "run", started)
    try:
        assert main(["--no-auth", "--port", "0"]) == 0
        assert main(["--no-auth", "--port", "0", "--gc-walk-all-every", "0"]) == 0
    finally:
        gc.unfreeze()
    [(frozen, app_frozen, hooks), (_, _, no_hooks)] = seen
    assert frozen > 0 and app_frozen and hooks == [8] and no_hooks == []
    assert not any(isinstance(h, FreezeSurvivors) for h in gc.callbacks)


def test_a_full_collections_survivors_are_frozen_and_every_nth_walks_them_all() -> None:
    hook = FreezeSurvivors(3)
    survivor = [object()]  # a tracked object
    try:
        gc.unfreeze()
        hook("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
        hook("start", {"generation": 2, "collected": 0, "uncollectable": 0})
        assert gc.get_freeze_count() == 0 and hook.full_passes == 0
        frozen = []
        for _ in range(4):
            hook("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
            frozen.append(gc.get_freeze_count() > 0)
        assert frozen == [True, True, False, True]
        assert gc.is_tracked(survivor)
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError, match="walk_all_every must be at least 1, got 0"):
        FreezeSurvivors(0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gc-walk-all-every", "-1"])


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_service_without_keys_off_loopback_says_it_is_open(  # type: ignore[no-untyped-def]
    host, warned, monkeypatch, caplog
) -> None:
    monkeypatch.delenv("CONTEXTPILOT_API_KEY", raising=False)
    monkeypatch.delenv("CONTEXTPILOT_API_KEYS", raising=False)
    monkeypatch.setattr(server_module.uvicorn, "run", lambda app, **kwargs: None)
    try:
        assert main(["--host", host, "--port", "0"]) == 0
    finally:
        gc.unfreeze()
    assert ("anyone who reaches it may use the service" in caplog.text) is warned


def test_a_key_file_naming_no_tenant_stops_the_real_server(tmp_path: Path) -> None:
    path = _empty_key_file(tmp_path)
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_API_KEY")}
    process = subprocess.Popen(
        [sys.executable, "-m", "contextpilot_integrations.service.server"]
        + ["--port", str(port), "--api-keys", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=environ,
    )
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it started: anyone's key would do
        made_up = {"Authorization": "Bearer made-up"}
        status = httpx.get(f"http://127.0.0.1:{port}/v1/stats", headers=made_up).status_code
        process.kill()
        process.communicate()
        pytest.fail(f"the server started with an empty key file; a made-up key got {status}")
    assert process.returncode == 2
    assert f"key file {str(path)!r} names no tenant" in output.decode()


def test_no_auth_runs_open_on_purpose_and_says_so(server_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--no-auth")
    assert httpx.get(f"{server.base_url}/v1/stats").status_code == 200
    log = server.log()
    assert "WARNING" in log and "--no-auth: authentication is off" in log
    with caplog.at_level(logging.WARNING):
        config = _config(["--no-auth"])
    assert config.tenancy.mode == "open" and "authentication is off" in caplog.text
    with pytest.raises(ValueError, match="tenants must name at least one tenant"):
        ServiceConfig(tenants={})  # an embedder's empty key set is not "no authentication"
