"""Shared helpers of the sync tests: free loopback ports and waiting for a condition."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable

import pytest


def _free_port_range(count: int) -> int:
    """A base port such that base .. base + count - 1 are free on 127.0.0.1 right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000)
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.005)


@pytest.fixture
def free_port_range() -> Callable[[int], int]:
    """``free_port_range(count)``: a base port with ``count`` consecutive free ports."""
    return _free_port_range


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """``wait_for(condition, timeout_s=10)``: poll until true, else fail the test."""
    return _wait_for


@pytest.fixture
def endpoints() -> Callable[..., tuple[str, str | None]]:
    """``endpoints(replay=True)``: a free PUB endpoint and replay endpoint on 127.0.0.1."""

    def make(replay: bool = True) -> tuple[str, str | None]:
        base = _free_port_range(2)
        return f"tcp://127.0.0.1:{base}", (f"tcp://127.0.0.1:{base + 1}" if replay else None)

    return make
