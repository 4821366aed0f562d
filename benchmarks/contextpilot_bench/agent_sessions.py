"""Agentic RAG sessions built from the shared datasets, and the BM25 retriever their tool runs.

A session is one agent conversation: user turns in order, each answered by an agent that makes
the turn's tool calls (:class:`ToolCall`) and then answers. Here each turn calls the search tool
twice (the turn's own query, then a follow-up query). The calls are fixed from the data alone,
so every agent replaying a session makes the same tool calls (the scripted models of
:mod:`~contextpilot_bench.agent_models` follow them); the file-editing sessions are built the
same way by :mod:`~contextpilot_bench.agent_file_sessions`.

``agentic-multihop-rag``
    MultiHop-RAG's questions in file order, :data:`MULTIHOP_TURNS` consecutive questions per
    session, one scope (the whole corpus). Follow-up query: the question's keywords
    (:func:`keyword_query`), what an agent sends when the full question is too wordy.
``agentic-mtrag``
    MTRAG-UN: each conversation's user turns are one session, retrieving among the passages of
    its collection. Follow-up query: the previous user turn and this one joined (the
    conversation-context rewrite MTRAG's own ``questions`` task retrieves with); a first turn's
    is its keywords.

The retriever is :class:`~contextpilot_bench.retrieval.ScopedBM25`, top :data:`TOP_K`, within the
session's scope (:class:`ScopedBM25Retriever`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from bm25s.stopwords import STOPWORDS_EN
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict

from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.workloads import Document, Request, Workload

__all__ = [
    "MULTIHOP_TURNS",
    "SEARCH_TOOL",
    "TOP_K",
    "AgentSession",
    "AgentTurn",
    "ScopedBM25Retriever",
    "ToolCall",
    "agent_sessions",
    "keyword_query",
    "source_workload",
]

MULTIHOP_TURNS = 4
"""User turns per agentic MultiHop-RAG session (consecutive questions)."""
TOP_K = 5
"""Documents the search tool returns per call."""
SEARCH_TOOL = "search"
"""The search tool's name, as the scripted models call it."""

_SOURCES = {"agentic-multihop-rag": "multihop-rag", "agentic-mtrag": "mtrag"}
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'&.-]*[A-Za-z0-9]|[A-Za-z0-9]")
_STOP = frozenset(STOPWORDS_EN) | {
    "according", "article", "articles", "did", "do", "does", "how", "reported", "what", "when",
    "where", "which", "who", "whom", "why",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One scripted tool call: the tool's name and its keyword arguments (JSON strings)."""

    name: str
    arguments: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class AgentTurn:
    """One user turn: the message, the tool calls in call order, the scripted answer, and the
    id of the workload request it was built from (``None`` for a file session's turn), under
    which the data's reference answers are found
    (:func:`~contextpilot_bench.answer_scoring.reference_answers`)."""

    question: str
    calls: tuple[ToolCall, ...]
    answer: str
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class AgentSession:
    """One agent conversation.

    Attributes:
        id: the agent's thread id (``<number>:<conversation id's first 8 characters>``,
            MultiHop-RAG's ``<number>:questions``, a file session's ``<number>:files``).
        scope: the search tool's retrieval scope (empty for a file session).
        turns: the user turns in order.
        files: the workspace a file session's tools start from (path to text; empty for a
            search session): each replay edits its own copy.
    """

    id: str
    scope: str
    turns: tuple[AgentTurn, ...]
    files: Mapping[str, str] = field(default_factory=dict)


def source_workload(name: str) -> str:
    """The dataset workload a search agent workload is built from.

    Raises:
        ValueError: ``name`` is not an agent workload built on a dataset (one of
            :data:`~contextpilot_bench.workloads.AGENT_WORKLOADS` but the file workload).
    """
    if name not in _SOURCES:
        raise ValueError(f"workload must be one of {', '.join(_SOURCES)}, got {name!r}")
    return _SOURCES[name]


def keyword_query(text: str) -> str:
    """The text's distinct content words in order (stop words and one-letter words dropped);
    the text itself when none is left."""
    words: list[str] = []
    seen: set[str] = set()
    for word in _WORD.findall(text):
        low = word.lower()
        if len(low) < 2 or low in _STOP or low in seen:
            continue
        seen.add(low)
        words.append(word)
    return " ".join(words) or text


def _answer(session: int, turn: int) -> str:
    return f"Answer {turn + 1} of session {session + 1}, from the documents retrieved."


def agent_sessions(name: str, workload: Workload, sessions: int | None) -> list[AgentSession]:
    """The first ``sessions`` sessions of agent workload ``name`` (all when ``None``).

    Args:
        name: a search agent workload (:func:`source_workload`).
        workload: its :func:`source_workload`, loaded.
        sessions: how many, ``int >= 1`` or ``None``.

    Raises:
        ValueError: an unknown ``name`` or a bad ``sessions``.
    """
    source_workload(name)
    if sessions is not None and (
        isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1
    ):
        raise ValueError(f"sessions must be an int >= 1 or None, got {sessions!r}")
    groups: list[list[Request]] = []
    if name == "agentic-multihop-rag":
        requests = workload.requests
        groups = [
            list(requests[i : i + MULTIHOP_TURNS]) for i in range(0, len(requests), MULTIHOP_TURNS)
        ]
    else:
        by_conversation: dict[str, list[Request]] = {}
        for request in workload.requests:
            by_conversation.setdefault(request.conversation_id or request.id, []).append(request)
        groups = list(by_conversation.values())
    out: list[AgentSession] = []
    for number, group in enumerate(groups[:sessions]):
        turns: list[AgentTurn] = []
        for position, request in enumerate(group):
            if name == "agentic-mtrag" and position > 0:
                follow = f"{group[position - 1].query} {request.query}"
            else:
                follow = keyword_query(request.query)
            calls = tuple(ToolCall(SEARCH_TOOL, {"query": q}) for q in (request.query, follow))
            turns.append(AgentTurn(request.query, calls, _answer(number, position), request.id))
        key = str(group[0].conversation_id)[:8] if name == "agentic-mtrag" else "questions"
        out.append(AgentSession(f"{number + 1}:{key}", group[0].scope, tuple(turns)))
    return out


class ScopedBM25Retriever(BaseRetriever):
    """A LangChain retriever over one scope of a :class:`ScopedBM25` index: the top ``k``
    documents, best first, each with its dataset id as ``metadata["id"]``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    index: ScopedBM25
    scope: str
    k: int = TOP_K

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[LCDocument]:
        found = self.index.retrieve(
            Request(id="agent-search", query=query, scope=self.scope), self.k
        )
        return [LCDocument(page_content=d.text, metadata={"id": d.id}) for d in found]

    def search(self, query: str) -> list[Document]:
        """The workload documents for ``query`` (the same ranking, for non-LangChain tools)."""
        return self.index.retrieve(
            Request(id="agent-search", query=query, scope=self.scope), self.k
        )
