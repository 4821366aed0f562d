"""A RAG app's calls through the proxy mode, its retrieved documents marked in the body
(``contextpilot.documents``; docs/DESIGN.md, "The proxy"), sent to one proxy process, to two
that plan as one and to two that know nothing of each other (docs/DESIGN.md, "Proxy peers";
:mod:`~contextpilot_bench.proxy_processes`), on the prefix-cache model.

Two shapes over the agent workload's sessions (each user turn's question and its top
:data:`~contextpilot_bench.agent_sessions.TOP_K` BM25 documents in the session's scope, the
stand-in's answer after each turn):

- ``rag-conversations``: each conversation named (``contextpilot.conversation_id``), its history
  as the app keeps it (user messages without the documents): the proxy puts back the message
  it sent with documents, a memory of the conversation's owner;
- ``rag-single``: every turn's question alone with its documents and no conversation: the
  tenant's document index finds the prefix an earlier call shared.

The prompt as sent is cut into :data:`UNIT_CHARS`-character units (an engine's KV blocks of
about 16 tokens), each weighted by its token count, and served in call order by one unlimited
:class:`~contextpilot_bench.prefix_cache_model.PrefixCacheModel`; the hit ratio is cached
tokens over prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contextpilot_bench.agent_proxy import MODEL
from contextpilot_bench.agent_sessions import TOP_K, AgentSession
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_bench.proxy_processes import ANSWER_TEXT, ProxyCall, send_through_proxies
from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.workloads import Request
from contextpilot_integrations.core.blocks import TokenCounter

__all__ = ["UNIT_CHARS", "rag_calls", "rag_rows"]

UNIT_CHARS = 64
"""Characters per prefix-cache unit (about 16 tokens: an engine's KV block)."""

SHAPES = ("rag-conversations", "rag-single")
"""The RAG shapes (module docstring)."""

VARIANTS = ((1, True, "one process"), (2, True, "peers"), (2, False, "unpinned"))
"""``(processes, peers, name)`` of each run."""


def rag_calls(sessions: Sequence[AgentSession], index: ScopedBM25, shape: str) -> list[ProxyCall]:
    """The calls of ``sessions`` in ``shape`` (:data:`SHAPES`), session after session, turn
    after turn."""
    calls: list[ProxyCall] = []
    for session in sessions:
        history: list[dict[str, Any]] = []
        for position, turn in enumerate(session.turns):
            asked = Request(turn.request_id or f"{session.id}:{position}", turn.question,
                            scope=session.scope)  # fmt: skip
            documents = [d.text for d in index.retrieve(asked, TOP_K)]
            question = {"role": "user", "content": turn.question}
            if shape == "rag-single":
                body = {"model": MODEL, "messages": [question],
                        "contextpilot": {"documents": documents}}  # fmt: skip
            else:
                history.append(question)
                extension = {"documents": documents, "conversation_id": session.id}
                body = {"model": MODEL, "messages": list(history), "contextpilot": extension}
                history.append({"role": "assistant", "content": ANSWER_TEXT})
            calls.append(ProxyCall(body))
    return calls


def _units(messages: Sequence[Any], counter: TokenCounter) -> tuple[list[str], list[int]]:
    """The prompt's :data:`UNIT_CHARS`-character units and their token counts."""
    text = "".join(f"<|{m['role']}|>{_text(m['content'])}<|end|>" for m in messages)
    units = [text[i : i + UNIT_CHARS] for i in range(0, len(text), UNIT_CHARS)]
    return units, [max(1, counter.count(u)) for u in units]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def rag_rows(
    sessions: Sequence[AgentSession], index: ScopedBM25, counter: TokenCounter
) -> list[dict[str, Any]]:
    """One row per shape and variant (:data:`VARIANTS`): calls, prompt and prefill tokens,
    hit ratio, and its ratio to one process's of the same shape."""
    rows: list[dict[str, Any]] = []
    for shape in SHAPES:
        calls = rag_calls(sessions, index, shape)
        one: float | None = None
        for processes, peers, name in VARIANTS:
            cache = PrefixCacheModel(None)
            prompt = prefill = 0
            for messages in send_through_proxies(calls, processes, peers=peers):
                units, weights = _units(messages, counter)
                cached = cache.serve(units, weights)
                prompt += sum(weights)
                prefill += sum(weights) - cached
            hit = 1 - prefill / prompt if prompt else None
            one = hit if one is None else one
            rows.append(
                {
                    "method": f"{shape} ({name})",
                    "processes": processes,
                    "calls": len(calls),
                    "prompt_tokens": prompt,
                    "prefill_tokens": prefill,
                    "hit_ratio": hit,
                    "hit_vs_one": hit / one if hit is not None and one else None,
                }
            )
    return rows
