"""What replaces repeated text in a prompt: the wording of location hints and sub-block pointers.

Used by :mod:`.dedup`. The defaults read ``Also relevant: [Doc 3] of turn 2, shown above.`` for
a whole block and ``[Repeated passage: see [Doc 3] of turn 2, from "first words" to "last
words".]`` for a run of sub-blocks (the quoted ends let the model find the passage inside the
named block, whose sub-block boundaries it cannot see; about 30 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from contextpilot_integrations.core.conversations.turns import Location

__all__ = ["HintWording", "line_ending", "quote_ends"]

_QUOTE_CHARS = 40  # longest quoted end in a sub-block pointer, in characters


@dataclass(frozen=True, slots=True)
class HintWording:
    """Wording of what replaces repeated text (``str.format`` templates).

    Attributes:
        earlier_turn: a place in an earlier turn; fields ``{label}``, ``{turn}``.
        this_turn: a place earlier in the same prompt; field ``{label}``.
        block_hint: the hint for a replaced block; fields ``{where}`` (one of the two above),
            ``{label}``, ``{turn}``.
        sub_block_pointer: what replaces a run of sub-blocks inside a kept block; fields
            ``{where}``, ``{label}``, ``{turn}``, ``{part}`` (1-based index of the run's first
            sub-block in the block it points to), ``{head}`` and ``{tail}`` (the run's first
            and last ``quote_words`` words, at most 40 characters each). The run's final line
            ending is appended to it.
        quote_words: words quoted at each end of a replaced run (``>= 1``).

    Raises:
        ValueError: a template uses an unknown field or is not a valid format string, or
            ``quote_words < 1``.
    """

    earlier_turn: str = "{label} of turn {turn}"
    this_turn: str = "{label} in this message"
    block_hint: str = "Also relevant: {where}, shown above."
    sub_block_pointer: str = '[Repeated passage: see {where}, from "{head}" to "{tail}".]'
    quote_words: int = 6

    def __post_init__(self) -> None:
        sample = {"label": "[Doc 1]", "turn": 1, "part": 1, "head": "a", "tail": "b", "where": "w"}
        allowed = {
            "earlier_turn": ("label", "turn"),
            "this_turn": ("label",),
            "block_hint": ("where", "label", "turn"),
            "sub_block_pointer": ("where", "label", "turn", "part", "head", "tail"),
        }
        for name, fields in allowed.items():
            template = getattr(self, name)
            if not isinstance(template, str):
                raise TypeError(f"HintWording.{name} must be a str, got {template!r}")
            try:
                template.format(**{f: sample[f] for f in fields})
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"HintWording.{name} = {template!r} is not a valid template with fields "
                    f"{', '.join('{' + f + '}' for f in fields)}: {exc!r}"
                ) from exc
        if isinstance(self.quote_words, bool) or not isinstance(self.quote_words, int):
            raise TypeError(f"HintWording.quote_words must be an int, got {self.quote_words!r}")
        if self.quote_words < 1:
            raise ValueError(f"HintWording.quote_words must be >= 1, got {self.quote_words}")

    def where(self, place: Location, turn: int) -> str:
        """How ``place`` is named in a prompt for ``turn``."""
        if place.turn == turn:
            return self.this_turn.format(label=place.label)
        return self.earlier_turn.format(label=place.label, turn=place.turn)


def quote_ends(text: str, words: int) -> tuple[str, str]:
    """First and last ``words`` words of ``text`` (whitespace collapsed), each shortened to
    whole words within ``_QUOTE_CHARS`` characters (a single longer word is cut)."""
    tokens = text.split()
    return _fit(tokens[:words], from_end=False), _fit(tokens[-words:], from_end=True)


def _fit(words: list[str], *, from_end: bool) -> str:
    """Join ``words`` with spaces, keeping those within ``_QUOTE_CHARS`` characters counted
    from the start (or from the end)."""
    if not words:
        return ""
    order = list(reversed(words)) if from_end else words
    first = order[0][-_QUOTE_CHARS:] if from_end else order[0][:_QUOTE_CHARS]
    kept, size = [first], len(first)
    for word in order[1:]:
        size += 1 + len(word)
        if size > _QUOTE_CHARS:
            break
        kept.append(word)
    return " ".join(reversed(kept) if from_end else kept)


def line_ending(text: str) -> str:
    if text.endswith("\r\n"):
        return "\r\n"
    return "\n" if text.endswith("\n") else ""
