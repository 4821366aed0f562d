"""Fixtures for the Mem0 adapter: real Mem0 memories on local Qdrant, offline (Mem0's
environment is set by ``tests/conftest.py`` before anything imports ``mem0``; the real data
directory, ``data_dir``, comes from there too)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hashed_embeddings import DIMENSIONS, HashedWordEmbeddings
from langchain_core.embeddings import Embeddings
from mem0 import AsyncMemory, Memory

from contextpilot_integrations.mem0.local_config import local_mem0_config


def fast_config(directory: Path, embeddings: Embeddings | None = None) -> dict[str, Any]:
    """A local Mem0 config with fast, model-free embeddings."""
    return local_mem0_config(
        directory,
        embeddings=embeddings if embeddings is not None else HashedWordEmbeddings(),
        embedding_dims=DIMENSIONS,
    )


@pytest.fixture
def mem0_config() -> Callable[..., dict[str, Any]]:
    """``fast_config`` (``directory``, optional LangChain ``embeddings`` of 64 dimensions)."""
    return fast_config


@pytest.fixture
def mem0_memory(tmp_path: Path) -> Iterator[Memory]:
    """A real ``mem0.Memory`` on local Qdrant in ``tmp_path``."""
    memory = Memory.from_config(fast_config(tmp_path / "sync"))
    yield memory
    memory.close()


@pytest.fixture
def mem0_async_memory(tmp_path: Path) -> Iterator[AsyncMemory]:
    """A real ``mem0.AsyncMemory`` on local Qdrant in ``tmp_path``."""
    memory = AsyncMemory.from_config(fast_config(tmp_path / "async"))
    yield memory
    memory.close()
