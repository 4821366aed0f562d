"""A LangChain RAG chain over the MultiHop-RAG sample, with and without ContextPilot.

The baseline is the usual LCEL chain (BM25 retriever, documents in retriever order). The
ContextPilot chain is the same chain with the retriever wrapped::

    retriever = ContextPilotRetriever(base_retriever=bm25)          # the one change
    chain = (
        {"context": retriever | format_documents, "question": RunnablePassthrough()}
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(llm)                                       # rid -> the engine
    )

and, for a whole batch planned jointly and sent in schedule order, ``RAGInputs(retriever=...)``
in place of the dict. Both render with the same layout, so the only difference is the order
of the documents (and the order annotation after them).

The model: by default a fake chat model in front of the embedded prefix-cache model
(``contextpilot_bench.engine.EmbeddedEngine``: a radix tree of cached prompt
prefixes with LRU eviction, in the engine's way). It counts cached tokens in whole lines of
the chat-templated prompt (a line is cached only when it and everything before it is), with
``ApproxTokenCounter`` token counts, and passes the request ids it evicts back to
``ContextPilot.evict`` (what the KV-event subscriber does for a real engine). With
``CONTEXTPILOT_LLM_BASE_URL`` set (and optionally ``CONTEXTPILOT_LLM_MODEL``,
``CONTEXTPILOT_LLM_API_KEY``) the chains call that OpenAI-compatible endpoint through
``ChatOpenAI`` and the figures are the engine's own ``cached_tokens`` (SGLang with
``--enable-cache-report``, vLLM with ``--enable-prompt-tokens-details``); the engine's prefix
cache is flushed before each run when it allows it. With a real engine, the pilot follows the
engine's cache itself: ``ContextPilot(engine=EngineLink({"kind": "kv-events", "endpoint": ...,
"replay_endpoint": ...}))`` subscribes to its KV-cache events and drops the requests it evicts
(this example does not, as the endpoints depend on the engine's launch flags);
``tests/langchain/test_langchain_vllm_engine.py`` runs that loop against vLLM.

Run: ``python examples/langchain_rag.py [--limit 500] [--k 5] [--cache-tokens unlimited]``;
data from ``--data-dir``, else the benchmark's rule
(``contextpilot_bench.workloads.resolve_data_dir``: ``$CONTEXTPILOT_DATA_DIR``, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.methods import parse_cache_tokens, resolve_cache_tokens
from contextpilot_bench.report import format_table
from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.workloads import Request, Workload, load_workload
from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnablePassthrough
from pydantic import ConfigDict, PrivateAttr

from contextpilot_integrations import ApproxTokenCounter, ContextPilot
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotRetriever,
    RAGInputs,
    format_documents,
    with_plan_fields,
)

logger = logging.getLogger("langchain_rag")

BASE_URL_ENV = "CONTEXTPILOT_LLM_BASE_URL"
MODEL_ENV = "CONTEXTPILOT_LLM_MODEL"
API_KEY_ENV = "CONTEXTPILOT_LLM_API_KEY"


# --- the retriever the application already has -------------------------------------------------


class WorkloadBM25Retriever(BaseRetriever):
    """BM25 (bm25s, the benchmark's own scoring) over a workload's corpus, as a LangChain
    retriever. Documents carry their title in ``metadata["title"]`` and no id, like
    LangChain's own BM25 retriever."""

    workload: Workload
    k: int = 5
    model_config = ConfigDict(arbitrary_types_allowed=True)
    _index: ScopedBM25 = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        self._index = ScopedBM25(self.workload)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        found = self._index.retrieve(Request(id="query", query=query), k or self.k)
        return [Document(page_content=d.text, metadata={"title": d.id}) for d in found]


# --- the model ----------------------------------------------------------------------------------


class PrefixCacheChatModel(BaseChatModel):
    """A fake chat model in front of the embedded prefix-cache model.

    Each call renders the messages as a ChatML-like prompt, serves it through ``engine`` under
    the request id the call carries (``extra_body["rid"]``, else a new one) and answers with a
    fixed sentence. Request ids the engine evicts go to ``on_evicted``.
    """

    engine: Any
    on_evicted: Callable[[str], Any] | None = None
    model_config = ConfigDict(arbitrary_types_allowed=True)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _served: list[tuple[str, int, int]] = PrivateAttr(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "prefix-cache-fake"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        rid = (kwargs.get("extra_body") or {}).get("rid") or f"app-{uuid.uuid4().hex}"
        lines: list[str] = []
        for message in messages:
            lines.append(f"<|{message.type}|>\n")
            lines.extend(str(message.content).splitlines(keepends=True))
        with self._lock:
            served = self.engine.serve(rid, lines)
            self._served.append((rid, served.prompt_tokens, served.cached_tokens or 0))
            evicted = self.engine.take_evicted_rids()
        if self.on_evicted is not None:
            for old in evicted:
                self.on_evicted(old)
        answer = AIMessage(
            content="(fake model) See [Doc 1].",
            usage_metadata={
                "input_tokens": served.prompt_tokens,
                "output_tokens": 6,
                "total_tokens": served.prompt_tokens + 6,
                "input_token_details": {"cache_read": served.cached_tokens or 0},
            },
        )
        return ChatResult(generations=[ChatGeneration(message=answer)])


def real_model() -> Runnable[Any, Any] | None:
    """``ChatOpenAI`` for ``$CONTEXTPILOT_LLM_BASE_URL``, or ``None`` when it is not set."""
    base_url = os.environ.get(BASE_URL_ENV)
    if not base_url:
        return None
    from contextpilot_bench.engine_client import EngineClient
    from langchain_openai import ChatOpenAI

    api_key = os.environ.get(API_KEY_ENV) or "none"
    model = os.environ.get(MODEL_ENV)
    if not model:
        with EngineClient(base_url, api_key=api_key) as client:
            model = client.model
    url = base_url.rstrip("/")
    url = url if url.endswith("/v1") else f"{url}/v1"
    return ChatOpenAI(base_url=url, api_key=api_key, model=model, max_tokens=16, temperature=0)


def flush_real_engine() -> None:
    from contextpilot_bench.engine_client import EngineClient

    with EngineClient(os.environ[BASE_URL_ENV]) as client:
        client.flush_cache()


# --- runs ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One chain over the questions: token counts summed over its LLM calls."""

    name: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reported: bool = True
    seconds: float = 0.0
    sample_answer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def add(self, message: AIMessage) -> None:
        usage = message.usage_metadata or {}
        self.requests += 1
        self.prompt_tokens += int(usage.get("input_tokens", 0))
        cached = (usage.get("input_token_details") or {}).get("cache_read")
        if cached is None:
            self.reported = False
        self.cached_tokens += int(cached or 0)


def run_chain(
    name: str,
    questions: Sequence[str],
    build: Callable[[Runnable[Any, Any]], Runnable[Any, Any]],
    llm_factory: Callable[[], Runnable[Any, Any]],
    *,
    batch: bool = False,
    max_concurrency: int = 1,
) -> RunResult:
    """Build a chain around a fresh model and run every question through it."""
    result = RunResult(name)
    chain = build(llm_factory())
    start = time.perf_counter()
    if batch:
        answers = chain.batch(list(questions), config={"max_concurrency": max_concurrency})
    else:
        answers = [chain.invoke(q) for q in questions]
    result.seconds = time.perf_counter() - start
    for answer in answers:
        result.add(answer)
    result.sample_answer = str(answers[0].content) if answers else ""
    return result


def run_all(
    workload: Workload,
    *,
    limit: int | None = None,
    k: int = 5,
    cache_tokens: int | float | None = None,
    max_concurrency: int = 1,
    modes: Sequence[str] = ("invoke", "batch"),
) -> list[RunResult]:
    """The baseline chain and the ContextPilot chain (per mode) over the workload's questions.

    Args:
        workload: the workload (its corpus is the retriever's).
        limit: first ``limit`` questions (``None``: all).
        k: documents retrieved per question.
        cache_tokens: embedded cache capacity (see ``bench.methods.parse_cache_tokens``).
        max_concurrency: LLM calls in flight in batch mode.
        modes: ``"invoke"`` (one request at a time, online) and/or ``"batch"`` (planned jointly,
            sent in schedule order).
    """
    questions = [r.query for r in workload.head(limit).requests]
    bm25 = WorkloadBM25Retriever(workload=workload, k=k)
    real = real_model()
    counter = ApproxTokenCounter()
    texts = {d.page_content for q in questions for d in bm25.invoke(q)}
    capacity = resolve_cache_tokens(cache_tokens, sum(counter.count(t) for t in texts))

    def model_for(pilot: ContextPilot | None) -> Callable[[], Runnable[Any, Any]]:
        def make() -> Runnable[Any, Any]:
            if real is not None:
                flush_real_engine()
                return real
            engine = EmbeddedEngine(capacity, counter=counter)
            return PrefixCacheChatModel(engine=engine, on_evicted=pilot.evict if pilot else None)

        return make

    results = [
        run_chain(
            "baseline (retriever order)",
            questions,
            lambda llm: (
                {"context": bm25 | format_documents, "question": RunnablePassthrough()}
                | CONTEXTPILOT_PROMPT
                | llm
            ),
            model_for(None),
        )
    ]
    for mode in modes:
        pilot = ContextPilot()
        retriever = ContextPilotRetriever(base_retriever=bm25, pilot=pilot)
        if mode == "invoke":

            def build(llm: Runnable[Any, Any], retriever: Any = retriever) -> Runnable[Any, Any]:
                inputs = {
                    "context": retriever | format_documents,
                    "question": RunnablePassthrough(),
                }
                return inputs | CONTEXTPILOT_PROMPT | with_plan_fields(llm)

        elif mode == "batch":

            def build(llm: Runnable[Any, Any], retriever: Any = retriever) -> Runnable[Any, Any]:
                return RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | with_plan_fields(llm)

        else:
            raise ValueError(f"mode must be 'invoke' or 'batch', got {mode!r}")
        result = run_chain(
            f"ContextPilot ({mode})",
            questions,
            build,
            model_for(pilot),
            batch=mode == "batch",
            max_concurrency=max_concurrency,
        )
        result.extra["index"] = pilot.stats()
        results.append(result)
    return results


def report(results: Sequence[RunResult]) -> str:
    """The figures as a table, then the gain of each ContextPilot run over the baseline."""
    base = results[0]
    rows = [
        {
            "method": r.name,
            "requests": r.requests,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens if r.reported else None,
            "hit_ratio": r.hit_ratio if r.reported else None,
            "prefill_tokens": r.prefill_tokens if r.reported else None,
            "seconds": r.seconds,
        }
        for r in results
    ]
    columns = [
        ("method", "method", "str"),
        ("requests", "requests", "int"),
        ("prompt tokens", "prompt_tokens", "int"),
        ("cached tokens", "cached_tokens", "int"),
        ("hit ratio", "hit_ratio", "ratio"),
        ("prefill tokens", "prefill_tokens", "int"),
        ("seconds", "seconds", "s"),
    ]
    lines = [format_table(rows, columns)]
    for r in results[1:]:
        if not (r.reported and base.reported):
            lines.append(f"{r.name}: the engine did not report cached tokens")
            continue
        gain = r.hit_ratio / base.hit_ratio if base.hit_ratio else float("inf")
        prefill = r.prefill_tokens / base.prefill_tokens - 1 if base.prefill_tokens else 0.0
        lines.append(
            f"{r.name}: hit ratio {base.hit_ratio:.1%} -> {r.hit_ratio:.1%} ({gain:.2f}x), "
            f"prefill tokens {prefill:+.1%} vs baseline"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="data directory (default $CONTEXTPILOT_DATA_DIR)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions (all: 500)")
    parser.add_argument("--k", type=int, default=5, help="documents per question")
    parser.add_argument(
        "--cache-tokens",
        type=parse_cache_tokens,
        default=None,
        help="embedded cache capacity: tokens, a fraction of the retrieved unique block "
        "tokens (0.25), or unlimited (default)",
    )
    parser.add_argument("--max-concurrency", type=int, default=1, help="LLM calls in flight")
    parser.add_argument(
        "--modes", default="invoke,batch", help="ContextPilot runs: invoke, batch or both"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    workload = load_workload("multihop-rag", args.data_dir)
    results = run_all(
        workload,
        limit=args.limit,
        k=args.k,
        cache_tokens=args.cache_tokens,
        max_concurrency=args.max_concurrency,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
    )
    engine = os.environ.get(BASE_URL_ENV) or "embedded prefix-cache model (line granularity)"
    capacity = "unlimited" if args.cache_tokens is None else args.cache_tokens
    print(
        f"MultiHop-RAG sample: {results[0].requests} questions, BM25 top-{args.k}, "
        f"engine: {engine}, cache: {capacity}"
    )
    print(report(results))
    print(f"sample answer: {results[-1].sample_answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
