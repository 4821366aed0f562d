"""End to end on the real vLLM CPU engine: ContextPilot against the baseline, the embedded model
against the engine, and the context index of an in-process ``ContextPilot(engine=EngineLink(...))``
following the engine's evictions through the core's engine link.

One server for the module (block size 32, a KV cache of four requests of ``max_model_len``
tokens, a tenth of what the slice's prompts take, so that every few requests evict), started
through :class:`VllmCpuInstance` and stopped at the module's end, also when a test fails (the
fixture's ``with``); its process group is checked to be gone. The methods run through the
benchmark's own runner (``run_method`` with ``VllmCpuEngine.on_emptied_cache``), as the CLI runs
them. The CLI tests start their own servers (a normal run, and a run stopped with Ctrl-C). All skip
without a Python that runs vLLM (``scripts/setup-vllm-env.sh``) or without the MultiHop-RAG
data.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.engine_marks import NEEDS_VLLM

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")

from contextpilot_bench.engine_report import EngineMethodReport  # noqa: E402
from contextpilot_bench.methods import (  # noqa: E402
    MethodResult,
    PreparedWorkload,
    run_method,
)
from contextpilot_bench.testbed.process_group import process_group_members  # noqa: E402
from contextpilot_bench.vllm_engine import VllmCpuEngine  # noqa: E402
from contextpilot_bench.vllm_instance import VllmCpuInstance  # noqa: E402
from support.data_dir import MULTIHOP_RAG, dataset_dir_or_skip  # noqa: E402
from support.vllm_workload import kv_cache_blocks, prepare_multihop  # noqa: E402

from contextpilot_integrations.core.pilot import ContextPilot  # noqa: E402
from contextpilot_integrations.sync.engine_link import EngineLink  # noqa: E402

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32
SLICE = 40  # MultiHop-RAG requests
TOP_K = 10
CACHE_REQUESTS = 4  # the KV cache holds this many requests of max_model_len tokens

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]


@pytest.fixture(scope="module")
def prepared(model_dir: Path) -> PreparedWorkload:
    return prepare_multihop(model_dir, SLICE, TOP_K)


@pytest.fixture(scope="module")
def bench(model_dir: Path, prepared: PreparedWorkload) -> Iterator[VllmCpuInstance]:
    """One real engine for the module; stopped (whole process group) at the module's end."""
    max_model_len, usable = kv_cache_blocks(model_dir, prepared, BLOCK_SIZE, CACHE_REQUESTS)
    with VllmCpuInstance(
        model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=usable + 1,
        max_model_len=max_model_len,
    ) as running:
        assert running.model_capacity_tokens == usable * BLOCK_SIZE
        pid = running.server.pid
        assert pid is not None and process_group_members(pid)
        yield running
    assert process_group_members(pid) == [], "server processes left after the module"


@dataclass
class EngineRun:
    """A method run through the benchmark's runner on the module's engine."""

    result: MethodResult
    engine: VllmCpuEngine
    report: EngineMethodReport


def _run(
    bench: VllmCpuInstance,
    method: str,
    prepared: PreparedWorkload,
    mode: str,
    pilot: ContextPilot | None = None,
) -> EngineRun:
    engines: list[VllmCpuEngine] = []

    def new_engine() -> VllmCpuEngine:
        engines.append(VllmCpuEngine.on_emptied_cache(bench, prepared.layout))
        return engines[-1]

    result = run_method(
        method,
        prepared,
        mode=mode,
        engine_factory=new_engine,
        pilot_factory=None if pilot is None else lambda: pilot,
        block_size=BLOCK_SIZE,
    )
    (engine,) = engines
    return EngineRun(result, engine, engine.report(method))


