"""Per conversation, the section of context each earlier turn's prompt showed.

A chat engine such as ``condense_plus_context`` rebuilds its system message every turn and keeps
only the user and assistant messages, so an earlier turn's documents are not in the next prompt
unless the template puts them there. The ContextPilot chat template does: in a conversation,
the context of turn ``t`` is the sections of the earlier turns still kept here, each after the
layout's turn header, then turn ``t``'s own section
(:meth:`~contextpilot_integrations.core.rendering.PromptLayout.render_turns`). That makes each
turn's prompt start with the previous turn's documents (byte-identical, a prefix-cache hit) and
lets the core replace a repeated document by a hint that points to where it stands *in the same
prompt* (docs/DESIGN.md, "Lossless"). The post-processor passes the kept turns to the core as the
visible turns (``Scope.visibility``), so a hint never points to a turn the prompt does not show.

Bounded (docs/DESIGN.md, "Bounded"): at most ``max_conversations`` conversations (least recently
used dropped, :class:`~contextpilot_integrations.core.lru.LRU`). A conversation keeps its
sections while their tokens stay within ``history_tokens``; past that, the oldest sections are
dropped until at most half the budget is left, so the shared prefix changes once per drop, not
every turn. Thread-safe (one lock).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from contextpilot_integrations.core.lru import LRU

__all__ = ["ConversationSections"]


class _Section(NamedTuple):
    text: str
    tokens: int


def _tokens(section: _Section) -> int:
    return section.tokens


class _Conversation:
    __slots__ = ("last_turn", "sections")

    def __init__(self) -> None:
        self.sections: LRU[int, _Section] = LRU(weight=_tokens)
        self.last_turn = 0


class ConversationSections:
    """The rendered context sections of each conversation's turns, keyed by (tenant, id).

    Args:
        max_conversations: conversations kept (least recently used dropped); an int ``>= 1``.
        history_tokens: token budget of one conversation's kept sections; an int ``>= 1``.

    Raises:
        ValueError: a bound that is not an int ``>= 1``.
    """

    def __init__(self, *, max_conversations: int = 1024, history_tokens: int = 8192) -> None:
        for name, value in (
            ("max_conversations", max_conversations),
            ("history_tokens", history_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_conversations = max_conversations
        self.history_tokens = history_tokens
        self._lock = threading.Lock()
        # (tenant, conversation id) -> its sections (turn -> section, oldest turn first) and
        # the last turn number it was given.
        self._conversations: LRU[tuple[str, str], _Conversation] = LRU(max_conversations)

    # ------------------------------------------------------------------ Public API
    def begin_turn(
        self, tenant: str, conversation_id: str
    ) -> tuple[int, tuple[tuple[int, str], ...]]:
        """The next turn's number and the ``(turn, section text)`` its prompt shows, oldest
        first (marks the conversation used).

        The number is this adapter's own (one more than the last it gave the conversation),
        passed to the planner as ``Scope.turn``: the sections rendered here are numbered the
        same way, so a hint's turn names the section the prompt shows, also when the planner's
        store lost its history (a restarted service). The planner gets these turns as the
        visible ones and the template renders exactly these texts (they travel with the plan
        in :class:`~.plan_store.StoredPlan`), so a later drop cannot make a hint dangle."""
        with self._lock:
            key = (tenant, conversation_id)
            conversation = self._conversations.get(key)
            if conversation is None:
                conversation = _Conversation()
                self._conversations.put(key, conversation)
            conversation.last_turn += 1
            shown = tuple((turn, section.text) for turn, section in conversation.sections.items())
            return conversation.last_turn, shown

    def record(self, tenant: str, conversation_id: str, turn: int, text: str, tokens: int) -> None:
        """Remember that turn ``turn``'s prompt showed ``text`` (``tokens`` long, by the
        planner's counter) as its own section, then apply the token budget.

        Recording a turn again replaces it and drops every later turn (a retried or edited
        turn: later sections were rendered after a history that no longer holds).
        """
        key = (tenant, conversation_id)
        with self._lock:
            conversation = self._conversations.get(key)
            if conversation is None:
                conversation = _Conversation()
                self._conversations.put(key, conversation)
            conversation.last_turn = max(conversation.last_turn, turn)
            sections = conversation.sections
            for later in [t for t in sections if t >= turn]:
                sections.pop(later)
            sections.put(turn, _Section(text, tokens))
            if sections.total_weight > self.history_tokens:
                while sections and sections.total_weight > self.history_tokens // 2:
                    sections.pop_oldest()

    def forget(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's sections. ``False`` if unknown."""
        with self._lock:
            return self._conversations.pop((tenant, conversation_id)) is not None

    def __len__(self) -> int:
        """Conversations held."""
        with self._lock:
            return len(self._conversations)
