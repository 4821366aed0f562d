"""N vLLM CPU servers started and stopped together: the replicas behind a gateway.

Each replica is a :class:`~contextpilot_bench.vllm_instance.VllmCpuInstance` (its
own port, KV cache, KV-event endpoint and event watch). They start in parallel, each from a
thread of a pool kept alive until :meth:`VllmCpuFleet.stop`: a server dies with the thread that
forked it (``PR_SET_PDEATHSIG``, :mod:`~contextpilot_bench.testbed.process_group`), so a
pool that shut down after the start would take the servers with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any

from contextpilot_bench.vllm_metrics import WorkerCounters, read_worker_counters

if TYPE_CHECKING:
    from contextpilot_bench.engine_client import EngineClient
    from contextpilot_bench.vllm_instance import VllmCpuInstance

__all__ = ["VllmCpuFleet"]


class VllmCpuFleet:
    """``count`` vLLM CPU servers on loopback, each with ``num_gpu_blocks`` KV blocks.

    Use as a context manager; ``names`` are ``replica-0`` ... in start order.

    Args:
        model_dir: a prepared model directory.
        count: replicas (>= 1).
        block_size, num_gpu_blocks, max_model_len, stop_check, answer_tokens: per replica, as
            :class:`~contextpilot_bench.vllm_instance.VllmCpuInstance` takes them.
        server_args: more ``VllmCpuServer`` arguments (``vllm_python``, ``startup_timeout``).

    Raises:
        ValueError: ``count`` < 1.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        count: int,
        *,
        block_size: int,
        num_gpu_blocks: int | None,
        max_model_len: int,
        stop_check: Callable[[], None] | None = None,
        answer_tokens: int = 1,
        **server_args: Any,
    ) -> None:
        from contextpilot_bench.vllm_instance import VllmCpuInstance

        if count < 1:
            raise ValueError(f"a fleet needs at least one replica, got {count}")
        self.names = [f"replica-{i}" for i in range(count)]
        self.instances: list[VllmCpuInstance] = [
            VllmCpuInstance(
                model_dir,
                block_size=block_size,
                num_gpu_blocks=num_gpu_blocks,
                max_model_len=max_model_len,
                stop_check=stop_check,
                answer_tokens=answer_tokens,
                **server_args,
            )
            for _ in range(count)
        ]
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VllmCpuFleet:
        """Start every replica (in parallel) and wait until all answer.

        Raises:
            RuntimeError, TimeoutError: a replica did not start (the others are stopped).
        """
        self._pool = ThreadPoolExecutor(len(self.instances), thread_name_prefix="vllm-replica")
        futures = [self._pool.submit(instance.start) for instance in self.instances]
        try:
            for future in futures:
                future.result()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every replica (idempotent), then the pool their servers were started from."""
        try:
            for instance in self.instances:
                instance.stop()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> VllmCpuFleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ the replicas
    @property
    def urls(self) -> list[str]:
        """The servers' roots (``http://127.0.0.1:PORT``), in :attr:`names` order."""
        return [instance.server.base_url for instance in self.instances]

    @property
    def model_name(self) -> str:
        return self.instances[0].server.model_name

    @property
    def capacity_tokens(self) -> int | None:
        """Usable KV tokens of one replica (None: sized by the engine)."""
        return self.instances[0].model_capacity_tokens

    def replica_specs(self, **cache_sync: Any) -> list[dict[str, Any]]:
        """One :class:`~contextpilot_integrations.core.replicas.routing_config.ReplicaSpec`
        mapping per replica (name, ``base_url`` ``.../v1``, its KV events as ``cache_sync``,
        updated with ``cache_sync``), for a
        :class:`~contextpilot_integrations.core.replicas.routing.ReplicaRouter`."""
        return [
            {
                "name": name,
                "base_url": f"{instance.server.base_url}/v1",
                "cache_sync": {**instance.cache_sync, **cache_sync},
            }
            for name, instance in zip(self.names, self.instances, strict=True)
        ]

    def client_for(self, base_url: str) -> EngineClient:
        """The client of the replica whose root or ``/v1`` URL is ``base_url``.

        Raises:
            KeyError: no replica has it.
        """
        root = base_url.rstrip("/").removesuffix("/v1")
        for instance in self.instances:
            if instance.server.base_url == root and instance.client is not None:
                return instance.client
        raise KeyError(f"no replica at {base_url!r}")

    def reset(self) -> None:
        """Empty every replica's prefix cache (each waits for its ``AllBlocksCleared``)."""
        for instance in self.instances:
            instance.reset()

    def wait_for_events(self) -> bool:
        """Wait until every replica's KV-event watch is quiet; False if one was not in 15 s."""
        return all([instance.wait_for_events() for instance in self.instances])

    def counters(self) -> dict[str, WorkerCounters]:
        """Every replica's ``/metrics`` counters now, by name."""
        return {
            name: read_worker_counters(instance.server.base_url)
            for name, instance in zip(self.names, self.instances, strict=True)
        }

    def warm_up(self, prompts: Sequence[Sequence[Mapping[str, str]]]) -> float:
        """Warm every replica up on ``prompts`` (then reset); the seconds spent."""
        return sum(instance.warm_up(prompts) for instance in self.instances)
