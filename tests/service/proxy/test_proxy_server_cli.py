"""``contextpilot-server --upstream URL``: the proxy mode from the command line, its upstream
key sources and the options it refuses (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

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
        (["--upstream", "http://h", "--upstream-api-key-env", "NOPE"], {}, "$NOPE is unset"),
        (["--upstream", H, *KEY_ENV, "--pass-client-key"], {"K": "v"}, "--pass-client-key"),
        (["--upstream", "ftp://h"], {}, "http(s) URL"),
        (["--upstream", H, *KEY_ENV, "--upstream-api-key-file", "f"], {"K": "v"}, "not both"),
    ],
)  # fmt: skip
def test_inconsistent_proxy_options_are_refused(
    argv: list[str], environ: dict[str, str], words: str
) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        _config(argv, environ)
    assert words in str(caught.value)