def test_contextpilot_gets_more_engine_cached_tokens_than_the_baseline(
    bench: VllmCpuInstance, prepared: PreparedWorkload
) -> None:
    base = _run(bench, "baseline", prepared, "offline")
    pilot = _run(bench, "contextpilot", prepared, "offline")
    for run in (base, pilot):
        # Same requests: every one of the slice, once.
        assert sorted(r.request_index for r in run.result.records) == list(range(SLICE))
        # What the engine prefilled is what was tokenised here (template and tokenizer).
        assert run.report.prompt_token_mismatches == 0
        assert all(r.cached_tokens is not None for r in run.engine.requests)
    # ContextPilot's prompts hold the same blocks, plus the order annotation after them.
    assert 1.0 <= pilot.report.prompt_tokens / base.report.prompt_tokens < 1.1
    assert pilot.report.cached_tokens > 2 * base.report.cached_tokens > 0
    # The engine did evict (a small cache), and the evictions reached the index of the pilot
    # the runner made with the engine's cache_sync (its engine link, pilot.stats()["sync"]).
    assert pilot.report.blocks_removed > 0
    assert pilot.report.evictions_applied is not None and pilot.report.evictions_applied > 0
    assert pilot.report.eviction_notices is not None
    assert pilot.report.evictions_applied <= pilot.report.eviction_notices
    sync = pilot.result.index["sync"]
    assert sync["cache_model"] == "kv-events" and sync["failures"] == {}
    assert sync["evictions"]["kv-events"] == pilot.report.evictions_applied
    assert pilot.report.index_requests == SLICE - pilot.report.evictions_applied
    assert pilot.result.index["requests"] == pilot.report.index_requests
    assert base.report.evictions_applied is None and base.report.index_requests is None
    # The paged model predicts the engine's cached tokens request by request.
    for run in (base, pilot):
        predicted = [r.model_cached_tokens for r in run.engine.requests]
        engine = [r.cached_tokens for r in run.engine.requests]
        assert predicted == engine, run.result.method


