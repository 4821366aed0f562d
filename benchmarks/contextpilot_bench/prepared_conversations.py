"""A conversation workload with its retrieval done, and the order its turns are sent in.

Shared by the multi-turn replays (:mod:`~contextpilot_bench.multiturn` with the
recorded answers, :mod:`~contextpilot_bench.chat_replay` with a model's own), once
for all methods of a run. :func:`prepare_conversations` groups a workload's requests into
conversations (turns numbered in arrival order) and retrieves each turn's top-``k`` BM25 blocks
of its collection (:mod:`~contextpilot_bench.retrieval`) for the new user turn
(``retrieval_query="turn"``) or for the user turns so far joined by spaces (``"conversation"``,
the input of MTRAG's own ``questions`` retrieval task).

Interleaving (:func:`interleave_turns`, ``sessions=N``): ``N`` conversations are open at a time;
each round sends the next turn of every open conversation in turn, and a finished conversation's
slot goes to the next one in file order (the paper's hybrid multi-session setting). ``N=1``
replays conversations one after the other.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.workloads import Request, Workload
from contextpilot_integrations.core.blocks import TokenCounter, block_id
from contextpilot_integrations.core.rendering import PromptLayout

__all__ = [
    "RETRIEVAL_QUERIES",
    "PreparedConversations",
    "RepeatShare",
    "ReplayTurn",
    "interleave_turns",
    "prepare_conversations",
]

logger = logging.getLogger(__name__)

RETRIEVAL_QUERIES = ("turn", "conversation")


@dataclass(frozen=True, slots=True)
class ReplayTurn:
    """One user turn with its retrieval done.

    Attributes:
        request_index: position of the request in the workload's arrival order.
        request_id: the workload's request id.
        conversation_id: the conversation.
        number: 1-based turn number within the conversation (the prompt's turn header).
        question: the user's turn, rendered as the question.
        answer: the agent's recorded answer (shown in later turns' history), or ``None``.
        blocks: the retrieved block texts in retriever order (best first).
    """

    request_index: int
    request_id: str
    conversation_id: str
    number: int
    question: str
    answer: str | None
    blocks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RepeatShare:
    """Retrieved blocks that an earlier turn of the same conversation also retrieved.

    Counted per turn over its distinct block texts; tokens by the run's token counter.
    """

    blocks: int
    repeated_blocks: int
    tokens: int
    repeated_tokens: int

    @property
    def block_share(self) -> float:
        return self.repeated_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_share(self) -> float:
        return self.repeated_tokens / self.tokens if self.tokens else 0.0


@dataclass
class PreparedConversations:
    """A conversation workload with its retrieval done, shared by all methods of a run.

    Attributes:
        workload: the workload.
        k: blocks retrieved per turn.
        retrieval_query: ``"turn"`` or ``"conversation"`` (see the module docstring).
        conversations: each conversation's turns in order; conversations in first-seen order.
        layout: the prompt layout every method renders with.
        counter: the token counter every method counts with.
    """

    workload: Workload
    k: int
    retrieval_query: str
    conversations: list[list[ReplayTurn]]
    layout: PromptLayout
    counter: TokenCounter

    @property
    def turns(self) -> int:
        """Number of turns (requests) in all conversations."""
        return sum(len(c) for c in self.conversations)

    @property
    def unique_block_tokens(self) -> int:
        """Sum of the token counts of the distinct retrieved block texts."""
        texts = {b for conv in self.conversations for turn in conv for b in turn.blocks}
        return sum(self.counter.count(t) for t in texts)

    @property
    def repeat_share(self) -> RepeatShare:
        """The share of retrieved blocks an earlier turn of the same conversation retrieved."""
        blocks = repeated = tokens = repeated_tokens = 0
        for conversation in self.conversations:
            earlier: set[int] = set()
            for turn in conversation:
                this_turn = {block_id(b): b for b in turn.blocks}
                for bid, text in this_turn.items():
                    count = self.counter.count(text)
                    blocks += 1
                    tokens += count
                    if bid in earlier:
                        repeated += 1
                        repeated_tokens += count
                earlier |= this_turn.keys()
        return RepeatShare(blocks, repeated, tokens, repeated_tokens)


def prepare_conversations(
    workload: Workload,
    k: int,
    *,
    counter: TokenCounter,
    layout: PromptLayout | None = None,
    retrieval_query: str = "turn",
) -> PreparedConversations:
    """Group the workload's requests into conversations and retrieve each turn's top-``k``.

    Turns are numbered 1, 2, ... in arrival order within their conversation.

    Raises:
        ValueError: a request without ``conversation_id``, an unknown ``retrieval_query``,
            ``k <= 0``.  TypeError: ``k`` is not an int.
    """
    if retrieval_query not in RETRIEVAL_QUERIES:
        raise ValueError(
            f"retrieval_query must be one of {RETRIEVAL_QUERIES}, got {retrieval_query!r}"
        )
    grouped: dict[str, list[tuple[int, Request]]] = {}
    for i, request in enumerate(workload.requests):
        if request.conversation_id is None:
            raise ValueError(
                f"workload {workload.name!r}: request {request.id!r} has no conversation_id; "
                "a multi-turn replay needs one per request"
            )
        grouped.setdefault(request.conversation_id, []).append((i, request))
    retriever = ScopedBM25(workload)
    conversations: list[list[ReplayTurn]] = []
    for conversation_id, requests in grouped.items():
        turns: list[ReplayTurn] = []
        asked: list[str] = []
        for number, (i, request) in enumerate(requests, start=1):
            asked.append(request.query)
            query = request
            if retrieval_query == "conversation":
                query = Request(request.id, " ".join(asked), conversation_id, request.scope)
            blocks = tuple(d.text for d in retriever.retrieve(query, k))
            turns.append(
                ReplayTurn(
                    i, request.id, conversation_id, number, request.query, request.answer, blocks
                )
            )
        conversations.append(turns)
    logger.info(
        "prepared %d conversations, %d turns, top-%d by %s",
        len(conversations),
        len(workload.requests),
        k,
        retrieval_query,
    )
    return PreparedConversations(
        workload, k, retrieval_query, conversations, layout or PromptLayout(), counter
    )


def interleave_turns(
    conversations: Sequence[Sequence[ReplayTurn]], sessions: int
) -> list[ReplayTurn]:
    """The send order with ``sessions`` conversations open at a time (round robin).

    Each round sends the next turn of every open conversation, in the order they were opened; a
    finished conversation's slot goes to the next unopened one before the next round.

    Returns:
        Every turn once; each conversation's turns in their own order.

    Raises:
        TypeError: ``sessions`` is not an int.  ValueError: ``sessions < 1``.
    """
    if isinstance(sessions, bool) or not isinstance(sessions, int):
        raise TypeError(f"sessions must be an int, got {type(sessions).__name__}: {sessions!r}")
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    waiting = deque(c for c in conversations if c)
    open_: list[deque[ReplayTurn]] = []
    order: list[ReplayTurn] = []
    while waiting or open_:
        while len(open_) < sessions and waiting:
            open_.append(deque(waiting.popleft()))
        for conversation in open_:
            order.append(conversation.popleft())
        open_ = [c for c in open_ if c]
    return order
