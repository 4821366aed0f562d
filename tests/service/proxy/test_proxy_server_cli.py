"""``contextpilot-server --upstream URL``: the proxy mode from the command line, its upstream
key sources and the options it refuses (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest
from service_testing import wait_for

from contextpilot_integrations.service.server import build_parser, config_from_args


def test_the_server_proxies_with_its_key_from_the_environment(standin, server_factory) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    server = server_factory(
        "--upstream", url, "--upstream-api-key-env", "UPSTREAM_KEY",
        env={"UPSTREAM_KEY": "up-key-1", "CONTEXTPILOT_API_KEYS": "alice=alice-key"},
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="alice-key", max_retries=0)
    answer = client.chat.completions.create(
        model="plain", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "done"
    [received] = state.received
    assert received.headers["authorization"] == "Bearer up-key-1"
    assert received.body["cache_salt"]  # alice's: the service has tenant keys
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="other", max_retries=0
        ).models.list()


KEY_ENV = ("--upstream-api-key-env", "K")
H = "http://h"


def _config(argv: list[str], environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(argv), environ or {})


def test_the_upstream_key_file_and_kind(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\nignored\n", encoding="utf-8")
    config = _config(
        ["--upstream", "https://api.anthropic.com", "--upstream-api-key-file", str(key_file)]
    )
    assert config.proxy is not None
    assert config.proxy.api_key == "sk-from-file" and config.proxy.kind == "anthropic"
    assert "sk-from-file" not in repr(config.proxy)
    assert _config(["--upstream", "https://api.openai.com/v1"]).proxy.kind == "openai"  # type: ignore[union-attr]
    local = _config(["--upstream", "http://127.0.0.1:8000", "--pass-client-key"]).proxy
    assert local is not None and local.kind == "openai-compatible" and local.pass_client_key
    assert _config([]).proxy is None


@pytest.mark.parametrize(
    ("argv", "environ", "words"),
    [
        (["--pass-client-key"], {}, "needs --upstream URL"),
        (["--upstream-connections", "8"], {}, "--upstream-connections needs --upstream URL"),
        (["--upstream-pool-timeout", "1"], {}, "--upstream-pool-timeout needs --upstream URL"),
        (["--upstream-timeout", "5", "--upstream-connections", "8"], {},
         "--upstream-timeout, --upstream-connections need --upstream URL"),
        (["--upstream", "http://h", "--upstream-api-key-env", "NOPE"], {}, "$NOPE is unset"),
        (["--upstream", H, *KEY_ENV, "--pass-client-key"], {"K": "v"}, "--pass-client-key"),
        (["--upstream", "ftp://h"], {}, "http(s) URL"),
        (["--upstream", H, *KEY_ENV, "--upstream-api-key-file", "f"], {"K": "v"}, "not both"),
        (["--upstream", H, *KEY_ENV], {"K": "abc\r\nX-Injected: 1"}, "$K holds whitespace"),
        (["--upstream", H, *KEY_ENV], {"K": " key with space "}, "control characters"),
    ],
)  # fmt: skip
def test_inconsistent_proxy_options_are_refused(
    argv: list[str], environ: dict[str, str], words: str
) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        _config(argv, environ)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", " 5"], "argument --port: must be an int >= 0 (at most 65535), got ' 5'"),
        (["--port", "65536"], "argument --port: must be an int >= 0 (at most 65535), got '65536'"),
        (["--port", "8_000"], "argument --port: must be an int >= 0 (at most 65535), got '8_000'"),
        (["--upstream", H, "--upstream-connections", "70000"],
         "argument --upstream-connections: must be an int >= 1 (at most 65535), got '70000'"),
        (["--upstream", H, "--upstream-tenant-connections", "0"],
         "argument --upstream-tenant-connections: must be an int >= 1 (at most 65535), got '0'"),
        (["--replica", H, "--replica-max-in-flight", "1e3"],
         "argument --replica-max-in-flight: must be an int >= 1 (at most 65535), got '1e3'"),
        (["--upstream", H, "--upstream-timeout", "1e300"],
         "argument --upstream-timeout: must be a number > 0 (seconds, at most 604800)"),
        (["--upstream", H, "--upstream-pool-timeout", " 1"],
         "argument --upstream-pool-timeout: must be a number, got ' 1'"),
        (["--max-body-bytes", str(2**31)],
         "argument --max-body-bytes: must be an int >= 1 (at most 1073741824)"),
        (["--dp-size", "100000"], "argument --dp-size: must be an int >= 1 (at most 1024)"),
        (["--window-max-batch", "0"],
         "argument --window-max-batch: must be an int >= 1 (at most 1024), got '0'"),
    ],
)  # fmt: skip
def test_a_numeric_flag_out_of_bounds_or_mistyped_is_refused_naming_it(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert words in capsys.readouterr().err


def test_proxy_limits_left_out_take_the_configs_defaults() -> None:
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig

    config = _config(["--upstream", H]).proxy
    assert config is not None
    assert (config.read_timeout_s, config.max_connections, config.pool_timeout_s) == (
        ProxyConfig.read_timeout_s, ProxyConfig.max_connections, ProxyConfig.pool_timeout_s
    )  # fmt: skip
    given = _config(["--replica", H, "--upstream-connections", "8",
                     "--upstream-pool-timeout", "2", "--upstream-timeout", "3"]).proxy  # fmt: skip
    assert given is not None
    assert (given.read_timeout_s, given.max_connections, given.pool_timeout_s) == (3.0, 8, 2.0)


def test_numeric_flags_in_bounds_are_read() -> None:
    args = build_parser().parse_args(
        ["--port", "0", "--upstream", H, "--upstream-connections", "65535",
         "--upstream-timeout", "0.5", "--window-ms", "2.5e1", "--max-requests", "1000000000"]
    )  # fmt: skip
    assert (args.port, args.upstream_connections, args.upstream_timeout) == (0, 65535, 0.5)
    assert (args.window_ms, args.max_requests) == (25.0, 10**9)


def test_sigterm_with_a_stream_open_ends_it_and_exits_cleanly(standin, server_factory) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    server = server_factory("--upstream", url, "--shutdown-timeout", "1")
    body = {"model": "hang", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is open, the upstream holds it
        assert server.stop(signal.SIGTERM, 20) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):  # ended, never silently whole
            list(lines)
    wait_for(state.cancelled.is_set, what="the upstream saw the proxy hang up")
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
