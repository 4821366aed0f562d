"""Fixtures for the Mem0 adapter: real Mem0 memories on local Qdrant, offline.

Mem0 reads ``MEM0_TELEMETRY`` and ``MEM0_DIR`` when it is first imported, so they are set here,
before any test module imports ``mem0``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_MEM0_HOME = tempfile.mkdtemp(prefix="contextpilot-mem0-tests-")
for _key, _value in {
    "MEM0_TELEMETRY": "False",
    "MEM0_DIR": _MEM0_HOME,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from mem0 import AsyncMemory, Memory  # noqa: E402

from contextpilot_integrations.bench.workloads import resolve_data_dir  # noqa: E402
from contextpilot_integrations.mem0.local_config import local_mem0_config  # noqa: E402

DIMENSIONS = 64


class HashedWordEmbeddings(Embeddings):
    """Deterministic bag-of-words embeddings by feature hashing (BLAKE2b of each lower-cased
    word picks one of ``DIMENSIONS - 1`` coordinates), plus a constant coordinate so every
    cosine similarity is positive: a search with ``threshold=0`` and a large ``top_k`` returns
    every memory of the scope, ranked by shared words. Fast, and needs no model."""

    def _embed(self, text: str) -> list[float]:
        vector = np.zeros(DIMENSIONS)
        vector[0] = 3.0
        for word in text.lower().split():
            digest = hashlib.blake2b(word.strip(".,!?").encode(), digest_size=8).digest()
            vector[1 + int.from_bytes(digest, "big") % (DIMENSIONS - 1)] += 1.0
        return (vector / np.linalg.norm(vector)).tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)


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


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real datasets (tests that need them skip when they are absent)."""
    try:
        return resolve_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"real data not available: {exc}")
