"""One running vLLM CPU server for the benchmark: the server, its HTTP client and a watch on its
KV-cache events, started and stopped together.

The watch is the core's engine link
(:class:`~contextpilot_integrations.sync.engine_link.EngineLink`) on the server's events,
evicting nothing: it counts what the engine stored and removed for the reports and tells when
the event stream has gone quiet. A planner under test follows the same events through its own
link (``ContextPilot(engine=EngineLink(instance.cache_sync))``). Everything started is stopped
on exit, on errors and on Ctrl-C (the server's whole process group,
:class:`~contextpilot_bench.testbed.vllm_server.VllmCpuServer`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from contextpilot_bench.engine_client import Completion, EngineClient
from contextpilot_bench.kv_cache_size import ANSWER_TOKENS

if TYPE_CHECKING:
    from contextpilot_integrations.sync.engine_link import EngineLink

__all__ = ["VllmCpuInstance"]

logger = logging.getLogger(__name__)

# A prompt this short (chat template included) fills no block of 32+ tokens: sending it, with
# one token generated, publishes a pending AllBlocksCleared without storing anything. The empty
# system message keeps a template that adds a default system prompt (SmolLM2's) from doing so.
_FLUSH_MESSAGES = ({"role": "system", "content": ""}, {"role": "user", "content": "ok"})
_KV_SIZE_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


def _evicts_nothing(rid: str) -> bool:
    return False


class VllmCpuInstance:
    """A running vLLM CPU server with its HTTP client and KV-event watch, for benchmarks.

    Use as a context manager::

        with VllmCpuInstance(model_dir, block_size=32, num_gpu_blocks=80,
                             max_model_len=2432) as instance:
            instance.reset()   # an emptied prefix cache

    Args:
        model_dir: from :func:`~contextpilot_bench.testbed.model_dir.ensure_model_dir`.
        block_size: KV block size (a multiple of 32 on CPU).
        num_gpu_blocks: ``--num-gpu-blocks-override`` (None: sized by the engine's memory).
        max_model_len: the longest request, tokens.
        stop_check: called before every request; raises to stop the run
            (:class:`~contextpilot_bench.testbed.stop_signals.StopSignals`).
        answer_tokens: ``max_tokens`` of every request (greedy): 1 measures prefill; a real
            model's answers need more.
        server_args: more keyword arguments for ``VllmCpuServer`` (``vllm_python``,
            ``work_dir``, ``startup_timeout``, ...).

    Attributes (after start): ``server``, ``client``, ``watch`` (the engine link that only
    watches), ``model_capacity_tokens`` (usable KV tokens, the embedded models' capacity; None
    when unknown).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        block_size: int,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 4096,
        stop_check: Callable[[], None] | None = None,
        answer_tokens: int = ANSWER_TOKENS,
        **server_args: Any,
    ) -> None:
        from contextpilot_bench.testbed.vllm_server import VllmCpuServer

        if answer_tokens < 1:
            raise ValueError(f"answer_tokens must be >= 1, got {answer_tokens}")
        self.block_size = block_size
        self.stop_check = stop_check
        self.answer_tokens = answer_tokens
        self.server = VllmCpuServer(
            model_dir,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            **server_args,
        )
        self.watch: EngineLink | None = None
        self.client: EngineClient | None = None
        self.model_capacity_tokens: int | None = (
            (num_gpu_blocks - 1) * block_size if num_gpu_blocks is not None else None
        )
        self._sequence = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VllmCpuInstance:
        """Start the server, then the watch and the client.

        Raises:
            RuntimeError, TimeoutError: the server did not start (see ``VllmCpuServer.start``).
        """
        from contextpilot_integrations.sync.engine_link import EngineLink

        self.server.start()
        try:
            self.watch = EngineLink(self.cache_sync).bind(_evicts_nothing).start()
            self.client = EngineClient(self.server.base_url, model=self.server.model_name)
            if self.model_capacity_tokens is None:
                self.model_capacity_tokens = self._engine_kv_tokens()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the watch, the client and the server (idempotent; each is tried)."""
        try:
            if self.watch is not None:
                self.watch.stop()
        finally:
            try:
                if self.client is not None:
                    self.client.close()
            finally:
                self.server.stop()

    def __enter__(self) -> VllmCpuInstance:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _engine_kv_tokens(self) -> int | None:
        """Usable KV tokens from the server log (``KV cache size: N tokens``, null block off)."""
        found = _KV_SIZE_LOG.findall(self.server.log_tail(400))
        if not found:
            logger.warning("KV cache size not found in the server log; the models run unlimited")
            return None
        blocks = int(found[-1].replace(",", "")) // self.block_size
        return (blocks - 1) * self.block_size

    # ------------------------------------------------------------------ requests
    @property
    def cache_sync(self) -> dict[str, Any]:
        """``EngineLink(...)`` for this server (its KV events)."""
        return self.server.cache_sync

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        rid: str,
        max_tokens: int | None = None,
        token_ids: bool = False,
    ) -> Completion:
        """One streamed chat request under ``rid``, greedy, ``max_tokens`` tokens at most
        (default ``answer_tokens``); ``token_ids``: with the generated ids.

        Raises:
            RuntimeError: not started.
            KeyboardInterrupt, Terminated: ``stop_check`` found a stop signal.
            EngineError: the engine failed the request.
        """
        if self.client is None:
            raise RuntimeError("VllmCpuInstance is not started (use start() or `with`)")
        if self.stop_check is not None:
            self.stop_check()
        tokens = self.answer_tokens if max_tokens is None else max_tokens
        return self.client.chat(
            [dict(m) for m in messages], rid=rid, max_tokens=tokens, token_ids=token_ids
        )

    def _next_id(self, prefix: str) -> str:
        self._sequence += 1
        return f"{prefix}-{os.getpid()}-{self._sequence}"

    def reset(self) -> None:
        """Empty the engine's prefix cache and wait until its ``AllBlocksCleared`` has arrived.

        vLLM publishes the clear with its next step, so a prompt too short to fill a block is
        sent to flush it.
        """
        self.server.reset_prefix_cache()
        self.chat(_FLUSH_MESSAGES, rid=self._next_id("flush"), max_tokens=1)
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

    # ------------------------------------------------------------------ events
    def event_counters(self) -> dict[str, int]:
        """Cumulative counters of the watch: event batches received, blocks stored and
        removed."""
        if self.watch is None:
            return {"batches": 0, "stored": 0, "removed": 0}
        source = self.watch.stats()["source"]
        return {
            "batches": int(source["subscriber"]["received"]),
            "stored": int(source["mirror"]["stored_blocks"]),
            "removed": int(source["mirror"]["removed_blocks"]),
        }

    def wait_for_events(
        self, *links: EngineLink, quiet_s: float = 0.4, timeout_s: float = 15.0
    ) -> bool:
        """Wait until the watch and each of ``links`` has joined the event stream and no batch
        has arrived at any of them for ``quiet_s`` seconds.

        vLLM publishes a step's events before it returns that step's output
        (``Scheduler.update_from_output``), so once a response is in and the stream has been
        quiet for a moment, a link's mirror (and the index it evicts from) reflects the
        engine. A link started after the engine published (a planner made for one method)
        joins by replaying the engine's buffered events.

        Returns:
            False if that did not happen within ``timeout_s``.
        """
        followers = [link for link in (self.watch, *links) if link is not None]
        deadline = time.monotonic() + timeout_s
        last: tuple[Any, ...] | None = None
        since = time.monotonic()
        while True:
            states = [link.stats()["source"]["subscriber"] for link in followers]
            key = tuple((s["received"], s["applied"], s["replayed"]) for s in states)
            joined = all(all(s["joined"]) for s in states)
            now = time.monotonic()
            if key != last or not joined:
                last, since = key, now
            elif now - since >= quiet_s:
                return True
            if now > deadline:
                return False
            time.sleep(0.05)
