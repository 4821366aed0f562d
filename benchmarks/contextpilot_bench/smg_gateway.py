"""The Shepherd Model Gateway (``smg launch``) on loopback, in front of engine replicas.

:class:`SmgGateway` starts ``smg launch --host 127.0.0.1`` with one routing policy over the
workers' URLs, in its own process group (:mod:`~contextpilot_bench.testbed.process_group`),
waits until it serves the workers' models (``GET /v1/models`` lists one: every worker is
registered), and stops the whole group on exit, on errors and on Ctrl-C. The binary is found by
:func:`~contextpilot_bench.testbed.locations.require_smg` (``scripts/setup-smg-env.sh``).

With ``routing_header`` the gateway routes on that header (``--routing-key-headers NAME
--routing-key-override``): every request carrying one key goes to the worker the key was pinned
to when it first arrived (placed by ``--assignment-mode``); requests without the header follow
the policy. Facts and flags: docs/DESIGN.md, "The smg gateway".
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from contextpilot_bench.testbed.locations import require_smg
from contextpilot_bench.testbed.process_group import (
    free_port,
    start_in_own_group,
    stop_group,
    wait_until_ready,
)

__all__ = ["SMG_POLICIES", "SmgGateway"]

logger = logging.getLogger(__name__)

SMG_POLICIES = (
    "random",
    "round_robin",
    "cache_aware",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "prefix_hash",
)
"""The ``--policy`` values that route plain HTTP workers (``smg launch --help``)."""

ASSIGNMENT_MODES = ("random", "min_load", "min_group", "delegate")


class SmgGateway:
    """``smg launch`` on 127.0.0.1 over ``worker_urls`` with one policy.

    Use as a context manager::

        with SmgGateway(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                        policy="round_robin", routing_header="x-contextpilot-route") as gateway:
            httpx.post(f"{gateway.base_url}/v1/chat/completions", json=..., headers=...)

    Args:
        worker_urls: the workers' roots (``http://127.0.0.1:PORT``), at least one.
        policy: one of :data:`SMG_POLICIES`.
        routing_header: a header to route on (``--routing-key-headers`` with
            ``--routing-key-override``); None: the policy alone.
        assignment_mode: where a new routing key is pinned (``--assignment-mode``; None: smg's
            default, ``delegate`` = the policy's choice).
        cache_threshold: ``--cache-threshold`` of ``cache_aware`` (None: smg's default, 0.3).
        extra_args: more ``smg launch`` arguments, appended.
        binary: the ``smg`` binary (default
            :func:`~contextpilot_bench.testbed.locations.require_smg`).
        startup_timeout: seconds to wait until the workers are registered.
        stop_timeout: seconds between SIGTERM and SIGKILL.

    Attributes (after :meth:`start`): ``base_url``, ``port``, ``pid``, ``log_path``,
    ``startup_seconds``.

    Raises:
        ValueError: no worker, an unknown policy or assignment mode.
        FileNotFoundError: no ``smg`` binary.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        policy: str = "round_robin",
        routing_header: str | None = None,
        assignment_mode: str | None = None,
        cache_threshold: float | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if not worker_urls:
            raise ValueError("the gateway needs at least one worker URL")
        if policy not in SMG_POLICIES:
            raise ValueError(f"policy must be one of {SMG_POLICIES}, got {policy!r}")
        if assignment_mode is not None and assignment_mode not in ASSIGNMENT_MODES:
            raise ValueError(
                f"assignment_mode must be one of {ASSIGNMENT_MODES}, got {assignment_mode!r}"
            )
        self.worker_urls = [url.rstrip("/").removesuffix("/v1") for url in worker_urls]
        self.policy = policy
        self.routing_header = routing_header
        self.assignment_mode = assignment_mode
        self.cache_threshold = cache_threshold
        self.extra_args = tuple(extra_args)
        self.binary = require_smg(binary)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.port: int | None = None
        self.startup_seconds: float | None = None
        self._work_dir: Path | None = None
        self._log: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``, the OpenAI-compatible root.

        Raises:
            RuntimeError: not started.
        """
        if self.port is None:
            raise RuntimeError("the gateway has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The gateway's process id (its process group's id); None before the first start."""
        return self._pid

    @property
    def log_path(self) -> Path:
        if self._work_dir is None:
            raise RuntimeError("the gateway has not been started")
        return self._work_dir / "smg.log"

    def command(self, port: int, prometheus_port: int) -> list[str]:
        """The ``smg launch`` command line."""
        args = [
            str(self.binary),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus_port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            self.policy,
            "--backend",
            "vllm",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warn",
        ]
        if self.routing_header is not None:
            args += ["--routing-key-headers", self.routing_header, "--routing-key-override"]
        if self.assignment_mode is not None:
            args += ["--assignment-mode", self.assignment_mode]
        if self.cache_threshold is not None:
            args += ["--cache-threshold", str(self.cache_threshold)]
        return args + list(self.extra_args)

    def start(self) -> SmgGateway:
        """Start the gateway and wait until every worker is registered.

        Raises:
            RuntimeError: already running, or it exited during startup (with its log's tail).
            TimeoutError: not ready within ``startup_timeout`` (stopped; with its log's tail).
        """
        if self._process is not None:
            raise RuntimeError(f"gateway already started (pid {self._pid})")
        began = time.monotonic()
        self._work_dir = Path(tempfile.mkdtemp(prefix="smg-"))
        self.port = free_port()
        command = self.command(self.port, free_port())
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        logger.info("starting smg on %s: %s", self.base_url, " ".join(command))
        try:
            self._process = start_in_own_group(
                command, log=self._log, cwd=self._work_dir, env=_environment()
            )
            self._pid = self._process.pid
            atexit.register(self.stop)
            self._wait_ready(began)
        except BaseException:
            self.stop(remove_log=False)
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info("smg (%s) ready in %.1f s", self.policy, self.startup_seconds)
        return self

    def _wait_ready(self, began: float) -> None:
        assert self._process is not None
        with httpx.Client(timeout=5.0) as client:

            def registered() -> bool:
                with contextlib.suppress(httpx.TransportError, ValueError):
                    response = client.get(f"{self.base_url}/v1/models")
                    return response.status_code == 200 and bool(response.json().get("data"))
                return False

            wait_until_ready(
                self._process,
                registered,
                began=began,
                timeout_s=self.startup_timeout,
                name="smg",
                log_path=self.log_path,
                log_tail=self.log_tail,
            )

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the gateway's log ("" before start)."""
        if self._work_dir is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_bytes()[-32 * 1024 :].decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, remove_log: bool = True) -> None:
        """Stop the gateway's process group (idempotent); removes its log unless told not to."""
        atexit.unregister(self.stop)
        if self._process is not None:
            stop_group(self._process, self.stop_timeout)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if remove_log and self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self) -> SmgGateway:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"})
    return env
