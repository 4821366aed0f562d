"""Prompt rendering: the one function every adapter uses to lay a request out.

Layout (docs/DESIGN.md, "Prompt layout"):
``[system prompt][block 1]...[block n][location hints][order annotation][question]``.

Everything that can be shared across requests comes first and is rendered from the block's
text and its prompt position alone: block ``i`` is labelled ``[Doc i]`` by position, never by
its original rank, score or anything request-specific. The order annotation (ContextPilot
paper, section 4.4: the original relevance order, after the documents) and the question come
last.

Token boundaries: byte-identical is not token-identical, because a BPE tokenizer can merge
characters across a join. Every rendered block ends with a separator line of punctuation and a
single newline (``"-----\\n"`` by default), and the next segment starts with a non-space
character. Pre-tokenizers of the GPT-2 / Llama 3 family never merge across that point
(punctuation, then one newline, then ``[``), so the tokens of a longer prompt start with the
tokens of any shorter prompt that shares its blocks; ``tests/engines`` checks it with a real
BPE tokenizer. A separator made only of whitespace (for example ``"\\n\\n"``) would not be
stable: ``"\\n\\n"`` alone and ``"\\n\\n["`` tokenize differently.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

__all__ = ["DEFAULT_SYSTEM_PROMPT", "PromptLayout"]


@functools.lru_cache(maxsize=4096)
def _format_label(template: str, number: int) -> str:
    # Labels repeat in every prompt ("[Doc 1]", "[Doc 2]", ...): format each once.
    return template.format(position=number)


@functools.lru_cache(maxsize=1024)
def _format_labels(template: str, count: int) -> tuple[str, ...]:
    # A prompt of ``count`` blocks shows the labels of positions 0 .. count - 1: one look-up
    # per prompt, not one per block (docs/DESIGN.md, "Hot path").
    return tuple(_format_label(template, number) for number in range(1, count + 1))


@functools.lru_cache(maxsize=64)
def _label_then_text(template: str) -> tuple[str, str, str] | None:
    # ``template`` as ``before {label} between {text} after`` (each field once, the label
    # first, no conversion or spec; ``{{`` and ``}}`` in the literals read as braces), so a
    # block renders as one join of its label's head, its text and ``after``, with no format
    # string parsed per block (docs/DESIGN.md, "Hot path"); None for any other template.
    literals, fields = [""], []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        literals[-1] += literal
        if name is None:
            continue
        if spec or conversion is not None:
            return None
        fields.append(name)
        literals.append("")
    if fields != ["label", "text"]:
        return None
    before, between, after = literals
    return before, between, after


@functools.lru_cache(maxsize=1024)
def _block_heads(label_template: str, before: str, between: str, count: int) -> tuple[str, ...]:
    # What comes before the text of the blocks at positions 0 .. count - 1 (see
    # :func:`_label_then_text`): one look-up per prompt.
    return tuple(before + label + between for label in _format_labels(label_template, count))


@functools.lru_cache(maxsize=64)
def _positional_block_format(template: str) -> Callable[[str, str], str] | None:
    # ``template.format(label=..., text=...)`` as a positional format (``{label}`` is ``{0}``,
    # ``{text}`` is ``{1}``), the same string without a keyword dict per block
    # (docs/DESIGN.md, "Hot path"); None when a field is anything else (an attribute, an
    # index, a nested field in a spec), which keeps the keyword form.
    pieces = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        pieces.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if name not in ("label", "text") or "{" in (spec or ""):
            return None
        pieces.append("{" + ("0" if name == "label" else "1"))
        pieces.append(f"!{conversion}" if conversion else "")
        pieces.append(f":{spec}}}" if spec else "}")
    return "".join(pieces).format


DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents below. "
    "Cite documents by their labels, for example [Doc 1]."
)


@dataclass(frozen=True)
class PromptLayout:
    """How a plan becomes prompt text.

    Attributes:
        system_prompt: shared by every request; rendered as the first segment (plain-text
            form, followed by one newline) or as the system message (chat form).
        block_template: ``str.format`` template with ``{label}`` and ``{text}``; must end with
            ``block_separator``.
        label_template: the label of prompt position ``{position}`` (1-based).
        block_separator: the end of every rendered block (see the module docstring).
        annotation_template: ``{order}`` is the labels in original relevance order joined by
            ``annotation_joiner``.
        question_template: ``{question}``.
        turn_header: ``{turn}``; opens each turn of a multi-turn prompt
            (:meth:`render_turns`); the hints name turns by these numbers. Ends with a newline
            and starts with a non-space character, the token boundary described above.

    Raises:
        ValueError: a template without its fields, or a block template that does not end with
            ``block_separator``.
    """

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    block_template: str = "{label}\n{text}\n-----\n"
    label_template: str = "[Doc {position}]"
    block_separator: str = "-----\n"
    annotation_template: str = "Read the documents in this priority order: {order}.\n"
    annotation_joiner: str = " > "
    hint_template: str = "{hint}\n"
    question_template: str = "Question: {question}\nAnswer:"
    turn_header: str = "### Turn {turn}\n"

    def __post_init__(self) -> None:
        checks = (
            ("block_template", self.block_template, ("{label}", "{text}")),
            ("label_template", self.label_template, ("{position}",)),
            ("annotation_template", self.annotation_template, ("{order}",)),
            ("hint_template", self.hint_template, ("{hint}",)),
            ("question_template", self.question_template, ("{question}",)),
            ("turn_header", self.turn_header, ("{turn}",)),
        )
        for name, template, fields in checks:
            for f in fields:
                if f not in template:
                    raise ValueError(f"{name} must contain {f}, got {template!r}")
        if not self.block_template.endswith(self.block_separator):
            raise ValueError(
                f"block_template must end with block_separator {self.block_separator!r}, "
                f"got {self.block_template!r}"
            )
        if not isinstance(self.system_prompt, str):
            raise TypeError(f"system_prompt must be a str, got {self.system_prompt!r:.80}")

    # ------------------------------------------------------------------ pieces
    def label(self, position: int) -> str:
        """Label of 0-based prompt position ``position`` (``"[Doc 1]"`` for 0)."""
        return _format_label(self.label_template, position + 1)

    def labels(self, count: int) -> tuple[str, ...]:
        """Labels of prompt positions ``0 .. count - 1``, in order."""
        return _format_labels(self.label_template, count)

    def render_block(self, position: int, text: str) -> str:
        """The rendered block at 0-based ``position``: label, text, separator."""
        return self.block_template.format(label=self.label(position), text=text)

    def system_segment(self) -> str:
        """The plain-text form's first segment ("" when there is no system prompt)."""
        return f"{self.system_prompt}\n" if self.system_prompt else ""

    def annotation(self, labels: Sequence[str]) -> str:
        """The order annotation for ``labels`` (highest priority first); "" for < 2 labels."""
        if len(labels) < 2:
            return ""
        return self.annotation_template.format(order=self.annotation_joiner.join(labels))

    def tail(
        self,
        question: str,
        *,
        annotation_labels: Sequence[str] = (),
        hints: Sequence[str] = (),
    ) -> str:
        """Everything after the blocks: hints, order annotation, question."""
        context = self.context_tail(annotation_labels=annotation_labels, hints=hints)
        return context + self.question_template.format(question=question)

    def context_tail(
        self, *, annotation_labels: Sequence[str] = (), hints: Sequence[str] = ()
    ) -> str:
        """The part of the tail that belongs to the context: hints, then the annotation."""
        if not hints:
            return self.annotation(annotation_labels)
        hint_text = "".join([self.hint_template.format(hint=h) for h in hints])
        return hint_text + self.annotation(annotation_labels)

    # ------------------------------------------------------------------ whole prompts
    def render_segments(
        self,
        blocks: Sequence[str],
        question: str,
        *,
        annotation_order: Sequence[int] | None = None,
        annotation_labels: Sequence[str] | None = None,
        hints: Sequence[str] = (),
    ) -> list[str]:
        """The prompt as segments: ``[system, block 1, ..., block n, tail]``.

        Args:
            blocks: block texts in prompt order.
            question: the user's question (rendered last).
            annotation_order: 0-based prompt positions in original relevance order; the
                annotation lists their labels. ``None``: no annotation.
            annotation_labels: explicit labels instead of ``annotation_order`` (used when
                some blocks are replaced by hints and are referred to by another label).
            hints: location hints, one line each, after the blocks.

        Returns:
            ``len(blocks) + 2`` strings; ``"".join(...)`` is the plain-text prompt. The system
            segment is ``""`` when there is no system prompt.
        """
        if annotation_labels is None:
            annotation_labels = (
                [self.label(p) for p in annotation_order] if annotation_order is not None else []
            )
        # :meth:`render_block` of each, its pieces looked up once (docs/DESIGN.md, "Hot path").
        pieces = _label_then_text(self.block_template)
        if pieces is not None:
            before, between, after = pieces
            heads = _block_heads(self.label_template, before, between, len(blocks))
            rendered = list(map("".join, zip(heads, blocks, repeat(after))))
        elif (positional := _positional_block_format(self.block_template)) is not None:
            rendered = list(map(positional, self.labels(len(blocks)), blocks))
        else:
            block_format = self.block_template.format
            rendered = [
                block_format(label=label, text=text)
                for label, text in zip(self.labels(len(blocks)), blocks)
            ]
        tail = self.tail(question, annotation_labels=annotation_labels, hints=hints)
        return [self.system_segment(), *rendered, tail]

    def render(self, blocks: Sequence[str], question: str, **kwargs: object) -> str:
        """The plain-text prompt: ``"".join(render_segments(...))``."""
        return "".join(self.render_segments(blocks, question, **kwargs))  # type: ignore[arg-type]

    def render_messages(
        self, blocks: Sequence[str], question: str, **kwargs: object
    ) -> list[dict[str, str]]:
        """The chat form: a system message, then one user message (blocks, then the tail)."""
        segments = self.render_segments(blocks, question, **kwargs)  # type: ignore[arg-type]
        return self.messages_from_segments(segments)

    def render_turns(
        self, turns: Sequence[tuple[int, Sequence[str]]]
    ) -> tuple[list[str], list[int]]:
        """A multi-turn prompt's turns: each turn's header, then that turn's segments.

        The one assembly of earlier turns and this turn, for every app that resends its
        conversation (the benchmark's replay, the LlamaIndex chat template): earlier turns are
        rendered exactly as they were sent, so the prompt of turn ``t - 1`` is a byte-identical
        prefix of the prompt of turn ``t`` (RadixAttention, Zheng et al. 2024).

        Args:
            turns: ``(turn number, segments)`` in prompt order, oldest first; the segments are
                what the turn showed after the system prompt (blocks, tail, an answer...).

        Returns:
            ``(segments, starts)``: the segments, and the index in them of each turn's header.
        """
        segments: list[str] = []
        starts: list[int] = []
        for turn, turn_segments in turns:
            starts.append(len(segments))
            segments.append(self.turn_header.format(turn=turn))
            segments.extend(turn_segments)
        return segments, starts

    def messages_from_segments(self, segments: Sequence[str]) -> list[dict[str, str]]:
        """Chat messages from :meth:`render_segments` output."""
        user = "".join(segments[1:])
        if not self.system_prompt:
            return [{"role": "user", "content": user}]
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": user},
        ]
