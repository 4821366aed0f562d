"""The proxy in front of a real engine: ``contextpilot-server --upstream`` before vLLM on the
CPU (random weights), a three-call tool-using conversation sent with the real ``openai`` SDK.
The engine serves the replayed history from its prefix cache (cached tokens on the later calls)
and the repeated tool result goes out as a pointer (docs/DESIGN.md, "The proxy").

Tier ``vllm``: needs ``.venv-vllm`` (``scripts/setup-vllm-env.sh``); skipped without it. The
engine's start dominates its time.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from contextpilot_bench.agent_engine import TOOL_CHAT_TEMPLATE
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from contextpilot_bench.testbed.vllm_server import VllmCpuServer
from support.engine_marks import NEEDS_VLLM

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]

WORDS = ["cache", "engine", "prefix", "block", "token", "request", "model", "index", "shared"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_proxy(upstream: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_API_KEY")}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "contextpilot_integrations.service.server",
             "--port", str(port), "--upstream", upstream],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the proxy did not start:\n{log.read_text(errors='replace')}")


def test_a_tool_using_conversation_through_the_proxy_to_vllm(tmp_path: Path) -> None:
    model_dir = prepare_model_dir(tmp_path / "model", seed=0)
    template = tmp_path / "tool_template.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE, encoding="utf-8")
    rng = random.Random(5)
    result = "\n".join(
        f"Line {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) for i in range(25)
    )
    with VllmCpuServer(
        model_dir,
        block_size=32,
        max_model_len=4096,
        startup_timeout=600,
        extra_args=["--chat-template", str(template)],
    ) as engine:
        process, proxy = _start_proxy(engine.base_url, tmp_path / "proxy.log")
        try:
            client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", timeout=120)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You answer from the search results. " * 20},
                {"role": "user", "content": "What does the prefix cache keep?"},
            ]
            raws = []
            for call in range(3):
                raw = client.chat.completions.with_raw_response.create(
                    model=engine.model_name,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=1,
                    extra_headers={"x-contextpilot-session": "vllm-conversation"},
                )
                raws.append(raw)
                arguments = json.dumps({"query": f"query {call}"})
                messages.append(
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": f"call_{call}",
                                "type": "function",
                                "function": {"name": "search", "arguments": arguments},
                            }
                        ],
                    }
                )
                messages.append({"role": "tool", "tool_call_id": f"call_{call}", "content": result})
            usages = [raw.parse().usage for raw in raws]
            cached = [u.prompt_tokens_details.cached_tokens or 0 for u in usages]  # type: ignore[union-attr]
            assert cached[1] > 0 and cached[2] > 0, cached
            # The third call carries the second search's result as a pointer to the first.
            assert raws[2].headers["x-contextpilot-pointers"] == "1"
            assert raws[1].headers["x-contextpilot-pointers"] == "0"
            # The pointer is shorter than the result: the third prompt grew by less than one.
            growth = usages[2].prompt_tokens - usages[1].prompt_tokens  # type: ignore[union-attr]
            single = usages[1].prompt_tokens - usages[0].prompt_tokens  # type: ignore[union-attr]
            assert growth < single
            totals = httpx.get(f"{proxy}/v1/usage").json()
            conversation = totals["conversations"][""]["vllm-conversation"]
            assert conversation["usage_reports"] == 3
            assert conversation["cached_tokens"] == sum(cached)
        finally:
            process.terminate()
            process.wait(30)
