"""Helpers of the service tests: a real ``contextpilot-server`` process on 127.0.0.1, free
ports, polling, and request blocks that share a prefix.

:func:`start_server` runs ``python -m contextpilot_integrations.service.server`` on a free port
with the given options and waits until ``/health`` answers (the ``server_factory`` fixture of
``conftest.py`` stops what it started).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from contextpilot_integrations.core.plan import PlacementStatus, Plan


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what or condition}")
        time.sleep(0.02)


@dataclass
class RunningServer:
    """A server process started by :func:`server_factory`."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    args: tuple[str, ...]
    env: dict[str, str] = field(repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``signum`` and wait for the exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_server(
    tmp_path: Path,
    args: tuple[str, ...],
    env: dict[str, str] | None,
    port: int | None,
    launcher: Path | None = None,
) -> RunningServer:
    """Start a server (``launcher``: a script run instead of the server module, which patches
    the service and then calls its ``main``)."""
    port = port or free_port()
    program = [str(launcher)] if launcher else ["-m", "contextpilot_integrations.service.server"]
    log_path = tmp_path / f"server-{port}-{time.monotonic_ns()}.log"
    # The keys come only from the test's own env, never from the caller's environment.
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CONTEXTPILOT_API_KEY", "CONTEXTPILOT_API_KEYS")
    }
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                *program,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    server = RunningServer(process, port, log_path, args, full_env)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"server did not answer /health within 60 s:\n{server.log()}")
        time.sleep(0.05)


def blocks_of(number: int, shared: int = 4, own: int = 2, size: int = 60) -> list[str]:
    """Blocks of request ``number``: ``shared`` blocks common to every request, then ``own``
    blocks of its own (texts of about ``size`` words)."""
    common = [
        f"shared passage {i}: " + " ".join(f"word{i}-{w}" for w in range(size))
        for i in range(shared)
    ]
    mine = [
        f"passage {number}-{j}: " + " ".join(f"w{number}-{j}-{w}" for w in range(size))
        for j in range(own)
    ]
    return mine[:1] + common + mine[1:]


def saved_requests(path: Path) -> list[dict[str, object]]:
    """The index entries of a snapshot file (every partition's, in file order)."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    return [
        entry
        for partition in document["partitions"]
        for entry in partition["pilot"]["index"]["requests"]
    ]


_HINT = re.compile(r"(\[Doc \d+\]) (?:of turn (\d+)|in this message)")


def check_hints(plan: Plan, received: dict[int, Plan]) -> None:
    """Every hint of ``plan`` names a place the app's prompts really show: a block of a turn
    the app received (``received``: turn number -> its plan), or of this prompt, holding the
    same text under that label (docs/DESIGN.md, "Sure hints")."""
    for placement in plan.placements:
        if placement.status is not PlacementStatus.REPLACED:
            continue
        found = _HINT.search(placement.hint or "")
        assert found, placement.hint
        label, turn = found.group(1), found.group(2)
        shown_in = plan if turn is None else received.get(int(turn))
        assert shown_in is not None, f"hint to turn {turn}, which the app never received"
        assert any(p.label == label and p.text == placement.text for p in shown_in.blocks), (
            f"{placement.hint!r} names text the app's turn {turn} did not show there"
        )
