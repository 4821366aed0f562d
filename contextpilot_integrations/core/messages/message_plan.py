"""What planning a conversation's messages returns: the messages to send and where every tool
result and document went (docs/DESIGN.md, "Lossless")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MessagePlan", "ResultPlacement", "ResultStatus"]

ResultStatus = Literal["kept", "pointer"]


@dataclass(frozen=True, slots=True)
class ResultPlacement:
    """Where one tool result, or one document inside a tool result, went.

    Attributes:
        message: index of the message holding the result.
        block: index of the ``tool_result`` block in that message's content (Anthropic);
            ``None`` (OpenAI).
        call_id: the call the result answers.
        document: the document's 0-based index among the result's documents (a run of lines,
            reason ``"same lines"``, is numbered after them, in order); ``None``: the
            placement is about the whole result.
        label: the document's label in this result, as written; ``None``: none or whole result.
        status: ``"kept"`` (sent as given) or ``"pointer"`` (replaced by a pointer).
        replayed: the message was replayed from the conversation's memory (the placement is
            the one made when it was first sent).
        reason: why: ``"kept"`` placements say why no pointer was made (``"no earlier copy"``,
            ``"saves too little"``, ``"ambiguous call"``, ``"not plain text"``,
            ``"not verified"``, ...); pointers say ``"same result"``, ``"same document"`` or
            ``"same lines"`` (a run of whole lines: :mod:`.repeated_lines`).
        target_message, target_block: where the earlier copy stands (same shape as
            ``message``, ``block``); ``None`` when kept.
        target_document, target_label: the earlier copy's document index and label in its
            result; ``None`` when the pointer names the whole earlier result or a run of its
            lines, or when kept.
        target_call: the earlier tool call the pointer names, ``name(arguments)``.
        original: the exact text the pointer replaced (the whole result's text, the
            document's span, or the run's lines with their endings); ``None`` when kept.
        pointer: the pointer as it stands in the sent result (for JSON documents: escaped as
            the inside of a JSON string); ``None`` when kept.
        offset: where ``pointer`` starts in the sent result's text; ``None`` when kept.
        tokens_saved: tokens of ``original`` minus tokens of ``pointer`` (0 when kept).
    """

    message: int
    block: int | None
    call_id: str
    document: int | None
    label: str | None
    status: ResultStatus
    replayed: bool
    reason: str
    target_message: int | None = None
    target_block: int | None = None
    target_document: int | None = None
    target_label: str | None = None
    target_call: str | None = None
    original: str | None = None
    pointer: str | None = None
    offset: int | None = None
    tokens_saved: int = 0


@dataclass(frozen=True, slots=True)
class MessagePlan:
    """The messages to send for one LLM call of a conversation.

    Attributes:
        messages: the messages to send (new dicts; the caller's are never changed).
        system: Anthropic's separate system prompt, as given (never rewritten).
        api: the shape, ``"openai"`` or ``"anthropic"``.
        replayed: how many leading messages were sent exactly as they were sent before.
        diverged_at: index of the first message where the given history stopped extending what
            was sent before (an edited, summarised, trimmed or removed message); ``None``: no
            divergence (an extension, or nothing remembered).
        placements: one per tool result and one per detected document of a result not replaced
            whole, in order of position.
        tokens_removed: sum of ``tokens_saved`` over the placements (replayed ones included:
            what the sent messages save against the given ones).
    """

    messages: list[dict[str, Any]]
    system: Any
    api: str
    replayed: int
    diverged_at: int | None
    placements: tuple[ResultPlacement, ...]
    tokens_removed: int

    @property
    def pointers(self) -> tuple[ResultPlacement, ...]:
        """The placements that are pointers."""
        return tuple(p for p in self.placements if p.status == "pointer")
