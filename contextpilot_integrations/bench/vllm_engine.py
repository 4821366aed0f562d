"""``contextpilot-bench --engine vllm-cpu``: the benchmark on a real vLLM engine it runs itself.

What a run does (``run_vllm_cpu``):

1. Prepares the random-weights model directory once, with no download, and reuses it
   (:func:`ensure_model_dir`, default ``.cache/contextpilot/vllm-model`` in the repository;
   rebuilt when its manifest does not match the arguments, the Python version or the
   ``tokenizers`` version, so it is reproducible).
2. Retrieves the workload and counts block tokens with the model's own tokenizer
   (:class:`~contextpilot_integrations.core.blocks.TokenizerCounter`); the engine's prompts are
   the layout's chat messages, tokenised with the chat template exactly as the server applies
   it (:func:`~contextpilot_integrations.engines.vllm_cpu.tokenize_prompt`, checked against the
   server's ``/tokenize`` by the vllm test tier, and against ``usage.prompt_tokens`` on every
   request here).
3. Sizes the KV cache (:func:`size_kv_cache`): ``--engine-kv-tokens`` is a number of tokens or a
   fraction of the workload's unique block tokens, rounded up to whole blocks and raised, when
   smaller, to what one request of ``max_model_len`` tokens needs (the engine cannot schedule a
   request its cache cannot hold); vLLM gets ``--num-gpu-blocks-override`` = usable blocks + 1
   (vLLM's block pool reserves one null block, ``v1/core/block_pool.py``).
4. Starts :class:`~contextpilot_integrations.engines.vllm_cpu.VllmCpuServer` (eager mode,
   prefix caching, cached-token usage, KV events over ``ipc://``) and a
   :class:`~contextpilot_integrations.sync.kv_event_source.KVEventCacheState` subscribed to its
   events, warms the engine up, then runs each method on an emptied prefix cache
   (``POST /reset_prefix_cache``). The server, the subscriber and the HTTP client are stopped
   on normal exit, on errors, on Ctrl-C and on SIGTERM.

Per request (:class:`VllmCpuEngine`): the plan's rid goes out as ``session_id`` and
``request_id`` (vLLM echoes ``session_id`` on ``BlockStored``); the prompt's token ids are
registered with the event mirror (attribution by token matching, for a prompt whose blocks were
all cached already and so stores nothing); TTFT is measured by streaming; and the same token ids
are fed to two embedded prefix-cache models with the engine's block size and capacity: the paged
model (vLLM's block pool, :class:`~contextpilot_integrations.bench.prefix_cache_model.
PrefixCacheModel` with ``paged=True``) and the token-level radix model (SGLang-style, whole-node
eviction), to report what each predicts for the same stream.

During the ContextPilot method the event mirror's evictions go to ``pilot.evict`` (a
``BlockRemoved`` of any block of a request's chain drops that request from the context index;
:mod:`~contextpilot_integrations.sync.cache_mirror`).

Figures per method (:class:`EngineMethodReport`): the engine's hit ratio (``cached_tokens /
prompt_tokens`` from ``usage``), TTFT median and p90, prefill tokens per second (uncached prompt
tokens / TTFT, summed over requests), the models' predicted hit ratios and their relative error,
KV events received, blocks stored and removed, eviction notices and evictions applied.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import os
import re
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np

from contextpilot_integrations.bench.engine_client import EngineClient
from contextpilot_integrations.bench.methods import (
    MethodResult,
    PreparedWorkload,
    Served,
    parse_cache_tokens,
    prepare_workload,
    resolve_cache_tokens,
    run_method,
)
from contextpilot_integrations.bench.prefix_cache_model import PrefixCacheModel
from contextpilot_integrations.core.blocks import TokenizerCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.rendering import PromptLayout

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_KV_TOKENS",
    "DEFAULT_MODEL_DIR",
    "VLLM_ENGINE",
    "EngineMethodReport",
    "EngineRequest",
    "EvictionSink",
    "KVCacheSize",
    "StopSignals",
    "Terminated",
    "VllmCpuBench",
    "VllmCpuEngine",
    "add_vllm_arguments",
    "ensure_model_dir",
    "max_model_len_for",
    "run_vllm_cpu",
    "size_kv_cache",
]

logger = logging.getLogger(__name__)

VLLM_ENGINE = "vllm-cpu"
DEFAULT_BLOCK_SIZE = 32
DEFAULT_KV_TOKENS = "0.05"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "contextpilot" / "vllm-model"
MODEL_MANIFEST = "contextpilot_model.json"
ANSWER_TOKENS = 1  # prefill is what is measured
# A prompt this short (chat template included) fills no block of 32+ tokens: sending it
# publishes a pending AllBlocksCleared without storing anything.
_FLUSH_MESSAGES = ({"role": "user", "content": "ok"},)
_KV_SIZE_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


# --------------------------------------------------------------------------------------------
# Model directory and sizes
# --------------------------------------------------------------------------------------------


def _model_arguments(seed: int) -> dict[str, Any]:
    from contextpilot_integrations.engines.vllm_cpu import prepare_model_dir

    arguments = {
        name: parameter.default
        for name, parameter in inspect.signature(prepare_model_dir).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    arguments["seed"] = seed
    return arguments


def ensure_model_dir(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """The model directory for the benchmark, prepared once and reused.

    Reused when its manifest (``contextpilot_model.json``, written last by
    :func:`~contextpilot_integrations.engines.vllm_cpu.prepare_model_dir`) records the default
    shape with this ``seed``, this Python version (the tokenizer's training text is the standard
    library) and this ``tokenizers`` version; otherwise rewritten (about 10 s).

    Args:
        path: the directory (default :data:`DEFAULT_MODEL_DIR`).
        seed: the model directory's seed.

    Returns:
        The directory.
    """
    import tokenizers

    from contextpilot_integrations.engines.vllm_cpu import prepare_model_dir

    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    manifest_path = directory / MODEL_MANIFEST
    wanted = _model_arguments(seed)
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = {}
        if (
            manifest.get("arguments") == wanted
            and manifest.get("tokenizers_version") == tokenizers.__version__
            and manifest.get("corpus", {}).get("python") == sysconfig.get_python_version()
            and all((directory / name).is_file() for name in ("config.json", "tokenizer.json"))
        ):
            logger.info("reusing the model directory %s", directory)
            return directory
        logger.info("model directory %s is stale; rewriting it", directory)
        manifest_path.unlink()  # an interrupted rewrite must not look complete
    return prepare_model_dir(directory, seed=seed)


def max_model_len_for(
    prepared: PreparedWorkload, tokenizer: Any, block_size: int, max_positions: int
) -> tuple[int, int]:
    """``(max_model_len, longest prompt)`` for the workload on the engine.

    The longest prompt is the longest baseline prompt (chat template applied, model tokenizer);
    ContextPilot's prompts hold the same blocks plus an order annotation, whose tokens for
    ``k`` labels are added, with 16 tokens of slack and the answer token; the result is
    rounded up to whole blocks.

    Raises:
        ValueError: it exceeds the model's ``max_positions``.
    """
    from contextpilot_integrations.engines.vllm_cpu import tokenize_prompt

    layout = prepared.layout
    longest = 0
    for i, request in enumerate(prepared.workload.requests):
        messages = layout.render_messages(prepared.block_texts(i), request.query)
        longest = max(longest, len(tokenize_prompt(tokenizer, messages)))
    labels = [layout.label(i) for i in range(prepared.k)]
    annotation = len(tokenizer.encode(layout.annotation(labels), add_special_tokens=False).ids)
    needed = longest + annotation + 16 + ANSWER_TOKENS
    length = -(-needed // block_size) * block_size
    if length > max_positions:
        raise ValueError(
            f"the longest prompt needs max_model_len {length} tokens, more than the model's "
            f"max_position_embeddings {max_positions}; use a smaller --top-k"
        )
    return length, longest


@dataclass(frozen=True)
class KVCacheSize:
    """The engine's KV cache for a run.

    Attributes:
        spec: the ``--engine-kv-tokens`` text.
        block_size: tokens per KV block.
        requested_tokens: what the spec resolves to (None: unlimited, the engine's memory).
        usable_blocks: blocks the engine can fill (None: decided by the engine).
        raised_from_blocks: the requested block count when it was raised to hold one request
            of ``max_model_len`` tokens (None when not raised).
        unique_block_tokens: the workload's unique block tokens (model tokenizer).
    """

    spec: str
    block_size: int
    requested_tokens: int | None
    usable_blocks: int | None
    raised_from_blocks: int | None
    unique_block_tokens: int

    @property
    def num_gpu_blocks(self) -> int | None:
        """``--num-gpu-blocks-override``: usable blocks plus vLLM's null block."""
        return None if self.usable_blocks is None else self.usable_blocks + 1

    @property
    def usable_tokens(self) -> int | None:
        return None if self.usable_blocks is None else self.usable_blocks * self.block_size

    def describe(self) -> str:
        if self.usable_blocks is None:
            return "KV cache sized by the engine (VLLM_CPU_KVCACHE_SPACE)"
        text = f"KV cache {self.usable_blocks:,} blocks = {self.usable_tokens:,} tokens"
        fraction = _fraction(self.spec)
        if fraction is not None:
            text += (
                f" ({self.spec} of {self.unique_block_tokens:,} unique block tokens = "
                f"{self.requested_tokens:,} tokens"
            )
        else:
            text += f" (requested {self.requested_tokens:,} tokens"
        if self.raised_from_blocks is not None:
            text += (
                f", {self.raised_from_blocks:,} blocks, raised to hold one request of "
                "max_model_len tokens"
            )
        return text + ")"


def _fraction(spec: str) -> float | None:
    with contextlib.suppress(ValueError):
        value = parse_cache_tokens(spec)
        if isinstance(value, float):
            return value
    return None


def size_kv_cache(
    spec: str, unique_block_tokens: int, block_size: int, max_model_len: int
) -> KVCacheSize:
    """Resolve ``--engine-kv-tokens`` into whole blocks.

    Args:
        spec: an int (tokens), a decimal fraction of ``unique_block_tokens`` (``0.05``), or
            ``unlimited`` (the engine sizes its cache from its memory setting).
        unique_block_tokens: the workload's unique block tokens (model tokenizer).
        block_size: tokens per block.
        max_model_len: the engine's longest request; the cache holds at least one.

    Raises:
        ValueError: a bad ``spec`` (the message names ``--engine-kv-tokens`` and the value).
    """
    try:
        parsed = parse_cache_tokens(spec)
    except ValueError:
        raise ValueError(
            f"--engine-kv-tokens must be an int (tokens), a fraction such as 0.05, or "
            f"'unlimited'; got {spec!r}"
        ) from None
    if parsed is None:
        return KVCacheSize(spec, block_size, None, None, None, unique_block_tokens)
    requested = resolve_cache_tokens(parsed, unique_block_tokens)
    assert requested is not None
    blocks = -(-requested // block_size)
    minimum = -(-max_model_len // block_size)
    raised = blocks if blocks < minimum else None
    return KVCacheSize(
        spec, block_size, requested, max(blocks, minimum), raised, unique_block_tokens
    )


# --------------------------------------------------------------------------------------------
# The engine, per method
# --------------------------------------------------------------------------------------------


class EvictionSink:
    """``on_evict`` of the KV-event source: forwards each evicted rid to the pilot under test.

    ``pilot`` is set while the ContextPilot method runs (None otherwise: notices are counted
    only). Thread-safe: called on the subscriber's thread.

    Attributes:
        notices: rids the event mirror reported evicted.
        applied: notices for which ``pilot.evict`` returned True (the rid was in its index).
        applied_rids: those rids, in order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pilot: Any | None = None
        self.notices = 0
        self.applied = 0
        self.applied_rids: list[str] = []

    def __call__(self, rid: str) -> bool:
        pilot = self.pilot
        removed = bool(pilot.evict(rid)) if pilot is not None else False
        with self._lock:
            self.notices += 1
            if removed:
                self.applied += 1
                self.applied_rids.append(rid)
        return removed


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine and the models saw it.

    Attributes:
        rid: the plan's rid (sent as ``session_id`` and ``request_id``).
        prompt_tokens: the engine's ``usage.prompt_tokens``.
        local_prompt_tokens: the same prompt tokenised here (model tokenizer, chat template).
        cached_tokens: the engine's ``usage.prompt_tokens_details.cached_tokens`` (None: not
            reported).
        model_cached_tokens: the paged prefix-cache model's prediction.
        radix_cached_tokens: the token-level radix model's prediction.
        ttft_s: time to first token, seconds (streaming).
    """

    rid: str
    prompt_tokens: int
    local_prompt_tokens: int
    cached_tokens: int | None
    model_cached_tokens: int
    radix_cached_tokens: int
    ttft_s: float


class VllmCpuEngine:
    """The benchmark's :class:`~contextpilot_integrations.bench.methods.Engine` on a running
    :class:`VllmCpuBench`: chat requests, with the embedded models fed the same tokens.

    Evictions reach the pilot through the KV-event source (see :class:`EvictionSink`), so
    :meth:`take_evicted_rids` returns nothing.

    Args:
        bench: the running server, client and event source.
        layout: renders segments into chat messages.
    """

    def __init__(self, bench: VllmCpuBench, layout: PromptLayout) -> None:
        self.bench = bench
        self.layout = layout
        size, capacity = bench.block_size, bench.model_capacity_tokens
        self.model = PrefixCacheModel(capacity, block_size=size, paged=True)
        self.radix_model = PrefixCacheModel(capacity, block_size=size)
        self.requests: list[EngineRequest] = []
        self.messages: dict[str, list[dict[str, str]]] = {}  # rid -> the chat messages sent
        self.model_evicted_rids = 0
        self._warned_mismatch = False

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        messages = self.layout.messages_from_segments(segments)
        self.messages[rid] = messages
        token_ids = self.bench.server.tokenize(messages)
        self.bench.register(rid, token_ids)
        completion = self.bench.chat(messages, rid=rid)
        if completion.prompt_tokens != len(token_ids) and not self._warned_mismatch:
            self._warned_mismatch = True
            logger.warning(
                "rid %s: the engine counted %d prompt tokens, the local tokenizer %d; the "
                "models' predictions are for the local tokens",
                rid,
                completion.prompt_tokens,
                len(token_ids),
            )
        predicted = self.model.serve(token_ids, rid=rid)
        self.model_evicted_rids += len(self.model.take_evicted_rids())
        radix = self.radix_model.serve(token_ids)
        self.requests.append(
            EngineRequest(
                rid,
                completion.prompt_tokens,
                len(token_ids),
                completion.cached_tokens,
                predicted,
                radix,
                completion.ttft_s,
            )
        )
        return Served(completion.prompt_tokens, completion.cached_tokens, completion.ttft_s)

    def take_evicted_rids(self) -> list[str]:
        return []


@dataclass
class EngineMethodReport:
    """One method's figures on the real engine, beside the models' predictions.

    Token figures are prompt tokens; ratios are cached / prompt tokens. ``model_error`` is
    ``(model hit ratio - engine hit ratio) / engine hit ratio`` (None when the engine hit
    nothing). TTFT in seconds; ``prefill_tokens_per_s`` is the sum of uncached prompt tokens
    over the sum of TTFTs. Event figures count what arrived while the method ran: batches
    received, blocks stored and removed (mirror), eviction notices (rids the mirror evicted)
    and evictions applied (``pilot.evict`` returned True; ContextPilot only).
    """

    method: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    model_cached_tokens: int
    model_hit_ratio: float
    model_error: float | None
    model_exact_requests: int
    radix_cached_tokens: int
    radix_hit_ratio: float
    radix_error: float | None
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    prefill_tokens: int
    prefill_tokens_per_s: float
    prompt_token_mismatches: int
    event_batches: int
    blocks_stored: int
    blocks_removed: int
    eviction_notices: int
    evictions_applied: int
    model_evicted_rids: int
    index_requests: int | None = None
    seconds: float = 0.0

    @classmethod
    def build(
        cls,
        method: str,
        requests: Sequence[EngineRequest],
        events: Mapping[str, int],
        *,
        model_evicted_rids: int,
        index_requests: int | None,
        seconds: float,
    ) -> EngineMethodReport:
        prompt = sum(r.prompt_tokens for r in requests)
        cached = sum(r.cached_tokens or 0 for r in requests)
        local = sum(r.local_prompt_tokens for r in requests)
        model = sum(r.model_cached_tokens for r in requests)
        radix = sum(r.radix_cached_tokens for r in requests)
        hit = cached / prompt if prompt else 0.0
        model_hit = model / local if local else 0.0
        radix_hit = radix / local if local else 0.0
        ttfts = np.array([r.ttft_s for r in requests], dtype=float)
        prefill = prompt - cached
        return cls(
            method=method,
            requests=len(requests),
            prompt_tokens=prompt,
            cached_tokens=cached,
            hit_ratio=hit,
            model_cached_tokens=model,
            model_hit_ratio=model_hit,
            model_error=(model_hit - hit) / hit if hit else None,
            model_exact_requests=sum(r.model_cached_tokens == r.cached_tokens for r in requests),
            radix_cached_tokens=radix,
            radix_hit_ratio=radix_hit,
            radix_error=(radix_hit - hit) / hit if hit else None,
            ttft_mean_s=float(ttfts.mean()) if ttfts.size else math.nan,
            ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts.size else math.nan,
            ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts.size else math.nan,
            prefill_tokens=prefill,
            prefill_tokens_per_s=prefill / float(ttfts.sum()) if ttfts.size else math.nan,
            prompt_token_mismatches=sum(r.prompt_tokens != r.local_prompt_tokens for r in requests),
            event_batches=events["batches"],
            blocks_stored=events["stored"],
            blocks_removed=events["removed"],
            eviction_notices=events["notices"],
            evictions_applied=events["applied"],
            model_evicted_rids=model_evicted_rids,
            index_requests=index_requests,
            seconds=seconds,
        )


@dataclass
class EngineMethodRun:
    """A method's :class:`MethodResult` (the benchmark's common record), its engine report, its
    per-request engine view and the messages sent per rid; ``pilot`` is the ContextPilot of
    the run (None otherwise) and ``applied_rids`` the rids the engine's events evicted from
    its index, in order."""

    result: MethodResult
    report: EngineMethodReport
    requests: list[EngineRequest]
    messages: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    pilot: ContextPilot | None = None
    applied_rids: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Server, subscriber and client together
# --------------------------------------------------------------------------------------------


class VllmCpuBench:
    """A running vLLM CPU server with its KV-event source and HTTP client, for benchmarks.

    Use as a context manager; everything started is stopped on exit, on errors and on Ctrl-C
    (the server's whole process group, see
    :class:`~contextpilot_integrations.engines.vllm_cpu.VllmCpuServer`)::

        with VllmCpuBench(model_dir, block_size=32, num_gpu_blocks=80, max_model_len=2432) as b:
            run = b.run_method("contextpilot", prepared, mode="offline")

    Args:
        model_dir: from :func:`ensure_model_dir`.
        block_size: KV block size (a multiple of 32 on CPU).
        num_gpu_blocks: ``--num-gpu-blocks-override`` (None: sized by the engine's memory).
        max_model_len: the longest request, tokens.
        work_dir: the server's work directory (None: a temporary one).
        startup_timeout: seconds to wait for the server.
        stop_check: called before every request; raises to stop the run (see
            :class:`StopSignals`).
        server_args: more keyword arguments for ``VllmCpuServer``.

    Attributes (after start): ``server``, ``client``, ``events`` (the
    :class:`~contextpilot_integrations.sync.kv_event_source.KVEventCacheState`), ``evictions``
    (the :class:`EvictionSink`), ``model_capacity_tokens`` (usable KV tokens, the models'
    capacity; None when unknown).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 4096,
        work_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 300.0,
        stop_check: Callable[[], None] | None = None,
        **server_args: Any,
    ) -> None:
        from contextpilot_integrations.engines.vllm_cpu import VllmCpuServer

        self.block_size = block_size
        self.stop_check = stop_check
        self.server = VllmCpuServer(
            model_dir,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            work_dir=work_dir,
            startup_timeout=startup_timeout,
            **server_args,
        )
        self.evictions = EvictionSink()
        self.events: Any | None = None
        self.client: EngineClient | None = None
        self.model_capacity_tokens: int | None = (
            (num_gpu_blocks - 1) * block_size if num_gpu_blocks is not None else None
        )
        self._sequence = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> VllmCpuBench:
        """Start the server, then the event subscriber and the client.

        Raises:
            RuntimeError, TimeoutError: the server did not start (see ``VllmCpuServer.start``).
        """
        from contextpilot_integrations.sync.kv_event_source import KVEventCacheState

        self.server.start()
        try:
            self.events = KVEventCacheState(
                self.server.kv_events_endpoint,
                self.evictions,
                replay_endpoint=self.server.replay_endpoint,
                topic=self.server.kv_events_topic,
                page_size=self.block_size,
            )
            self.events.start()
            self.client = EngineClient(self.server.base_url, model=self.server.model_name)
            if self.model_capacity_tokens is None:
                self.model_capacity_tokens = self._engine_kv_tokens()
        except BaseException:
            self.stop()
            raise
        return self

    def _engine_kv_tokens(self) -> int | None:
        """Usable KV tokens from the server log (``KV cache size: N tokens``, null block off)."""
        found = _KV_SIZE_LOG.findall(self.server.log_tail(400))
        if not found:
            logger.warning("KV cache size not found in the server log; the models run unlimited")
            return None
        blocks = int(found[-1].replace(",", "")) // self.block_size
        return (blocks - 1) * self.block_size

    def stop(self) -> None:
        """Stop the subscriber, the client and the server (idempotent; each is tried)."""
        try:
            if self.events is not None:
                self.events.stop()
        finally:
            try:
                if self.client is not None:
                    self.client.close()
            finally:
                self.server.stop()

    def __enter__(self) -> VllmCpuBench:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- engine state -------------------------------------------------------------------------

    def _require_client(self) -> EngineClient:
        if self.client is None:
            raise RuntimeError("VllmCpuBench is not started (use start() or `with`)")
        return self.client

    def _next_id(self, prefix: str) -> str:
        self._sequence += 1
        return f"{prefix}-{os.getpid()}-{self._sequence}"

    def register(self, rid: str, token_ids: Sequence[int]) -> None:
        """Tell the KV-event source about a request: its prompt tokens, for attribution by
        token matching (blocks the engine already held store nothing, so carry no session)."""
        from contextpilot_integrations.sync.cache_state import SentRequest

        if self.events is not None:
            self.events.record(SentRequest(rid, token_ids=tuple(token_ids)))

    def chat(self, messages: Sequence[Mapping[str, str]], *, rid: str) -> Any:
        """One streamed chat request (prefill + 1 token) with ``rid`` as session_id.

        Raises:
            KeyboardInterrupt, Terminated: ``stop_check`` found a stop signal.
            EngineError: the engine failed the request.
        """
        if self.stop_check is not None:
            self.stop_check()
        return self._require_client().chat(
            [dict(m) for m in messages], rid=rid, max_tokens=ANSWER_TOKENS
        )

    def event_counters(self) -> dict[str, int]:
        """Cumulative counters: event batches received, blocks stored and removed (mirror),
        eviction notices and evictions applied."""
        if self.events is None:
            return {"batches": 0, "stored": 0, "removed": 0, "notices": 0, "applied": 0}
        stats = self.events.stats()
        return {
            "batches": int(stats["subscriber"]["received"]),
            "stored": int(stats["mirror"]["stored_blocks"]),
            "removed": int(stats["mirror"]["removed_blocks"]),
            "notices": self.evictions.notices,
            "applied": self.evictions.applied,
        }

    def wait_for_events(self, quiet_s: float = 0.4, timeout_s: float = 15.0) -> bool:
        """Wait until no KV-event batch has arrived for ``quiet_s`` seconds.

        vLLM publishes a step's events before it returns that step's output
        (``Scheduler.update_from_output``), so once a response is in and the stream has been
        quiet for a moment, the mirror (and the index it evicts from) reflects the engine.

        Returns:
            False if the stream did not go quiet within ``timeout_s``.
        """
        if self.events is None:
            return True
        deadline = time.monotonic() + timeout_s
        last: tuple[int, ...] | None = None
        since = time.monotonic()
        while True:
            stats = self.events.subscriber.stats()
            key = (stats["received"], stats["applied"], stats["replayed"])
            now = time.monotonic()
            if key != last:
                last, since = key, now
            elif now - since >= quiet_s:
                return True
            if now > deadline:
                return False
            time.sleep(0.05)

    def reset(self) -> None:
        """Empty the engine's prefix cache and let its ``AllBlocksCleared`` reach the mirror.

        vLLM publishes the clear with its next step, so a prompt too short to fill a block is
        sent to flush it; then the event stream is waited on.
        """
        self.server.reset_prefix_cache()
        self.chat(_FLUSH_MESSAGES, rid=self._next_id("flush"))
        self.wait_for_events()

    def warm_up(self, prompts: Sequence[Sequence[Mapping[str, str]]]) -> float:
        """Send ``prompts`` (twice each: cold, then cached) so that the first measured requests
        do not pay first-use costs; then reset. Returns the seconds spent."""
        began = time.perf_counter()
        for messages in prompts:
            for _ in range(2):
                self.chat(messages, rid=self._next_id("warmup"))
        self.reset()
        return time.perf_counter() - began

    # -- methods ------------------------------------------------------------------------------

    def run_method(
        self,
        method: str,
        prepared: PreparedWorkload,
        *,
        mode: str = "offline",
        progress: bool = False,
        pilot_factory: Callable[[], ContextPilot] | None = None,
    ) -> EngineMethodRun:
        """Run one method on an emptied cache, the models fed the same tokens.

        The prefix cache is reset first. For ``contextpilot`` the KV-event source's evictions
        go to the method's pilot (``pilot.evict``) while it runs. ``upper-bound`` does not use
        the engine (see :func:`~contextpilot_integrations.bench.methods.upper_bound_records`).

        Raises:
            ValueError: unknown method or mode.
            EngineError: the engine failed a request.
        """
        if method == "upper-bound":
            result = run_method(
                method, prepared, mode=mode, engine_factory=_no_engine, block_size=self.block_size
            )
            empty = EngineMethodReport.build(
                method,
                [],
                dict.fromkeys(("batches", "stored", "removed", "notices", "applied"), 0),
                model_evicted_rids=0,
                index_requests=None,
                seconds=0.0,
            )
            return EngineMethodRun(result, empty, [])
        self.reset()
        engine = VllmCpuEngine(self, prepared.layout)
        pilots: list[ContextPilot] = []

        def make_pilot() -> ContextPilot:
            pilot = (
                pilot_factory()
                if pilot_factory is not None
                else ContextPilot(layout=prepared.layout, token_counter=prepared.counter)
            )
            pilots.append(pilot)
            self.evictions.pilot = pilot
            return pilot

        before = self.event_counters()
        applied_before = len(self.evictions.applied_rids)
        began = time.perf_counter()
        try:
            result = run_method(
                method,
                prepared,
                mode=mode,
                engine_factory=lambda: engine,
                pilot_factory=make_pilot,
                block_size=self.block_size,
                progress=progress,
            )
            seconds = time.perf_counter() - began
            if not self.wait_for_events():
                logger.warning("KV events still arriving 15 s after %s; counting anyway", method)
        finally:
            self.evictions.pilot = None
        after = self.event_counters()
        pilot = pilots[0] if pilots else None
        if pilot is not None:
            result.index = pilot.stats()  # after the last evictions arrived
        report = EngineMethodReport.build(
            method,
            engine.requests,
            {key: after[key] - before[key] for key in after},
            model_evicted_rids=engine.model_evicted_rids,
            index_requests=len(pilot.index) if pilot is not None else None,
            seconds=seconds,
        )
        applied = self.evictions.applied_rids[applied_before:]
        return EngineMethodRun(
            result, report, engine.requests, engine.messages, pilot, list(applied)
        )


def _no_engine() -> Any:
    raise RuntimeError("the upper bound does not use an engine")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine`` and the ``--engine-*`` options of ``contextpilot-bench``."""
    group = parser.add_argument_group("real engine (--engine vllm-cpu)")
    group.add_argument(
        "--engine",
        choices=("embedded", VLLM_ENGINE),
        default="embedded",
        help="embedded: the prefix-cache model (or --engine-url); vllm-cpu: start vLLM's CPU "
        "build with random weights (.venv-vllm, scripts/setup-vllm-env.sh), run the workload "
        "through it and stop it",
    )
    group.add_argument(
        "--engine-kv-tokens",
        default=DEFAULT_KV_TOKENS,
        help="vllm-cpu KV cache: an int is tokens, a decimal a fraction of the workload's "
        "unique block tokens (model tokenizer), 'unlimited' the engine's memory; rounded up to "
        f"blocks, at least one request (default {DEFAULT_KV_TOKENS})",
    )
    group.add_argument(
        "--engine-model-dir",
        default=None,
        help=f"vllm-cpu model directory, prepared once (default {DEFAULT_MODEL_DIR})",
    )
    group.add_argument(
        "--engine-max-model-len",
        type=int,
        default=None,
        help="vllm-cpu max_model_len (default: the workload's longest prompt + annotation)",
    )
    group.add_argument(
        "--engine-startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the vllm-cpu server (default 300)",
    )


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def format_engine_table(reports: Sequence[EngineMethodReport]) -> str:
    """The engine-vs-model table, one row per method that ran on the engine."""
    columns = [
        ("method", lambda r: r.method),
        ("requests", lambda r: f"{r.requests:,}"),
        ("engine hit", lambda r: f"{r.hit_ratio:.4f}"),
        ("model hit", lambda r: f"{r.model_hit_ratio:.4f}"),
        ("model vs engine", lambda r: _fmt(r.model_error, "+.1%")),
        ("exact", lambda r: f"{r.model_exact_requests}/{r.requests}"),
        ("radix model hit", lambda r: f"{r.radix_hit_ratio:.4f}"),
        ("TTFT p50 s", lambda r: _fmt(r.ttft_p50_s, ".3f")),
        ("TTFT p90 s", lambda r: _fmt(r.ttft_p90_s, ".3f")),
        ("prefill tok/s", lambda r: _fmt(r.prefill_tokens_per_s, ",.0f")),
        ("KV batches", lambda r: f"{r.event_batches:,}"),
        ("stored/removed", lambda r: f"{r.blocks_stored:,}/{r.blocks_removed:,}"),
        ("evictions applied", lambda r: f"{r.evictions_applied:,}/{r.eviction_notices:,}"),
    ]
    cells = [[str(get(r)) for _, get in columns] for r in reports]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _) in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            [values[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(values[1:], widths[1:]))]
        )

    return "\n".join(
        [line([t for t, _ in columns]), "  ".join("-" * w for w in widths), *map(line, cells)]
    )


def target_lines(reports: Sequence[EngineMethodReport], k: int, kv: KVCacheSize) -> list[str]:
    """The issue's targets, judged on this run (they are set for k=10 and a 5% KV cache)."""
    by_name = {r.method: r for r in reports}
    base, pilot = by_name.get("baseline"), by_name.get("contextpilot")
    lines = []
    applies = k == 10 and kv.spec.strip() in ("0.05", ".05")
    note = "" if applies else "the targets are set for k=10 and --engine-kv-tokens 0.05"
    if base is not None and pilot is not None:
        if base.hit_ratio:
            gain = pilot.hit_ratio / base.hit_ratio
            verdict = "ok" if gain >= 3 else "MISSED"
            lines.append(
                f"engine hit ratio, contextpilot / baseline: {gain:.2f}x (>= 3x: {verdict})"
            )
        else:
            lines.append("engine hit ratio: the baseline hit nothing")
        if pilot.ttft_p50_s > 0:
            speedup = base.ttft_p50_s / pilot.ttft_p50_s
            verdict = "ok" if speedup >= 1.5 else "MISSED"
            lines.append(
                f"median TTFT, baseline / contextpilot: {speedup:.2f}x lower "
                f"({base.ttft_p50_s:.3f} s -> {pilot.ttft_p50_s:.3f} s) (>= 1.5x: {verdict})"
            )
    for r in reports:
        if r.requests and r.model_error is not None:
            verdict = "ok" if abs(r.model_error) <= 0.15 else "MISSED"
            lines.append(
                f"{r.method}: model hit ratio {r.model_hit_ratio:.4f} vs engine "
                f"{r.hit_ratio:.4f}: {r.model_error:+.1%} (within 15%: {verdict}); "
                f"token-level radix model {r.radix_hit_ratio:.4f} "
                f"({_fmt(r.radix_error, '+.1%')})"
            )
    if note and lines:
        lines.append(note)
    return lines


class Terminated(BaseException):
    """SIGTERM arrived during a run: unwind (like KeyboardInterrupt) so the server is stopped."""


class StopSignals:
    """SIGINT and SIGTERM during a benchmark run, made reliable.

    The first signal raises ``KeyboardInterrupt`` (SIGINT) or :class:`Terminated` (SIGTERM)
    at once. Python reports an exception raised while a generator is being finalised as
    "ignored" (httpx's streaming generators are closed that way), so the raise can be lost;
    the signal is therefore also recorded, and :meth:`check`, called before every request,
    raises again. Later signals are only recorded, so that stopping the server is not cut
    short. Installed in the main thread only (elsewhere a no-op).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def check(self) -> None:
        """Raise if a stop signal arrived."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise Terminated

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = signum
        if first:
            self.check()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def run_vllm_cpu(args: argparse.Namespace, methods: Sequence[str]) -> int:
    """``contextpilot-bench --engine vllm-cpu``: returns the exit code (130 on Ctrl-C, 143 on
    SIGTERM; the engine is stopped either way).

    Raises:
        ValueError: arguments that do not apply (``--engine-url``, ``--cache-tokens``, a
            multi-turn workload, a block size that is not a multiple of 32), bad sizes.
        FileNotFoundError: no vLLM environment or no dataset.
        EngineError: the engine failed a request.
    """
    try:
        with StopSignals() as stop:
            return _run(args, methods, stop)
    except KeyboardInterrupt:
        print("contextpilot-bench: interrupted; the engine was stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("contextpilot-bench: terminated; the engine was stopped", file=sys.stderr)
        return 143


def _run(args: argparse.Namespace, methods: Sequence[str], stop: StopSignals) -> int:
    from tokenizers import Tokenizer

    from contextpilot_integrations.bench.multiturn import MULTITURN_WORKLOADS
    from contextpilot_integrations.bench.report import format_table, plot_results, summarize
    from contextpilot_integrations.bench.report import write_json as write_results
    from contextpilot_integrations.bench.workloads import load_workload
    from contextpilot_integrations.engines.vllm_cpu import find_vllm_python

    if args.engine_url:
        raise ValueError("--engine vllm-cpu starts its own server; drop --engine-url")
    if args.cache_tokens is not None:
        raise ValueError(
            "--cache-tokens sizes the embedded model; with --engine vllm-cpu use "
            "--engine-kv-tokens (the models follow the engine's size)"
        )
    if args.workload in MULTITURN_WORKLOADS:
        raise ValueError(f"--engine vllm-cpu does not run the multi-turn workload {args.workload}")
    block_size = args.block_size
    if block_size <= 0 or block_size % 32:
        raise ValueError(
            f"--block-size must be a positive multiple of 32 on vLLM CPU, got {block_size}"
        )
    if find_vllm_python() is None:
        raise FileNotFoundError(
            "no vLLM environment: run scripts/setup-vllm-env.sh (makes .venv-vllm) or set "
            "CONTEXTPILOT_VLLM_PYTHON"
        )
    began = time.perf_counter()
    load_start = os.getloadavg()
    model_dir = ensure_model_dir(args.engine_model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    counter = TokenizerCounter(tokenizer)
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    if args.retriever == "mem0":
        from contextpilot_integrations.bench.mem0_workload import prepare_mem0_workload

        prepared = prepare_mem0_workload(
            workload, args.k, counter=counter, store_dir=args.mem0_store, progress=progress
        )
    else:
        prepared = prepare_workload(workload, args.k, counter=counter)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    auto_len, longest = max_model_len_for(
        prepared, tokenizer, block_size, int(config["max_position_embeddings"])
    )
    max_model_len = args.engine_max_model_len or auto_len
    kv = size_kv_cache(
        args.engine_kv_tokens, prepared.unique_block_tokens, block_size, max_model_len
    )
    shape = f"{config['num_hidden_layers']}-layer/{config['hidden_size']} Llama, random weights"
    engine_line = (
        f"engine: vLLM CPU ({VLLM_ENGINE}), model {model_dir} ({shape}), block size "
        f"{block_size}, {kv.describe()}, max_model_len {max_model_len:,} (longest prompt "
        f"{longest:,})"
    )
    run: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "documents": len(workload.corpus),
        "k": args.k,
        "retriever": args.retriever,
        "mode": args.mode,
        "methods": list(methods),
        "engine": VLLM_ENGINE,
        "model_dir": str(model_dir),
        "model": shape,
        "token_counter": f"model tokenizer {model_dir / 'tokenizer.json'}",
        "unique_block_tokens": prepared.unique_block_tokens,
        "block_size": block_size,
        "kv_cache": {**asdict(kv), "num_gpu_blocks": kv.num_gpu_blocks},
        "max_model_len": max_model_len,
        "longest_prompt_tokens": longest,
        "cores": os.cpu_count(),
        "load_average_start": load_start,
    }
    runs: list[EngineMethodRun] = []
    with VllmCpuBench(
        model_dir,
        block_size=block_size,
        num_gpu_blocks=kv.num_gpu_blocks,
        max_model_len=max_model_len,
        startup_timeout=args.engine_startup_timeout,
        stop_check=stop.check,
    ) as bench:
        print(
            f"vLLM CPU server ready in {bench.server.startup_seconds:.1f} s "
            f"(pid {bench.server.pid}, {bench.server.base_url})",
            file=sys.stderr,
            flush=True,
        )
        warm = [
            prepared.layout.render_messages(prepared.block_texts(i), r.query)
            for i, r in enumerate(workload.requests[:2])
        ]
        run["warm_up_seconds"] = round(bench.warm_up(warm), 3)
        run["startup_seconds"] = round(bench.server.startup_seconds or 0.0, 3)
        run["model_capacity_tokens"] = bench.model_capacity_tokens
        for method in methods:
            runs.append(bench.run_method(method, prepared, mode=args.mode, progress=progress))
            logger.info("%s done in %.1f s", method, runs[-1].report.seconds)
    run["seconds"] = round(time.perf_counter() - began, 3)
    run["load_average_end"] = os.getloadavg()
    results = [r.result for r in runs]
    reports = [r.report for r in runs if r.result.method != "upper-bound"]
    run["engine_reports"] = [asdict(r) for r in reports]
    run["engine_requests"] = {
        r.result.method: [asdict(x) for x in r.requests] for r in runs if r.requests
    }

    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, "
        f"{len(workload.corpus):,} documents, {args.retriever} top-{args.k}, mode {args.mode}"
    )
    print(engine_line)
    print(
        "prompts: chat messages, tokenised with the model's tokenizer and chat template "
        f"(as the server does); load average {load_start[0]:.2f} at start, "
        f"{run['load_average_end'][0]:.2f} at end, {os.cpu_count()} cores; "
        f"{run['seconds']:.0f} s in all"
    )
    print()
    print(format_table(summarize(results)))
    print()
    print(
        "engine vs embedded models on the same requests and tokens (model: paged prefix-cache "
        "model, vLLM's block pool, with the engine's block size and capacity; radix model: the "
        "token-level radix tree with whole-node eviction)"
    )
    print(format_engine_table(reports))
    print()
    for line in target_lines(reports, args.k, kv):
        print(line)
    for r in runs:
        if r.result.method == "contextpilot":
            per_request = 1000 * r.result.plan_seconds / max(len(r.result.records), 1)
            print(
                f"contextpilot planning: {r.result.plan_seconds:.3f} s ({per_request:.3f} "
                f"ms/request); index holds {r.report.index_requests:,} of "
                f"{r.report.requests:,} requests after {r.report.evictions_applied:,} "
                f"evictions from the engine's KV events"
            )
    if args.out:
        print(f"wrote {write_results(args.out, run, results)}")
    if not args.no_plot:
        plot_path = args.plot or f"results/{workload.name}-{args.mode}-{VLLM_ENGINE}.png"
        title = f"{workload.name}, {args.mode}, k={args.k}, vLLM CPU, {kv.describe()}"
        print(f"wrote {plot_results(plot_path, results, title)}")
    return 0
