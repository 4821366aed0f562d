"""Deterministic, model-free embeddings for tests that need a real vector store but not a
real model (Mem0 on local Qdrant): fast on two CPU cores."""

from __future__ import annotations

import hashlib

import numpy as np
from langchain_core.embeddings import Embeddings

DIMENSIONS = 64


class HashedWordEmbeddings(Embeddings):
    """Bag-of-words embeddings by feature hashing (BLAKE2b of each lower-cased word picks one of
    ``DIMENSIONS - 1`` coordinates), plus a constant coordinate so every cosine similarity is
    positive: a search with ``threshold=0`` and a large ``top_k`` returns every memory of the
    scope, ranked by shared words."""

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
