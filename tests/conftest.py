"""Fixtures shared by every folder's tests: the real data directory, a real index service on
127.0.0.1 and an address where none answers (for the client's local fallback). The mechanisms
several conftests use live in ``tests/support``.

Imports stay within the standard library, pytest and ``support.data_dir`` at module level: every
tier (the sglang tier's environment too) loads this file. Mem0 reads ``MEM0_TELEMETRY`` and
``MEM0_DIR`` when it is first imported, so they are set here, before any test module imports
``mem0``; the model hubs are off (nothing is downloaded).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

for _key, _value in {
    "MEM0_TELEMETRY": "False",
    "MEM0_DIR": tempfile.mkdtemp(prefix="contextpilot-mem0-tests-"),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
from support.data_dir import data_dir_or_skip  # noqa: E402


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real datasets, ``$CONTEXTPILOT_DATA_DIR`` (tests that need them skip without it)."""
    return data_dir_or_skip()


@pytest.fixture(scope="session")
def service_url() -> Iterator[str]:
    """A ``contextpilot-server`` process for the whole session (tests must not assume an empty
    index: use fresh texts or conversation ids)."""
    import httpx  # not in every tier's environment (the sglang tier has none)

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "contextpilot_integrations.service.server", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the service exited"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the service did not start within 60 s"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def unreachable_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
