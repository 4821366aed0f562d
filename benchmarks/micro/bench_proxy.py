"""Latency and memory the proxy mode adds in front of an upstream that answers at once.

Run: ``.venv/bin/python benchmarks/micro/bench_proxy.py`` (``--quick``: 300 requests, a few
seconds; ``--requests 100000`` for the long memory run; ``--clients``, ``--prompt-tokens``,
``--think-ms`` to change the load; ``--answer-ms`` for an upstream that takes that long to
answer, so that many requests are in flight; ``--json`` for machine-readable output;
``--profile-proxy FILE`` to profile the proxy, below). It starts, on 127.0.0.1:

* an upstream: this file's :func:`upstream_app` (a bare ASGI app, no framework) in its own
  uvicorn process, answering every ``POST /v1/chat/completions`` at once with an OpenAI-shaped
  chat completion (JSON) or, for ``"stream": true``, an SSE stream of a few chunks;
* the proxy: ``contextpilot-server --upstream <upstream>/v1`` (``python -m
  contextpilot_integrations.service.server``, one uvicorn worker) in front of it
  (docs/DESIGN.md, "The proxy").

``--clients`` concurrent clients (default 64, tasks of this process, each with one
``aiohttp.ClientSession`` of one connection per target: a light client, so that the clients
take little of the CPUs the proxy and the upstream share with them) each send the same request
twice, once straight to the upstream and once through the proxy, in random order, so both
paths see the same load at the same time, then pause ``--think-ms`` on average (exponential,
default 1,000 ms: the engine's generation time, which this upstream does not take, and the
agent's own work; one such pause also comes before a client's first measured request, so that
the measured window does not open with every client sending at once); ``--think-ms 0`` is a
closed loop, in which the proxy, not the upstream, is
the bottleneck and the added latency is its queue. The requests are
agent conversations (docs/DESIGN.md, "The proxy"): a system prompt, the user's task, then
rounds of an assistant tool call and its tool result holding retrieved documents (drawn with
Zipf popularity from a shared pool, so documents repeat within and across conversations and
the planner sends pointers), one more round at each of a conversation's steps, prompts of about
``--prompt-tokens`` tokens (4 bytes a token) on average; every other request is streamed. Each
conversation has its own ``x-contextpilot-session``; a client starts a new one after the last
step, so the proxy sees ever more conversations.

Figures (milliseconds unless stated):

* end-to-end latency (request sent to the last byte read), direct and through the proxy, p50
  and p99, and the added latency (proxy percentile - direct percentile): **targets p50 <= 2 ms,
  p99 <= 10 ms**;
* for the streamed requests, time to the first byte of the answer's body, direct and through
  the proxy, and the added p50: **target <= 2 ms**;
* CPU time of the proxy process per proxied request (``/proc/<pid>/stat``, so Linux only):
  wall-clock figures on a machine with few cores include the waits for a CPU, since the
  clients, the proxy and the upstream all run on it, and this figure does not; and of that,
  the CPU time of its main thread, which runs the event loop (the rest is the worker threads
  that plan the calls and record their usage); and the context switches of all its threads per
  request (``voluntary_ctxt_switches`` + ``nonvoluntary_ctxt_switches`` of
  ``/proc/<pid>/task/*/status``): each hand-off between the event loop and a worker thread
  costs a wake-up or two;
* the proxy process's RSS (``/proc/<pid>/status``) after the warm-up and at checkpoints up to
  ``--requests`` proxied requests, to show it stays bounded.

``--cpus-proxy LIST`` (CPU numbers, ``0`` or ``2,3`` or ``0-3``; Linux only) runs the proxy
process, all its threads, on those CPUs alone and the clients and the upstream on the others
(``--cpus-rest LIST`` names them; default every other CPU this process may use), so that a
request through the proxy never waits for a CPU the clients or the upstream hold: on a machine
with few cores such waits are most of the added latency, and they are the bench's, not the
proxy's. The direct requests then run on fewer CPUs than without the option, so compare the
added latency, not the direct one, between runs with and without it. The two lists must not
overlap and must name CPUs this process may use (``os.sched_getaffinity``); anything else,
or a system without ``os.sched_setaffinity``, is refused before anything starts. The CPUs each
side had (read back from the processes) are printed. Other processes on the machine are not
moved: they still take CPUs from both sides.

``--profile-proxy FILE`` runs the proxy under ``cProfile`` timed by the CPU time of its event
loop's thread (``time.thread_time``: the waits for a CPU on a shared machine do not count) and
writes its ``pstats`` to ``FILE`` when it stops (read it with ``python -m pstats FILE``); the
threads it starts (the worker threads) are profiled each by a profiler of its own, timed by
its own CPU time, and their ``pstats`` summed into ``FILE.threads``. The profilers' own cost
is then in every figure printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import aiohttp
import httpx
import numpy as np

TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0
TARGET_TTFB_MS = 2.0
DOC_POOL = 2_000
DOC_TOKENS = 400
DOCS_PER_RESULT = 3
STEPS = 4
CHECKPOINTS = (0.1, 0.25, 0.5, 0.75, 1.0)

# --- the upstream: a bare ASGI app that answers at once -------------------------------------

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Done: the answer is in doc 3."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8000, "completion_tokens": 9, "total_tokens": 8009},
    }
).encode()


def _chunk(delta: dict[str, Any], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0}
    return (
        b"data: " + json.dumps({**body, "model": "bench", "choices": [choice]}).encode() + b"\n\n"
    )


_STREAM = [
    _chunk({"role": "assistant", "content": ""}, None),
    *(_chunk({"content": word}, None) for word in ("Done: ", "the answer ", "is in doc 3.")),
    _chunk({}, "stop"),
    b"data: [DONE]\n\n",
]
_MODELS = b'{"object": "list", "data": [{"id": "bench", "object": "model"}]}'

Scope = dict[str, Any]
Message = dict[str, Any]
ANSWER_S = [0.0]
"""How long :func:`upstream_app` waits before each chat answer (``--answer-ms``)."""


async def upstream_app(
    scope: Scope,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """The stand-in engine: ``GET /v1/models`` (the readiness probe) and ``POST
    /v1/chat/completions``, JSON or SSE by the body's ``stream``; anything else is a 404."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if ANSWER_S[0] and path == "/v1/chat/completions":
        await asyncio.sleep(ANSWER_S[0])  # an engine's time to its first token
    if path == "/v1/chat/completions" and scope["method"] == "POST":
        if json.loads(body).get("stream"):
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for chunk in _STREAM:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        answer, status = _COMPLETION, 200
    elif path == "/v1/models":
        answer, status = _MODELS, 200
    else:
        answer, status = b'{"error": {"message": "not found"}}', 404
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(answer)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def serve_upstream(port: int, answer_ms: float = 0.0) -> None:
    """Run :func:`upstream_app` (in the child process ``--serve-upstream`` starts), each chat
    answer ``answer_ms`` late."""
    ANSWER_S[0] = answer_ms / 1000.0
    import uvicorn

    uvicorn.run(
        upstream_app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # Longer than any client's pause: a keep-alive connection the server closes as a
        # request goes out on it is a failed request, not the latency of a fast upstream.
        timeout_keep_alive=300,
    )


