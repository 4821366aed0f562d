"""BM25 top-k retrieval for benchmark workloads, scoped per corpus.

Each request retrieves only among the documents of its own scope (one LoCoMo conversation, one
MTRAG collection, the whole MultiHop-RAG corpus). Scoring is Okapi BM25 as implemented by
``bm25s`` (Lù, 2024, "BM25S: Orders of magnitude faster lexical search via eager sparse
scoring"; its default Lucene variant, k1=1.5, b=0.75), with bm25s's tokenizer and English stop
words, no stemming.

The ranking is deterministic: documents are sorted by descending score, ties (including a query
with no known term, where every score is 0) broken by corpus order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import bm25s
import numpy as np

from contextpilot_bench.workloads import Document, Request, Workload

__all__ = ["ScopedBM25", "retrieve_top_k"]

logger = logging.getLogger(__name__)


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__}: {k!r}")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    return int(k)


class ScopedBM25:
    """One BM25 index per retrieval scope of a workload.

    Args:
        workload: the corpus to index (every scope is indexed once, at construction).

    The indexes hold the corpus token matrices (scipy sparse, inside bm25s): memory grows with
    the corpus, not with the number of requests.
    """

    def __init__(self, workload: Workload) -> None:
        self._docs: dict[str, tuple[Document, ...]] = {}
        self._indexes: dict[str, bm25s.BM25] = {}
        for scope in workload.scopes:
            docs = workload.scope_corpus(scope)
            tokens = bm25s.tokenize([d.text for d in docs], stopwords="en", show_progress=False)
            index = bm25s.BM25()
            index.index(tokens, show_progress=False)
            self._docs[scope] = docs
            self._indexes[scope] = index

    def scores(self, query: str, scope: str) -> np.ndarray:
        """BM25 scores of ``query`` against every document of ``scope``.

        Returns:
            float32 array of shape ``(len(scope corpus),)``, in corpus order.

        Raises:
            KeyError: unknown scope.
        """
        index = self._indexes[scope]
        terms = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        # Terms absent from the scope's vocabulary contribute nothing; bm25s would reject them.
        known = [t for t in terms if t in index.vocab_dict]
        if not known:
            return np.zeros(len(self._docs[scope]), dtype=np.float32)
        return np.asarray(index.get_scores(known), dtype=np.float32)

    def retrieve(self, request: Request, k: int) -> list[Document]:
        """The top-``k`` documents of the request's scope, best first.

        Args:
            request: the query and its scope.
            k: number of documents; when ``k`` exceeds the scope's corpus size the whole
                corpus is returned, ranked.

        Returns:
            ``min(k, corpus size)`` distinct documents, descending score, ties in corpus order.

        Raises:
            ValueError: ``k <= 0``.  TypeError: ``k`` is not an int.
            KeyError: the request's scope is not in the workload.
        """
        k = _check_k(k)
        docs = self._docs[request.scope]
        scores = self.scores(request.query, request.scope)
        order = np.argsort(-scores, kind="stable")[:k]
        return [docs[i] for i in order]


def retrieve_top_k(
    workload: Workload, k: int, requests: Sequence[Request] | None = None
) -> list[list[Document]]:
    """Top-``k`` BM25 retrieval for every request, scoped per corpus.

    Args:
        workload: the corpus (and, by default, the requests).
        k: documents per request (see :meth:`ScopedBM25.retrieve` for ``k`` > corpus size).
        requests: the requests to serve (default: ``workload.requests``).

    Returns:
        One list of documents per request, in request order.

    Raises:
        ValueError: ``k <= 0``.  TypeError: ``k`` is not an int.
    """
    k = _check_k(k)
    retriever = ScopedBM25(workload)
    requests = workload.requests if requests is None else requests
    results = [retriever.retrieve(r, k) for r in requests]
    logger.info("retrieved top-%d for %d requests", k, len(results))
    return results
