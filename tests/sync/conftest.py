"""Shared helpers of the sync tests: free loopback ports, waiting for a condition, and the
import-time torchvision stand-in of the ``sglang`` tier."""

from __future__ import annotations

import importlib.abc
import importlib.util
import random
import socket
import sys
import time
import types
from collections.abc import Callable
from importlib.machinery import ModuleSpec

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


# ---------------------------------------------------------------------------------------------
# The sglang tier: an import-time stand-in for torchvision.
# ---------------------------------------------------------------------------------------------


class _PlaceholderType(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Placeholder,), {"__module__": cls.__module__})


class _Placeholder(metaclass=_PlaceholderType):
    """Any attribute of the stand-in modules (and any attribute of those, e.g. an enum member):
    a class that can be subclassed, instantiated or read; calling an instance raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is not installed (import-time stand-in of the sglang tier)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides empty ``torchvision`` modules so that SGLang imports on a CPU-only machine.

    PyPI's torchvision is a CUDA build that fails beside CPU torch ("operator torchvision::nms
    does not exist") and installing it swaps in CUDA torch (docs/DESIGN.md, "SGLang KV events");
    SGLang imports it at module load only for multimodal models, which these tests never use.
    Every attribute is a placeholder class; calling one raises RuntimeError.
    """

    def find_spec(self, fullname: str, path: object, target: object = None) -> ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package: submodules resolve through this finder too
        module.__version__ = "0.0.0+stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if (
    importlib.util.find_spec("sglang") is not None
    and importlib.util.find_spec("torchvision") is None
):
    sys.meta_path.append(_TorchvisionStandIn())
