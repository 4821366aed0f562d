"""A server process and everything it starts, stopped together: one process group; and waiting
for such a server to answer (:func:`wait_until_ready`) on a free loopback port (:func:`free_port`).

A server started with :func:`start_in_own_group` leads its own session (process group), so that
:func:`stop_group` reaches the engine's worker processes too (vLLM's API server starts an engine
core process, which starts its own workers). On Linux the child also gets SIGTERM if the Python
process that started it dies without cleaning up (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "free_port",
    "process_group_members",
    "start_in_own_group",
    "stop_group",
    "wait_until_ready",
]

logger = logging.getLogger(__name__)


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) process ids whose process group is ``pgid``, read from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _load_prctl() -> Any | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up in the parent: the child of a fork should not load libraries before exec.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. Linux delivers the signal when the *thread* that
    # forked exits, so start servers from a long-lived thread (normally the main one).
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_in_own_group(
    command: Sequence[str],
    *,
    log: IO[bytes],
    cwd: Path,
    env: dict[str, str],
) -> subprocess.Popen[bytes]:
    """Start ``command`` as the leader of a new process group (its pid is the group id), with
    stdin closed and stdout and stderr going to ``log``.

    Raises:
        OSError: the command could not be started.
    """
    return subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def stop_group(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Stop a group leader started by :func:`start_in_own_group` and every member of its group:
    SIGTERM, then, after ``timeout`` seconds, SIGKILL to whatever is left.

    Returns:
        The leader's exit status.
    """
    pgid = process.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()
        if process.returncode is not None and not process_group_members(pgid):
            return process.returncode
        time.sleep(0.2)
    logger.warning("process group %d ignored SIGTERM; sending SIGKILL", pgid)
    _signal_group(pgid, signal.SIGKILL)
    process.wait()
    kill_deadline = time.monotonic() + 5.0
    while process_group_members(pgid) and time.monotonic() < kill_deadline:
        time.sleep(0.1)
    return process.returncode


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_ready(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    *,
    began: float,
    timeout_s: float,
    name: str,
    log_path: Path,
    log_tail: Callable[[], str],
    interval_s: float = 0.2,
) -> None:
    """Poll ``ready()`` until it is true, while ``process`` runs.

    Args:
        process: the server (started by :func:`start_in_own_group`).
        ready: True once the server answers as wanted (it swallows connection errors).
        began: ``time.monotonic()`` at the start; ``timeout_s``: seconds from then.
        name: the server in messages (``"smg"``, ``"vLLM CPU server"``).
        log_path, log_tail: the server's log and its last lines, for the messages.

    Raises:
        RuntimeError: the process exited first (its status and log tail in the message).
        TimeoutError: not ready within ``timeout_s`` (the log tail in the message).
    """
    while True:
        status = process.poll()
        if status is not None:
            raise RuntimeError(
                f"{name} exited with status {status} during startup; log {log_path}:\n{log_tail()}"
            )
        if ready():
            return
        if time.monotonic() > began + timeout_s:
            raise TimeoutError(
                f"{name} not healthy after {timeout_s:.0f} s; log {log_path}:\n{log_tail()}"
            )
        time.sleep(interval_s)
