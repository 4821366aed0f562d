"""Recent plans, found again by the prompt templates; per conversation, the context already shown.

A LlamaIndex response synthesizer hands its prompt template only the joined node texts
(``context_str``) and the question, never the nodes. The ContextPilot templates therefore find
the plan the post-processor made for those nodes by the joined text itself: the post-processor
files each plan under a 128-bit digest of exactly the ``context_str`` LlamaIndex will build from
the returned nodes (``PromptHelper.repack``: each node's LLM text stripped, empty ones skipped,
joined with a blank line). When several live plans have the same context (identical concurrent
requests), the one armed in the caller's context wins (:mod:`.request_ids`).

Conversations: a chat engine such as ``condense_plus_context`` rebuilds its system message every
turn and keeps only the user and assistant messages, so an earlier turn's documents are not in
the next prompt unless the template puts them there. The templates do: in a conversation, the
context of turn ``t`` is the sections of the earlier turns still kept here, then turn ``t``'s
own section. That makes each turn's prompt start with the previous turn's documents
(byte-identical, a prefix-cache hit) and lets the core replace a repeated document by a hint that
points to where it stands *in the same prompt* (DESIGN.md invariant 1). The post-processor
passes the kept turns to the core as the visible turns (``TurnVisibility.only``), so a hint
never points to a turn the prompt does not show.

Bounded (DESIGN.md invariant 6): at most ``max_plans`` plans (least recently filed dropped) and
``max_conversations`` conversations (least recently used dropped). A conversation keeps its
sections while their tokens stay within ``history_tokens``; past that, the oldest sections are
dropped until at most half the budget is left, so the shared prefix changes once per drop, not
every turn. Thread-safe (one lock).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter
from contextpilot_integrations.core.pilot import Plan

from .request_ids import pending_request

__all__ = ["PlanStore", "StoredPlan", "context_digest"]


def context_digest(context_text: str) -> bytes:
    """128-bit digest of a context string after ``strip()`` (LlamaIndex strips it too)."""
    return hashlib.blake2b(context_text.strip().encode("utf-8"), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A plan as filed by the post-processor.

    Attributes:
        plan: the core :class:`~contextpilot_integrations.core.pilot.Plan`.
        earlier_sections: ``(turn, section text)`` of the earlier turns of its conversation
            that its prompt shows before its own section, oldest first (empty without a
            conversation).
    """

    plan: Plan
    earlier_sections: tuple[tuple[int, str], ...] = ()


class _Conversation:
    __slots__ = ("sections", "tokens")

    def __init__(self) -> None:
        self.sections: OrderedDict[int, tuple[str, int]] = OrderedDict()  # turn -> (text, tokens)
        self.tokens = 0


class PlanStore:
    """Plans by request id and by context digest; rendered sections per conversation.

    Args:
        max_plans: plans kept (least recently filed dropped first); ``>= 1``.
        max_conversations: conversations whose sections are kept (LRU); ``>= 1``.
        history_tokens: token budget of one conversation's kept sections; ``>= 1``.
        token_counter: counts section tokens (default :class:`ApproxTokenCounter`).

    Raises:
        TypeError / ValueError: a bound that is not an int ``>= 1``.
    """

    def __init__(
        self,
        *,
        max_plans: int = 4096,
        max_conversations: int = 1024,
        history_tokens: int = 8192,
        token_counter: TokenCounter | None = None,
    ) -> None:
        for name, value in (
            ("max_plans", max_plans),
            ("max_conversations", max_conversations),
            ("history_tokens", history_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_plans = max_plans
        self.max_conversations = max_conversations
        self.history_tokens = history_tokens
        self.token_counter: TokenCounter = token_counter or ApproxTokenCounter()
        self._lock = threading.Lock()
        self._by_rid: OrderedDict[str, tuple[bytes, StoredPlan]] = OrderedDict()
        self._by_context: dict[bytes, list[str]] = {}
        self._conversations: OrderedDict[tuple[str, str], _Conversation] = OrderedDict()

    # ------------------------------------------------------------------ plans
    def put(self, stored: StoredPlan, context_text: str) -> None:
        """File ``stored`` under its rid and under the digest of ``context_text``."""
        digest = context_digest(context_text)
        rid = stored.plan.rid
        with self._lock:
            self._drop(rid)
            self._by_rid[rid] = (digest, stored)
            self._by_context.setdefault(digest, []).append(rid)
            while len(self._by_rid) > self.max_plans:
                self._drop(next(iter(self._by_rid)))

    def get(self, rid: str) -> StoredPlan | None:
        """The plan filed under ``rid``, or ``None``."""
        with self._lock:
            entry = self._by_rid.get(rid)
            return entry[1] if entry is not None else None

    def find(self, context_text: str) -> StoredPlan | None:
        """The plan whose nodes join to ``context_text`` (after ``strip()``), or ``None``.

        Among several, the one armed in the caller's context, else the most recently filed.
        """
        digest = context_digest(context_text)
        pending = pending_request()
        with self._lock:
            rids = self._by_context.get(digest)
            if not rids:
                return None
            rid = pending.rid if pending is not None and pending.rid in rids else rids[-1]
            return self._by_rid[rid][1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rid)

    def _drop(self, rid: str) -> None:
        entry = self._by_rid.pop(rid, None)
        if entry is None:
            return
        rids = self._by_context.get(entry[0])
        if rids is not None:
            rids.remove(rid)
            if not rids:
                del self._by_context[entry[0]]

    # ------------------------------------------------------------------ conversations
    def conversation_sections(
        self, tenant: str, conversation_id: str
    ) -> tuple[tuple[int, str], ...]:
        """``(turn, section text)`` the next prompt of this conversation shows, oldest first.

        Applies the token budget first (see the module docstring). The planner gets these turns
        as the visible ones and the template renders exactly these texts (they travel with the
        plan in :class:`StoredPlan`), so a later eviction cannot make a hint dangle.
        """
        with self._lock:
            conversation = self._conversations.get((tenant, conversation_id))
            if conversation is None:
                return ()
            self._conversations.move_to_end((tenant, conversation_id))
            if conversation.tokens > self.history_tokens:
                while conversation.sections and conversation.tokens > self.history_tokens // 2:
                    _, (_, tokens) = conversation.sections.popitem(last=False)
                    conversation.tokens -= tokens
            return tuple((turn, text) for turn, (text, _) in conversation.sections.items())

    def record_section(self, tenant: str, conversation_id: str, turn: int, text: str) -> None:
        """Remember that turn ``turn``'s prompt showed ``text`` as its own section.

        Recording a turn again replaces it and drops every later turn (a retried or edited
        turn: later sections were rendered after a history that no longer holds).
        """
        key = (tenant, conversation_id)
        tokens = self.token_counter.count(text)
        with self._lock:
            conversation = self._conversations.get(key)
            if conversation is None:
                conversation = self._conversations[key] = _Conversation()
                while len(self._conversations) > self.max_conversations:
                    self._conversations.popitem(last=False)
            else:
                self._conversations.move_to_end(key)
            for later in [t for t in conversation.sections if t >= turn]:
                conversation.tokens -= conversation.sections.pop(later)[1]
            conversation.sections[turn] = (text, tokens)
            conversation.tokens += tokens

    def forget(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's sections. ``False`` if unknown."""
        with self._lock:
            return self._conversations.pop((tenant, conversation_id), None) is not None

    def conversation_count(self) -> int:
        with self._lock:
            return len(self._conversations)