def serve_proxy_profiled(path: str, server_args: Sequence[str]) -> None:
    """Run ``contextpilot-server`` with ``server_args`` (in the child process
    ``--profile-proxy`` starts) under ``cProfile`` timed by its main thread's CPU time; the
    ``pstats`` go to ``path`` when it stops, and those of the threads it starts, each timed
    by its own CPU time, summed into ``path.threads``."""
    import cProfile
    import pstats
    import runpy
    import threading

    profile = cProfile.Profile(time.thread_time)
    threads: list[cProfile.Profile] = []

    def profile_thread(frame: object, event: str, arg: object) -> None:
        # Called at a new thread's first event: the thread's own profiler replaces this hook.
        sys.setprofile(None)
        own = cProfile.Profile(time.thread_time)
        threads.append(own)
        own.enable()

    def stop(signum: int, frame: object) -> None:
        # uvicorn raises the signal again once it has shut down: the profile is written.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    sys.argv = ["contextpilot-server", *server_args]
    threading.setprofile(profile_thread)  # type: ignore[arg-type]
    profile.enable()
    try:
        runpy.run_module("contextpilot_integrations.service.server", run_name="__main__")
    except SystemExit:
        pass
    finally:
        profile.disable()
        profile.dump_stats(path)
        if threads:
            summed = pstats.Stats(threads[0])
            for each in threads[1:]:
                summed.add(each)
            summed.dump_stats(f"{path}.threads")


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_cpus(text: str, flag: str) -> frozenset[int]:
    """The CPU numbers of ``text`` (``"0"``, ``"2,3"``, ``"0-3,6"``).

    Raises:
        ValueError: ``text`` is not such a list (the message names ``flag`` and ``text``).
    """
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(
                f"{flag} must be CPU numbers like 0 or 2,3 or 0-3, got {text!r}"
            ) from None
        if low < 0 or high < low:
            raise ValueError(f"{flag}: {part.strip()!r} is no range of CPU numbers in {text!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def cpu_split(proxy: str | None, rest: str | None) -> tuple[frozenset[int], frozenset[int]] | None:
    """The CPUs of the proxy and of the rest (clients, upstream) for ``--cpus-proxy`` and
    ``--cpus-rest`` (the rest defaults to every other CPU this process may use); ``None``
    when neither is given.

    Raises:
        ValueError: a list is malformed, names a CPU this process may not use, the two
            overlap, the rest is left empty, ``--cpus-rest`` comes without ``--cpus-proxy``, or
            the system cannot pin a process to CPUs (``os.sched_setaffinity``: Linux).
    """
    if proxy is None and rest is None:
        return None
    if proxy is None:
        raise ValueError(f"--cpus-rest {rest} needs --cpus-proxy (the proxy's CPUs)")
    if not hasattr(os, "sched_setaffinity") or not hasattr(os, "sched_getaffinity"):
        raise ValueError(
            f"--cpus-proxy {proxy}: this system ({sys.platform}) cannot pin processes to "
            "CPUs (os.sched_setaffinity: Linux only)"
        )
    allowed = frozenset(os.sched_getaffinity(0))
    proxy_cpus = parse_cpus(proxy, "--cpus-proxy")
    rest_cpus = parse_cpus(rest, "--cpus-rest") if rest is not None else allowed - proxy_cpus
    for flag, cpus in (("--cpus-proxy", proxy_cpus), ("--cpus-rest", rest_cpus)):
        missing = cpus - allowed
        if missing:
            raise ValueError(
                f"{flag}: CPUs {cpu_list(missing)} do not exist or this process may not use "
                f"them; it may use {cpu_list(allowed)}"
            )
    if proxy_cpus & rest_cpus:
        raise ValueError(
            f"--cpus-proxy {proxy} and --cpus-rest {rest} share CPUs "
            f"{cpu_list(proxy_cpus & rest_cpus)}"
        )
    if not rest_cpus:
        raise ValueError(
            f"--cpus-proxy {proxy} leaves no CPU for the clients and the upstream (this "
            f"process may use {cpu_list(allowed)})"
        )
    return proxy_cpus, rest_cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """``cpus`` as ranges: ``0-3,6``."""
    ordered = sorted(cpus)
    ranges: list[str] = []
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            first = ordered[start]
            ranges.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(ranges)


def pin_threads(pid: int, cpus: frozenset[int]) -> None:
    """Every thread process ``pid`` has now on ``cpus`` (threads it starts later inherit the
    CPUs of the thread that starts them, and a child process those of the thread forking
    it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def process_cpus(pid: int) -> str:
    """The CPUs the threads of process ``pid`` may run on, together."""
    cpus: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            cpus.update(os.sched_getaffinity(int(task)))
        except ProcessLookupError:
            continue
    return cpu_list(cpus)


def start_process(
    command: list[str],
    ready_url: str,
    log: IO[bytes],
    cpus: frozenset[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` (its stderr to ``log``; on ``cpus`` if given, from its first
    instruction on) and wait (60 s at most) until ``GET ready_url`` answers 200. The service's
    key variables are left out of its environment: the proxy runs open, on 127.0.0.1 only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPILOT_API_KEY")}
    if cpus is None:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
    else:
        # The child inherits the CPUs of the thread that forks it: this one, for that moment.
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
        finally:
            os.sched_setaffinity(0, own)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"{command[:4]} did not start: {log_tail(log)}")
        time.sleep(0.05)


def log_tail(log: IO[bytes], size: int = 2_000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]


def stop_process(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat`` fields 14 and 15),
    or of its main thread alone (``/proc/<pid>/task/<pid>/stat``) with ``main_thread``."""
    path = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    with open(path, encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Context switches, voluntary and not, of the threads process ``pid`` has now
    (``/proc/<pid>/task/*/status``)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status", encoding="ascii") as handle:
                status = handle.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if "ctxt_switches:" in line:
                total += int(line.split(":", 1)[1])
    return total


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


# --- the workload: agent conversations ------------------------------------------------------

SYSTEM = (
    "You are a research agent. Answer the user's question from the documents the search tool "
    "returns. Call search with a short query when you need more evidence; cite documents by "
    "their number; say so when the documents do not answer the question. "
) * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the document store; returns the best matching documents.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


class Workload:
    """The conversations' texts: a pool of documents and, per conversation, its rounds.

    A conversation's round ``r`` is the same at every step (seeded by conversation and round),
    so each step's history replays the previous step's byte for byte, as an agent's does.
    """

    def __init__(self, prompt_tokens: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        vocabulary = [f"w{i:04d}" for i in range(5_000)]
        words = DOC_TOKENS * 4 // 6  # "w0123 " is 6 bytes, ~1.5 tokens at 4 bytes a token
        self.documents = [
            f"Document {d}. " + " ".join(rng.choice(vocabulary, size=words).tolist())
            for d in range(DOC_POOL)
        ]
        p = 1.0 / np.arange(1, DOC_POOL + 1)
        self.popularity = p / p.sum()
        round_tokens = DOCS_PER_RESULT * DOC_TOKENS + 30
        fixed = len(json.dumps(TOOLS)) // 4 + len(SYSTEM) // 4 + 40
        # The steps add one round each: the mean over steps is the base plus (STEPS - 1) / 2.
        self.base_rounds = max(1, round((prompt_tokens - fixed) / round_tokens - (STEPS - 1) / 2))

    def _round(self, conversation: int, r: int) -> list[dict[str, Any]]:
        rng = np.random.default_rng((conversation, r))
        picked = rng.choice(DOC_POOL, size=DOCS_PER_RESULT, replace=False, p=self.popularity)
        call_id = f"call_{conversation}_{r}"
        query = f"evidence {conversation % 97} part {r}"
        return [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": json.dumps({"query": query})},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": json.dumps(
                    [{"id": f"doc-{d}", "text": self.documents[d]} for d in picked.tolist()]
                ),
            },
        ]

    def body(self, conversation: int, step: int, stream: bool) -> bytes:
        """The request at ``step`` of ``conversation``, JSON-encoded."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Task {conversation}: what do the documents say about topic "
                f"{conversation % 211}? Quote the relevant passages.",
            },
        ]
        for r in range(self.base_rounds + step):
            messages += self._round(conversation, r)
        body: dict[str, Any] = {"model": "bench", "messages": messages, "tools": TOOLS}
        if stream:
            body["stream"] = True
        return json.dumps(body).encode()


# --- the clients ----------------------------------------------------------------------------


@dataclass
class Samples:
    """What one path (direct or proxy) measured, in seconds."""

    total: list[float] = field(default_factory=list)
    first_byte: list[float] = field(default_factory=list)  # streamed requests only
    errors: int = 0
    failures: list[str] = field(default_factory=list)  # the first few kept for the report


async def timed_request(
    client: aiohttp.ClientSession, body: bytes, session: str, stream: bool, into: Samples
) -> Mapping[str, str] | None:
    """Send one chat request; record its latency (and time to first byte if ``stream``)."""
    headers = {"content-type": "application/json", "x-contextpilot-session": session}
    start = time.perf_counter()
    first = None
    try:
        async with client.post("/v1/chat/completions", data=body, headers=headers) as r:
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        into.errors += 1
        if len(into.failures) < 5:
            into.failures.append(f"{type(error).__name__}: {error!r:.200}")
        return None
    if r.status != 200:
        into.errors += 1
        if len(into.failures) < 5:
            into.failures.append(f"HTTP {r.status}")
        return None
    into.total.append(end - start)
    if stream and first is not None:
        into.first_byte.append(first - start)
    return r.headers


@dataclass
class Run:
    direct: Samples = field(default_factory=Samples)
    proxy: Samples = field(default_factory=Samples)
    rss: list[tuple[int, float]] = field(default_factory=list)
    pointers: int = 0
    tokens_removed: int = 0
    prompt_bytes: int = 0
    conversations: int = 0  # warm-up included
    proxy_cpu_s: float = 0.0
    proxy_loop_cpu_s: float = 0.0  # the proxy's main thread: its event loop
    proxy_switches: int = 0  # context switches of the proxy's threads
    upstream_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    cpus: dict[str, str] = field(default_factory=dict)  # side -> the CPUs its threads had


async def drive(
    args: argparse.Namespace, upstream_url: str, proxy_url: str, proxy_pid: int, upstream_pid: int
) -> Run:
    workload = Workload(args.prompt_tokens)
    # One connection per client and target, as one agent process holds.
    timeout = aiohttp.ClientTimeout(total=120.0)

    def session(url: str) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=300)
        return aiohttp.ClientSession(url, connector=connector, timeout=timeout)

    directs = [session(upstream_url) for _ in range(args.clients)]
    proxies = [session(proxy_url) for _ in range(args.clients)]
    run = Run()
    next_conversation = iter(range(10**9))
    sent = [0]  # pairs handed out in this phase
    done = [0]  # measured pairs finished
    checkpoints = sorted({max(1, round(f * args.requests)) for f in CHECKPOINTS})

    async def client(index: int, count: int, warm: bool) -> None:
        rng = random.Random(index)
        direct, proxy = directs[index], proxies[index]
        if not warm and args.think_ms:
            # A pause before the first measured request too: without it every client sends
            # at the same instant when the window opens, a burst of --clients requests that
            # the steady load never makes and whose queue sets the p99 of a short run. The
            # pause is exponential, so the arrivals are as in the steady state from the start.
            await asyncio.sleep(rng.expovariate(1000.0 / args.think_ms))
        while True:
            conversation = next(next_conversation)
            run.conversations = conversation + 1
            for step in range(STEPS):
                if sent[0] >= count:
                    return
                sent[0] += 1
                stream = (conversation + step) % 2 == 1
                body = workload.body(conversation, step, stream)
                session = f"bench-{conversation}"
                into_direct = Samples() if warm else run.direct
                into_proxy = Samples() if warm else run.proxy
                if rng.random() < 0.5:
                    await timed_request(direct, body, session, stream, into_direct)
                    headers = await timed_request(proxy, body, session, stream, into_proxy)
                else:
                    headers = await timed_request(proxy, body, session, stream, into_proxy)
                    await timed_request(direct, body, session, stream, into_direct)
                if args.think_ms:
                    await asyncio.sleep(rng.expovariate(1000.0 / args.think_ms))
                if warm:
                    continue
                run.prompt_bytes += len(body)
                if headers is not None:
                    run.pointers += int(headers.get("x-contextpilot-pointers", 0))
                    run.tokens_removed += int(headers.get("x-contextpilot-tokens-removed", 0))
                done[0] += 1
                if checkpoints and done[0] >= checkpoints[0]:
                    run.rss.append((checkpoints.pop(0), rss_mb(proxy_pid)))

    try:
        # The warm-up alone first, so that the measured window starts with every client busy.
        await asyncio.gather(*(client(i, args.warmup, True) for i in range(args.clients)))
        sent[0] = 0
        run.rss.append((0, rss_mb(proxy_pid)))
        wall, proxy_cpu = time.perf_counter(), cpu_seconds(proxy_pid)
        proxy_loop_cpu = cpu_seconds(proxy_pid, main_thread=True)
        proxy_switches = context_switches(proxy_pid)
        upstream_cpu, client_cpu = cpu_seconds(upstream_pid), time.process_time()
        await asyncio.gather(*(client(i, args.requests, False) for i in range(args.clients)))
        run.wall_s = time.perf_counter() - wall
        run.proxy_cpu_s = cpu_seconds(proxy_pid) - proxy_cpu
        run.proxy_loop_cpu_s = cpu_seconds(proxy_pid, main_thread=True) - proxy_loop_cpu
        run.proxy_switches = context_switches(proxy_pid) - proxy_switches
        run.upstream_cpu_s = cpu_seconds(upstream_pid) - upstream_cpu
        run.client_cpu_s = time.process_time() - client_cpu
    finally:
        for each in directs + proxies:
            await each.close()
    return run


def percentile_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000.0 if values else float("nan")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    upstream_port, proxy_port = free_port(), free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    server_args = ["--port", str(proxy_port), "--upstream", f"{upstream_url}/v1"]
    server_args += ["--log-level", "warning"]
    command = [sys.executable, "-m", "contextpilot_integrations.service.server", *server_args]
    if args.profile_proxy:
        profiled = os.path.abspath(args.profile_proxy)
        command = [sys.executable, __file__, "--serve-proxy-profiled", profiled, *server_args]
    split = cpu_split(args.cpus_proxy, args.cpus_rest)
    if split is not None:
        # The clients (this process) and, by inheritance, the upstream.
        pin_threads(os.getpid(), split[1])
    with tempfile.TemporaryFile() as upstream_log, tempfile.TemporaryFile() as proxy_log:
        upstream = start_process(
            [
                sys.executable,
                __file__,
                "--serve-upstream",
                str(upstream_port),
                "--answer-ms",
                str(args.answer_ms),
            ],  # fmt: skip
            f"{upstream_url}/v1/models",
            upstream_log,
        )
        try:
            proxy = start_process(
                command, f"{proxy_url}/health", proxy_log, split[0] if split else None
            )
            try:
                run = asyncio.run(drive(args, upstream_url, proxy_url, proxy.pid, upstream.pid))
                run.cpus = {
                    "proxy": process_cpus(proxy.pid),
                    "upstream": process_cpus(upstream.pid),
                    "clients": process_cpus(os.getpid()),
                }
            finally:
                stop_process(proxy)
        finally:
            stop_process(upstream)
        logs = {"proxy_log_tail": log_tail(proxy_log), "upstream_log_tail": log_tail(upstream_log)}
    d, p = run.direct, run.proxy
    pairs = max(1, len(p.total))
    figures: dict[str, Any] = {
        "requests": len(p.total),
        "clients": args.clients,
        "mean_prompt_tokens": run.prompt_bytes / pairs / 4,
        "streamed": len(p.first_byte),
        "errors_direct": d.errors,
        "errors_proxy": p.errors,
        "failures_direct": d.failures,
        "failures_proxy": p.failures,
        **logs,
        "direct_p50_ms": percentile_ms(d.total, 50),
        "direct_p99_ms": percentile_ms(d.total, 99),
        "proxy_p50_ms": percentile_ms(p.total, 50),
        "proxy_p99_ms": percentile_ms(p.total, 99),
        "direct_ttfb_p50_ms": percentile_ms(d.first_byte, 50),
        "proxy_ttfb_p50_ms": percentile_ms(p.first_byte, 50),
        "proxy_cpu_ms_per_request": run.proxy_cpu_s * 1000.0 / pairs,
        "proxy_loop_cpu_ms_per_request": run.proxy_loop_cpu_s * 1000.0 / pairs,
        "proxy_switches_per_request": run.proxy_switches / pairs,
        "upstream_cpu_ms_per_request": run.upstream_cpu_s * 1000.0 / (2 * pairs),
        "client_cpu_ms_per_request": run.client_cpu_s * 1000.0 / (2 * pairs),
        "pointers_per_request": run.pointers / pairs,
        "tokens_removed_per_request": run.tokens_removed / pairs,
        "wall_s": run.wall_s,
        "rss_mb": run.rss,
        "conversations": run.conversations,
        "load_average_1min": os.getloadavg()[0],
        "cpus": os.cpu_count() or 0,
        "pinned": split is not None,
        "cpus_proxy": run.cpus["proxy"],
        "cpus_upstream": run.cpus["upstream"],
        "cpus_clients": run.cpus["clients"],
    }
    figures["added_p50_ms"] = figures["proxy_p50_ms"] - figures["direct_p50_ms"]
    figures["added_p99_ms"] = figures["proxy_p99_ms"] - figures["direct_p99_ms"]
    figures["added_ttfb_p50_ms"] = figures["proxy_ttfb_p50_ms"] - figures["direct_ttfb_p50_ms"]
    return figures


def report(figures: dict[str, Any]) -> None:
    def verdict(value: float, target: float) -> str:
        return "meets" if value <= target else "MISSES"

    print(
        f"{figures['requests']} requests through the proxy, each paired with the same request "
        f"straight to the upstream ({figures['streamed']} streamed), {figures['clients']} "
        f"concurrent clients, prompts of ~{figures['mean_prompt_tokens']:,.0f} tokens on average "
        f"(4 bytes a token); the planner sent {figures['pointers_per_request']:.1f} pointers and "
        f"removed {figures['tokens_removed_per_request']:,.0f} tokens per request"
    )
    print(
        f"load average (1 min) at the end: {figures['load_average_1min']:.2f} on "
        f"{figures['cpus']} CPUs; CPUs: proxy {figures['cpus_proxy']}, upstream "
        f"{figures['cpus_upstream']}, clients {figures['cpus_clients']}"
    )
    if figures["pinned"]:
        print(
            "the proxy is pinned apart: it waits for no CPU the clients or the upstream hold "
            "(other processes on the machine still take CPUs from both sides)"
        )
    else:
        print(
            "the clients, the proxy and the upstream share the CPUs, so the wall-clock figures "
            "include waits for a CPU; the proxy's CPU time per request does not"
        )
    errors = figures["errors_direct"] + figures["errors_proxy"]
    if errors:
        print(
            f"failed requests: {figures['errors_direct']} direct "
            f"{figures['failures_direct']}, {figures['errors_proxy']} proxy "
            f"{figures['failures_proxy']}"
        )
        for name in ("proxy", "upstream"):
            if figures[f"{name}_log_tail"]:
                print(f"{name} stderr (tail):\n{figures[f'{name}_log_tail']}")
    rows = [
        ("end-to-end, direct: p50 / p99",
         f"{figures['direct_p50_ms']:.2f} / {figures['direct_p99_ms']:.2f} ms", ""),
        ("end-to-end, proxy: p50 / p99",
         f"{figures['proxy_p50_ms']:.2f} / {figures['proxy_p99_ms']:.2f} ms", ""),
        ("added by the proxy: p50", f"{figures['added_p50_ms']:.2f} ms",
         f"<= {TARGET_P50_MS:g} ms: {verdict(figures['added_p50_ms'], TARGET_P50_MS)}"),
        ("added by the proxy: p99", f"{figures['added_p99_ms']:.2f} ms",
         f"<= {TARGET_P99_MS:g} ms: {verdict(figures['added_p99_ms'], TARGET_P99_MS)}"),
        ("streamed, first byte: direct / proxy p50",
         f"{figures['direct_ttfb_p50_ms']:.2f} / {figures['proxy_ttfb_p50_ms']:.2f} ms", ""),
        ("streamed, first byte added: p50", f"{figures['added_ttfb_p50_ms']:.2f} ms",
         f"<= {TARGET_TTFB_MS:g} ms: "
         f"{verdict(figures['added_ttfb_p50_ms'], TARGET_TTFB_MS)}"),
        ("proxy CPU time per request", f"{figures['proxy_cpu_ms_per_request']:.2f} ms", ""),
        ("  of which its event loop's thread",
         f"{figures['proxy_loop_cpu_ms_per_request']:.2f} ms", ""),
        ("  its threads' context switches per request",
         f"{figures['proxy_switches_per_request']:.1f}", ""),
        ("  (upstream / client, per request)",
         f"{figures['upstream_cpu_ms_per_request']:.2f} / "
         f"{figures['client_cpu_ms_per_request']:.2f} ms", ""),
    ]  # fmt: skip
    for after, mb in figures["rss_mb"]:
        label = "proxy RSS after the warm-up" if after == 0 else f"proxy RSS after {after:,}"
        rows.append((label, f"{mb:.1f} MiB", ""))
    (first, first_mb), (last, last_mb) = figures["rss_mb"][-2:]
    rows.append(
        (
            "  RSS growth per 1,000 requests, last interval",
            f"{(last_mb - first_mb) * 1000 / max(1, last - first):.1f} MiB",
            "bounded: flat once the planner's memory is full (LRU: 10,000 conversations, "
            "256 Mi characters)",
        )
    )
    rows.append(("  conversations opened", f"{figures['conversations']:,}", ""))
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>16}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>16}  {target}")
    print(f"measured window: {figures['wall_s']:.1f} s wall clock")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (64)")
    parser.add_argument(
        "--requests", type=int, help="measured requests through the proxy (8,000; --quick 300)"
    )
    parser.add_argument("--warmup", type=int, help="unmeasured pairs first (500; --quick 64)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=8_000, help="mean prompt size (8,000 tokens)"
    )
    parser.add_argument(
        "--think-ms",
        type=float,
        default=1_000.0,
        help="mean pause of a client between its pairs, exponential (default 1,000 ms; "
        "0: closed loop, the proxy saturated)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="300 requests after 64 (unless --requests / --warmup say), pauses <= 500 ms",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--answer-ms",
        type=float,
        default=0.0,
        help="how long the upstream takes before each answer (default 0: at once; more keeps "
        "more requests in flight, so more pooled connections open, as a real engine does)",
    )
    parser.add_argument(
        "--profile-proxy",
        metavar="FILE",
        help="profile the proxy (cProfile, its event loop's CPU time) into FILE (module docstring)",
    )
    parser.add_argument(
        "--cpus-proxy",
        metavar="LIST",
        help="run the proxy on these CPUs alone (0, 2,3 or 0-3; Linux) and the clients and the "
        "upstream on the others (module docstring)",
    )
    parser.add_argument(
        "--cpus-rest",
        metavar="LIST",
        help="with --cpus-proxy: the CPUs of the clients and the upstream (default: every "
        "other CPU)",
    )
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["--serve-proxy-profiled"] and len(given) >= 2:
        serve_proxy_profiled(given[1], given[2:])
        return 0
    args = parser.parse_args(given)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.answer_ms)
        return 0
    if args.requests is None:
        args.requests = 300 if args.quick else 8_000
    if args.warmup is None:
        args.warmup = 64 if args.quick else 500
    if args.quick:
        args.think_ms = min(args.think_ms, 500.0)
    for name in ("clients", "requests", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.think_ms < 0:
        parser.error(f"--think-ms must be at least 0, got {args.think_ms}")
    if args.answer_ms < 0:
        parser.error(f"--answer-ms must be at least 0, got {args.answer_ms}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    try:
        cpu_split(args.cpus_proxy, args.cpus_rest)
    except ValueError as error:
        parser.error(str(error))
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        report(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
