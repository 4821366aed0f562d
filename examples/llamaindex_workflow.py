"""ContextPilot in a LlamaIndex Workflow: retrieve -> plan -> synthesize, as three steps.

LlamaIndex pipelines are Workflows (llama-index-core 0.13+ has no QueryPipeline). The ContextPilot
step is one call, ``await postprocessor.apostprocess_nodes(nodes, query_str=query)``; the
synthesize step renders the plan with ``text_qa_template(postprocessor)``, which also arms the
plan's request id for the LLM call that follows in that step (``ContextPilotOpenAILike`` sends
it). Retrieval is BM25 (``llama-index-retrievers-bm25``) over the MultiHop-RAG sample.

The run compares the same questions without ContextPilot (retriever order, LlamaIndex's default
template) and with it, replaying each prompt through the embedded prefix-cache model, and
prints the hit ratios. The LLM is ``MockLLM`` unless ``CONTEXTPILOT_LLM_BASE_URL`` names an
OpenAI-compatible endpoint.

    python examples/llamaindex_workflow.py --questions 100
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import llamaindex_support as support
from llama_index.core import get_response_synthesizer
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.llms import LLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeWithScore
from llama_index.core.workflow import Event, StartEvent, StopEvent, Workflow, step
from llama_index.retrievers.bm25 import BM25Retriever

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    nodes_rid,
    text_qa_template,
)


class RetrievedEvent(Event):
    query: str
    nodes: list[NodeWithScore]


class PlannedEvent(Event):
    query: str
    nodes: list[NodeWithScore]


class RAGWorkflow(Workflow):
    """Retrieve, (optionally) plan with ContextPilot, synthesize.

    Args:
        retriever: any LlamaIndex retriever.
        llm: the LLM.
        postprocessor: a :class:`ContextPilotNodePostprocessor`, or ``None`` for the baseline
            (retriever order, LlamaIndex's default template).

    Run with ``await workflow.run(query=...)``; the result is the synthesizer's ``Response``.
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: LLM,
        postprocessor: ContextPilotNodePostprocessor | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.retriever = retriever
        self.postprocessor = postprocessor
        template = (
            {} if postprocessor is None else {"text_qa_template": text_qa_template(postprocessor)}
        )
        self.synthesizer = get_response_synthesizer(llm=llm, **template)

    @step
    async def retrieve(self, ev: StartEvent) -> RetrievedEvent:
        nodes = await self.retriever.aretrieve(ev.query)
        return RetrievedEvent(query=ev.query, nodes=nodes)

    @step
    async def plan(self, ev: RetrievedEvent) -> PlannedEvent:
        nodes = ev.nodes
        if self.postprocessor is not None:
            nodes = await self.postprocessor.apostprocess_nodes(nodes, query_str=ev.query)
        return PlannedEvent(query=ev.query, nodes=nodes)

    @step
    async def synthesize(self, ev: PlannedEvent) -> StopEvent:
        response = await self.synthesizer.asynthesize(ev.query, ev.nodes)
        return StopEvent(result=response)


async def run_questions(
    workflow: RAGWorkflow,
    questions: list[str],
    replay: support.PrefixCacheReplay,
    pilot: ContextPilot | None = None,
) -> None:
    """Run the questions one after the other, each prompt into ``replay``; evictions of the
    cache model go back to ``pilot`` (the eviction sync of the paper, section 4.3)."""
    with support.PromptRecorder() as recorder:
        for question in questions:
            response = await workflow.run(query=question)
            rid = nodes_rid(response.source_nodes)  # metadata["contextpilot"]["rid"]
            replay.serve(recorder.prompts[-1], rid)
            for evicted in replay.take_evicted_rids():
                if pilot is not None:
                    pilot.evict(evicted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="default: $CONTEXTPILOT_DATA_DIR")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument(
        "--cache-tokens", type=int, default=None, help="prefix-cache capacity (default unlimited)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("bm25s").setLevel(logging.WARNING)

    documents = support.multihop_documents(args.data_dir)
    nodes = SentenceSplitter(chunk_size=1024, chunk_overlap=0).get_nodes_from_documents(documents)
    retriever = BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=args.top_k)
    questions = support.multihop_questions(args.data_dir, args.questions)
    llm = support.make_llm()

    baseline = support.PrefixCacheReplay(args.cache_tokens)
    asyncio.run(run_questions(RAGWorkflow(retriever, llm, timeout=120), questions, baseline))

    pilot = ContextPilot()
    postprocessor = ContextPilotNodePostprocessor(pilot)
    contextpilot = support.PrefixCacheReplay(args.cache_tokens)
    workflow = RAGWorkflow(retriever, llm, postprocessor, timeout=120)
    asyncio.run(run_questions(workflow, questions, contextpilot, pilot))

    print(f"Workflow over MultiHop-RAG: {len(questions)} questions, BM25 top-{args.top_k}")
    print(f"  prefix-cache hit ratio, baseline:     {baseline.hit_ratio:.3f}")
    print(f"  prefix-cache hit ratio, ContextPilot: {contextpilot.hit_ratio:.3f}")
    print(f"  prefill tokens saved: {contextpilot.cached_tokens - baseline.cached_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