def _full_hit(tokens: int) -> int:
    """The engine's largest possible hit for a prompt of ``tokens`` tokens: whole blocks within
    the first ``tokens - 1`` (the last token is always recomputed)."""
    return (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_index_drops_exactly_the_requests_whose_blocks_the_engine_removed(
    bench: VllmCpuInstance, prepared: PreparedWorkload
) -> None:
    """The context index's view against the engine's answer, request by request.

    Online ContextPilot, in process with an engine link on the engine's KV events, through a
    cache of a few requests' blocks: each request's plan goes in the index, the engine's
    ``BlockRemoved`` events take requests out through the pilot's engine link. Then every
    request is re-sent, newest first, and before each re-send the index is asked whether it
    still holds that rid. The engine answers with ``cached_tokens``, decided before the re-send
    allocates anything, so it reflects the cache at the moment the index was asked:

    - held by the index: every full block of the prompt must still be cached, so the engine
      reports the largest possible hit, ``(tokens - 1) // 32 * 32``;
    - dropped: some block of the prompt's chain was removed, so the hit is smaller (the blocks
      before the first removed one, e.g. the system prompt and blocks shared with other
      requests, may still hit). A prompt whose length is a multiple of 32 is the exception:
      its last full block lies beyond the largest hit, so losing only that block drops the
      request without shrinking the hit; such requests are checked only when held.

    A re-send allocates blocks and evicts others; the pilot's link still follows the engine,
    and its events are applied to the index before the next question is asked
    (``wait_for_events``), so each check sees an index as current as the engine. The re-sends
    carry their own session ids, unknown to the index.
    """
    with ContextPilot(
        layout=prepared.layout,
        token_counter=prepared.counter,
        engine=EngineLink(bench.cache_sync),
    ) as pilot:
        assert pilot.engine is not None
        run = _run(bench, "contextpilot", prepared, "online", pilot)
        applied = run.report.evictions_applied
        assert applied is not None and applied > 0, "the cache was meant to be small to evict"
        requests = run.engine.requests
        # Online, the plans depend on the evictions; the paged model still follows the engine.
        assert [r.model_cached_tokens for r in requests] == [r.cached_tokens for r in requests]
        held, dropped, unchecked = [], [], []
        for request in reversed(requests):
            messages = run.engine.messages[request.rid]
            tokens = len(bench.server.tokenize(messages))
            assert bench.wait_for_events(pilot.engine)
            in_index = request.rid in pilot.index
            answer = bench.chat(messages, rid=f"probe-{request.rid}")
            assert answer.prompt_tokens == tokens
            if in_index:
                assert answer.cached_tokens == _full_hit(tokens), request.rid
                held.append(request.rid)
            elif tokens % BLOCK_SIZE:
                assert answer.cached_tokens < _full_hit(tokens), request.rid
                dropped.append(request.rid)
            else:
                unchecked.append(request.rid)
        assert pilot.stats()["sync"]["failures"] == {}
    assert not pilot.engine.source.subscriber.running  # type: ignore[attr-defined]
    logger.info(
        "re-sent %d requests: %d held (full hit), %d dropped (smaller hit), %d unchecked",
        len(requests),
        len(held),
        len(dropped),
        len(unchecked),
    )
    # Both sides of the check were exercised.
    assert len(held) >= 3 and len(dropped) >= 10, (held, dropped, unchecked)


def _run_cli(args: list[str], **popen: object) -> subprocess.Popen[str]:
    env = {**os.environ, "CONTEXTPILOT_DATA_DIR": str(dataset_dir_or_skip(MULTIHOP_RAG))}
    return subprocess.Popen(
        [sys.executable, "-m", "contextpilot_bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,  # type: ignore[call-overload]
    )


def _server_pid(stderr_line: str) -> int:
    # "vLLM CPU server ready in 27.0 s (pid 1234, http://127.0.0.1:PORT)"
    return int(stderr_line.split("(pid ", 1)[1].split(",", 1)[0])


@pytest.fixture
def own_model_dir(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the model directory (reused as is: same manifest), so that the CLI's server
    is told apart from the module's."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def test_cli_runs_the_workload_on_the_engine_and_stops_it(
    own_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    before = (own_model_dir / "tokenizer.json").stat().st_mtime_ns
    cli = _run_cli(
        [
            "--engine", "vllm-cpu", "--workload", "multihop-rag", "--limit", "8", "-k", "4",
            "--engine-model-dir", str(own_model_dir), "--no-plot", "--out", str(out),
        ]
    )  # fmt: skip
    stdout, stderr = cli.communicate(timeout=900)
    assert cli.returncode == 0, stderr[-3000:]
    ready = next(line for line in stderr.splitlines() if line.startswith("vLLM CPU server ready"))
    assert process_group_members(_server_pid(ready)) == []
    assert (own_model_dir / "tokenizer.json").stat().st_mtime_ns == before  # reused
    assert "engine vs embedded models" in stdout
    assert "model hit ratio" in stdout and "median TTFT" in stdout
    document = json.loads(out.read_text())
    reports = {r["method"]: r for r in document["run"]["engine_reports"]}
    assert set(reports) == {"baseline", "contextpilot", "clairvoyant-arrival"}
    assert reports["contextpilot"]["index_requests"] is not None
    assert reports["baseline"]["evictions_applied"] is None
    for report in reports.values():
        assert report["requests"] == 8
        assert report["prompt_token_mismatches"] == 0
        assert report["ttft_p50_s"] > 0 and report["prefill_tokens_per_s"] > 0
        assert report["model_cached_tokens"] == report["cached_tokens"]
    assert document["run"]["kv_cache"]["num_gpu_blocks"] >= document["run"]["max_model_len"] // 32
    assert document["summary"][0]["method"] == "baseline"


def test_ctrl_c_stops_the_engine(own_model_dir: Path) -> None:
    cli = _run_cli(
        [
            "--engine", "vllm-cpu", "--workload", "multihop-rag", "--limit", "200",
            "--engine-model-dir", str(own_model_dir), "--no-plot",
        ]
    )  # fmt: skip
    try:
        assert cli.stderr is not None
        lines = []
        for line in cli.stderr:
            lines.append(line)
            if line.startswith("vLLM CPU server ready"):
                break
        else:
            pytest.fail("the CLI exited before the server was ready:\n" + "".join(lines[-30:]))
        pid = _server_pid(lines[-1])
        time.sleep(3.0)  # requests in flight
        assert process_group_members(pid)
        cli.send_signal(signal.SIGINT)
        _, rest = cli.communicate(timeout=120)
        assert cli.returncode == 130, rest[-2000:]
        assert "interrupted; the engine was stopped" in rest
        assert process_group_members(pid) == []
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
