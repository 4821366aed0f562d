"""Fixtures of the service tests (helpers in ``service_testing.py``)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from service_testing import RunningServer, start_server


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """``server_factory(*args, env=None, port=None, launcher=None)`` -> a started
    :class:`RunningServer`."""
    started: list[RunningServer] = []

    def make(
        *args: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
        launcher: Path | None = None,
    ) -> RunningServer:
        server = start_server(tmp_path, args, env, port, launcher)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(signal.SIGKILL if server.process.poll() is None else signal.SIGTERM, 10)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One plain server for a whole test module (tests must not assume an empty index)."""
    server = start_server(tmp_path_factory.mktemp("shared-server"), (), None, None)
    yield server
    server.stop()
