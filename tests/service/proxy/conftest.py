"""Fixtures of the proxy tests: the stand-in upstream (``upstream_standin.py``) in a thread of
the test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.asgi_server import serve_in_thread
from upstream_standin import StandIn, standin_app


@pytest.fixture
def standin() -> Iterator[tuple[str, StandIn]]:
    """The running stand-in: ``(base URL without /v1, its state)``."""
    state = StandIn()
    with serve_in_thread(standin_app(state)) as url:
        try:
            yield url, state
        finally:
            state.release.set()  # stalled answers end, so the server stops at once
