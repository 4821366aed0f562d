"""vLLM's CPU build as an OpenAI-compatible server with prefix caching and KV-cache events.

:class:`VllmCpuServer` starts ``vllm.entrypoints.openai.api_server`` with the Python that runs
vLLM (:func:`~contextpilot_bench.testbed.locations.find_vllm_python`: an argument,
``$CONTEXTPILOT_VLLM_PYTHON``, the source checkout's ``.venv-vllm`` or the running interpreter)
on a model directory (random weights, :mod:`~contextpilot_bench.testbed.model_dir`,
or real ones, :mod:`~contextpilot_bench.testbed.smollm2`), with prefix
caching, cached-token usage and KV-cache events over ``ipc://``, waits until it answers, and
stops its whole process group (:mod:`~contextpilot_bench.testbed.process_group`) on
exit, on errors and on Ctrl-C. Flags and traps: docs/DESIGN.md, "vLLM on a CPU".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from contextpilot_bench.testbed.locations import require_vllm_python
from contextpilot_bench.testbed.model_chat import ModelChat
from contextpilot_bench.testbed.process_group import (
    free_port,
    start_in_own_group,
    stop_group,
    wait_until_ready,
)

__all__ = ["VllmCpuServer"]

logger = logging.getLogger(__name__)


class VllmCpuServer:
    """A vLLM OpenAI-compatible server on the CPU, KV events over ``ipc://``.

    Use as a context manager::

        with VllmCpuServer(model_dir, block_size=32, num_gpu_blocks=200) as server:
            httpx.post(f"{server.base_url}/v1/chat/completions", json={...,
                       "session_id": plan.rid})

    Flags (docs/DESIGN.md, "vLLM on a CPU"; a real model: docs/DESIGN.md,
    "SmolLM2-135M-Instruct"): ``--load-format dummy`` (or ``auto``), ``--dtype
    bfloat16 --enable-prefix-caching --enforce-eager --enable-prompt-tokens-details``,
    ``--kv-events-config`` with a ZMQ publisher on ``ipc://<work_dir>/kv-events.ipc`` (topic
    ``kv-events``) and a replay ROUTER on ``ipc://<work_dir>/kv-replay.ipc``. Environment:
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``OMP_NUM_THREADS``, ``VLLM_CACHE_ROOT`` inside the work
    dir, ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``), offline Hugging Face hub.

    The server runs in its own process group (session); :meth:`stop` sends SIGTERM to the whole
    group, waits ``stop_timeout`` seconds, then SIGKILLs what is left. It runs on normal exit,
    on exceptions, on Ctrl-C (also during startup) and at interpreter exit; on Linux the server
    also gets SIGTERM if the starting process is killed outright (``PR_SET_PDEATHSIG``).

    Attributes (valid after :meth:`start`): ``base_url`` (``http://127.0.0.1:PORT``),
    ``kv_events_endpoint``, ``replay_endpoint``, ``kv_events_topic``, ``cache_sync``, ``model_dir``,
    ``model_name`` (the served model name to put in requests), ``chat`` (the model's tokenizer
    and chat template, :class:`~contextpilot_bench.testbed.model_chat.ModelChat`),
    ``tokenizer`` (its ``tokenizers.Tokenizer``), ``block_size``, ``log_path``, ``pid``.
    """

    kv_events_topic = "kv-events"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        block_size: int = 128,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 4096,
        kv_cache_space_gib: int = 1,
        omp_threads: int = 2,
        port: int | None = None,
        seed: int = 0,
        model_name: str | None = None,
        work_dir: str | os.PathLike[str] | None = None,
        vllm_python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 240.0,
        stop_timeout: float = 20.0,
        extra_args: Sequence[str] = (),
        load_format: str = "dummy",
    ) -> None:
        """Configure (nothing starts until :meth:`start` or ``with``).

        Args:
            model_dir: a directory from
                :func:`~contextpilot_bench.testbed.model_dir.prepare_model_dir`
                (``config.json`` and ``tokenizer.json`` required).
            block_size: KV block size in tokens; vLLM's CPU backend needs a multiple of 32.
            num_gpu_blocks: fix the number of KV blocks (``--num-gpu-blocks-override``), for a
                small cache that evicts; None sizes it from ``kv_cache_space_gib``.
            max_model_len: longest prompt + output, in tokens.
            kv_cache_space_gib: ``VLLM_CPU_KVCACHE_SPACE``, whole GiB.
            omp_threads: ``OMP_NUM_THREADS`` for the engine processes. vLLM 0.32's CPU worker
                binds its own OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=auto``: every core
                but one, which is left to the scheduler; on 2 cores, 1 thread on core 0) and
                then sets its own thread count; ``VLLM_CPU_OMP_THREADS_BIND=nobind`` in the
                caller's environment makes it use ``omp_threads`` unpinned instead.
            port: HTTP port on 127.0.0.1; None picks a free one.
            seed: ``--seed`` (the dummy weights).
            model_name: served model name; default the directory's name.
            work_dir: where the log, the IPC sockets and vLLM's cache go; None makes a
                temporary directory that :meth:`stop` removes (kept if startup fails, for the
                log). IPC socket paths must stay under 100 bytes.
            vllm_python: the Python that runs vLLM; default
                :func:`~contextpilot_bench.testbed.locations.find_vllm_python`'s
                (``$CONTEXTPILOT_VLLM_PYTHON``, else the source checkout's ``.venv-vllm``, else
                the running interpreter when it has vllm).
            startup_timeout: seconds to wait for ``/health``.
            stop_timeout: seconds between SIGTERM and SIGKILL.
            extra_args: more ``api_server`` arguments, appended.
            load_format: ``--load-format``: ``"dummy"`` (random weights, the default) or
                ``"auto"`` (the directory's safetensors, a real model).

        Raises:
            ValueError: a bad size (block size not a positive multiple of 32, a cache smaller
                than ``max_model_len``, ...), or a work dir too long for IPC paths.
            FileNotFoundError: the model directory lacks ``config.json``/``tokenizer.json``,
                or there is no vLLM environment, or the directory has no chat template.
        """
        self.model_dir = Path(model_dir).resolve()
        for required in ("config.json", "tokenizer.json"):
            if not (self.model_dir / required).is_file():
                raise FileNotFoundError(
                    f"model_dir {self.model_dir} has no {required}; run prepare_model_dir first"
                )
        if not isinstance(block_size, int) or block_size <= 0 or block_size % 32:
            raise ValueError(
                f"block_size must be a positive multiple of 32 (vLLM CPU), got {block_size!r}"
            )
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if num_gpu_blocks is not None and num_gpu_blocks * block_size < max_model_len:
            raise ValueError(
                f"num_gpu_blocks ({num_gpu_blocks}) x block_size ({block_size}) must hold "
                f"max_model_len ({max_model_len}) tokens"
            )
        if kv_cache_space_gib <= 0:
            raise ValueError(f"kv_cache_space_gib must be a positive int, got {kv_cache_space_gib}")
        if omp_threads <= 0:
            raise ValueError(f"omp_threads must be positive, got {omp_threads}")
        self._requested_work_dir = Path(work_dir).resolve() if work_dir is not None else None
        if self._requested_work_dir is not None:
            self._check_ipc_path_length(self._requested_work_dir)
        self.vllm_python = require_vllm_python(vllm_python)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.kv_cache_space_gib = kv_cache_space_gib
        self.omp_threads = omp_threads
        self.seed = seed
        self.model_name = model_name or self.model_dir.name
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self.load_format = load_format
        self._requested_port = port
        self.chat = ModelChat.from_model_dir(self.model_dir)
        self.tokenizer = self.chat.tokenizer
        self._process: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._log_file: IO[bytes] | None = None
        self.work_dir: Path | None = None
        self.port: int | None = None
        self.startup_seconds: float | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @staticmethod
    def _check_ipc_path_length(work_dir: Path) -> None:
        longest = f"ipc://{work_dir}/kv-replay.ipc"
        if len(str(work_dir)) + len("/kv-replay.ipc") > 100:
            raise ValueError(f"work_dir too long for a unix socket path: {longest!r}")

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The API server's process id, also its process group id (kept after :meth:`stop`, to
        check that the group is gone); None before the first start."""
        return self._pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._require_started().port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"ipc://{self._require_started().work_dir}/kv-events.ipc"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{self._require_started().work_dir}/kv-replay.ipc"

    @property
    def cache_sync(self) -> dict[str, Any]:
        """How a planner follows this server's prefix cache through its KV events: the mapping
        ``EngineLink(...)`` and the index service take
        (:class:`~contextpilot_integrations.sync.configuration.CacheSyncConfig`)."""
        return {
            "kind": "kv-events",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.kv_events_topic,
            "page_size": self.block_size,
        }

    @property
    def log_path(self) -> Path:
        return self._require_started().work_dir / "server.log"  # type: ignore[operator]

    def _require_started(self) -> VllmCpuServer:
        if self.work_dir is None or self.port is None:
            raise RuntimeError("the server has not been started (use start() or `with`)")
        return self

    def command(self) -> list[str]:
        """The server's command line (valid after the port and work dir are chosen)."""
        kv_events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "topic": self.kv_events_topic,
            "replay_endpoint": self.replay_endpoint,
        }
        args = [
            str(self.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--load-format",
            self.load_format,
            "--dtype",
            "bfloat16",
            "--seed",
            str(self.seed),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--kv-events-config",
            json.dumps(kv_events_config),
        ]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return args + list(self.extra_args)

    def _environment(self) -> dict[str, str]:
        assert self.work_dir is not None
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
                "OMP_NUM_THREADS": str(self.omp_threads),
                "VLLM_CACHE_ROOT": str(self.work_dir / "vllm-cache"),
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # A virtualenv activated in the caller must not leak into the engine's interpreter.
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        return env

    def start(self) -> VllmCpuServer:
        """Start the server and wait until ``/health`` answers 200.

        Returns:
            self.

        Raises:
            RuntimeError: already running, or the server exited during startup (message has
                the exit status and the log's last lines).
            TimeoutError: no healthy answer within ``startup_timeout`` (the server is stopped;
                message has the log's last lines).
        """
        if self._process is not None:
            raise RuntimeError(f"server already started (pid {self._process.pid})")
        if self._requested_work_dir is not None:
            self.work_dir = self._requested_work_dir
            self.work_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.work_dir = Path(tempfile.mkdtemp(prefix="vllm-cpu-"))
        self._check_ipc_path_length(self.work_dir)
        self.port = self._requested_port or free_port()
        began = time.monotonic()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log_file = log_file
        command = self.command()
        logger.info("starting vLLM CPU server on %s: %s", self.base_url, " ".join(command))
        try:
            self._process = start_in_own_group(
                command, log=log_file, cwd=self.work_dir, env=self._environment()
            )
            self._pid = self._process.pid
            atexit.register(self.stop)
            self._wait_healthy(began)
        except BaseException:
            self.stop(remove_work_dir=False)
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info("vLLM CPU server ready in %.1f s (pid %d)", self.startup_seconds, self.pid)
        return self

    def _wait_healthy(self, began: float) -> None:
        assert self._process is not None
        with httpx.Client(timeout=5.0) as client:

            def healthy() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    return client.get(f"{self.base_url}/health").status_code == 200
                return False

            wait_until_ready(
                self._process,
                healthy,
                began=began,
                timeout_s=self.startup_timeout,
                name="vLLM CPU server",
                log_path=self.log_path,
                log_tail=self.log_tail,
                interval_s=0.5,
            )

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ("" before start)."""
        if self.work_dir is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, remove_work_dir: bool = True) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``stop_timeout``.

        Idempotent. Removes the temporary work dir unless the caller chose it or
        ``remove_work_dir`` is False.
        """
        atexit.unregister(self.stop)
        process = self._process
        if process is not None:
            status = stop_group(process, self.stop_timeout)
            self._process = None
            logger.info("vLLM CPU server stopped (status %s)", status)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if (
            remove_work_dir
            and self.work_dir is not None
            and self._requested_work_dir is None
            and self.work_dir.exists()
        ):
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> VllmCpuServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- requests -----------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids the server prefills for ``prompt``: the model's chat template and tokenizer
        (:meth:`ModelChat.token_ids`; no request to the server)."""
        return self.chat.token_ids(prompt, add_generation_prompt=add_generation_prompt)

    def tokenize_on_server(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The server's own token ids for chat ``messages`` (``POST /tokenize``), to check
        :meth:`tokenize` against.

        Raises:
            RuntimeError: the server answered an HTTP error.
        """
        body = {
            "model": self.model_name,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        with httpx.Client(timeout=60.0) as client:
            response = client.post(f"{self.base_url}/tokenize", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"POST /tokenize answered {response.status_code}: {response.text[:200]}"
            )
        return [int(t) for t in response.json()["tokens"]]

    def reset_prefix_cache(self, timeout: float = 10.0) -> None:
        """Drop every cached prefix block (``POST /reset_prefix_cache``, dev mode).

        vLLM then publishes ``AllBlocksCleared`` with its next engine step. The reset fails
        while blocks are held by running requests; it is retried until ``timeout`` seconds.

        Raises:
            RuntimeError: the server kept refusing (requests still running) or answered an
                HTTP error.
        """
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=30.0) as client:
            while True:
                response = client.post(f"{self.base_url}/reset_prefix_cache")
                if response.status_code != 200:
                    raise RuntimeError(
                        f"POST /reset_prefix_cache answered {response.status_code}: "
                        f"{response.text[:200]}"
                    )
                if response.json().get("success", False):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prefix cache not reset within {timeout} s (requests still hold blocks)"
                    )
                time.sleep(0.2)
