"""The chat replay's turns and reuse figures (:mod:`~contextpilot_bench.chat_replay`): one
turn as sent and answered (:class:`ChatTurn`), the target, one method's summary and the plot.

The target: on every later turn whose history fits in the cache (:attr:`ChatTurn.fits`), the
engine's cached tokens are at least :data:`REUSE_TARGET` of the previous turn's prompt plus
answer as the engine computed it, rounded down to whole blocks (``ChatTurn.expected_cached``).
:func:`reuse_summary` counts the turns where it applies and where it was met, and tells a prefix
broken by the template from one broken in the answer's re-encoded ids; :func:`plot_reuse` draws
cached against expected tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["REUSE_TARGET", "ChatTurn", "plot_reuse", "reuse_summary"]

REUSE_TARGET = 0.99
"""Cached tokens at least this share of the previous turn's prompt plus answer (whole blocks)."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One turn as sent and answered.

    Attributes:
        request_id: the workload's request id (``<conversation>::<turn>``).
        conversation_id: the conversation.
        number: the turn number.
        rid: the request id sent to the engine.
        prompt_tokens: the engine's ``usage.prompt_tokens``.
        local_prompt_tokens: the same prompt through the local template and tokenizer.
        cached_tokens: the engine's cached tokens (None: not reported).
        ttft_s: time to first token, seconds.
        answer: the generated text.
        answer_tokens: its tokens as the tokenizer encodes the text.
        generated_tokens: the ids the engine generated, the stop token included (None: the
            engine did not return them; ``answer_tokens`` stand in then).
        previous_tokens: the previous turn's prompt plus the answer ids the engine computed
            (all generated ids but the last; 0 for a first turn or when earlier turns were
            trimmed away).
        previous_prompt_tokens: of those, the previous turn's prompt.
        prefix_kept: of ``previous_tokens``, how many start this turn's local ids (equal to it
            when history is stable; below ``previous_prompt_tokens``: the template re-rendered
            the earlier prompt; between: the answer's text re-encodes to other ids).
        expected_cached: ``previous_tokens`` rounded down to whole blocks (what the engine can
            reuse when the prefix is kept and cached).
        trimmed_turns: earlier turns dropped to fit ``max_model_len``.
        fits: the turn's history fits in the cache (nothing trimmed, the prompt within the
            engine's KV cache): where the reuse target applies.
    """

    request_id: str
    conversation_id: str
    number: int
    rid: str
    prompt_tokens: int
    local_prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    answer: str
    answer_tokens: int
    generated_tokens: int | None
    previous_tokens: int
    previous_prompt_tokens: int
    prefix_kept: int
    expected_cached: int
    trimmed_turns: int
    fits: bool


def reuse_summary(turns: Sequence[ChatTurn]) -> dict[str, Any]:
    """The reuse figures of one method's turns: later turns, those where the target applies,
    those that met it, the template's prefix breaks, and cached against expected tokens."""
    later = [t for t in turns if t.number > 1]
    applies = [t for t in later if t.fits and t.previous_tokens]
    met = [t for t in applies if (t.cached_tokens or 0) >= REUSE_TARGET * t.expected_cached]
    broken = [t for t in applies if t.prefix_kept < t.previous_tokens]
    by_template = [t for t in broken if t.prefix_kept < t.previous_prompt_tokens]
    cached = sum(t.cached_tokens or 0 for t in applies)
    expected = sum(t.expected_cached for t in applies)
    prompt = sum(t.prompt_tokens for t in turns)
    return {
        "turns": len(turns),
        "later_turns": len(later),
        "target_applies": len(applies),
        "target_met": len(met),
        "prefix_broken": len(broken),
        "prefix_broken_by_template": len(by_template),
        "prefix_broken_in_answer": len(broken) - len(by_template),
        "prefix_broken_examples": [
            {
                "request_id": t.request_id,
                "kept": t.prefix_kept,
                "of": t.previous_tokens,
                "prompt": t.previous_prompt_tokens,
            }
            for t in broken[:5]
        ],
        "generated_ids_returned": sum(1 for t in turns if t.generated_tokens is not None),
        "trimmed": sum(1 for t in turns if t.trimmed_turns),
        "cached_of_expected": cached / expected if expected else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens or 0 for t in turns),
        "hit_ratio": sum(t.cached_tokens or 0 for t in turns) / prompt if prompt else 0.0,
        "local_token_mismatches": sum(1 for t in turns if t.prompt_tokens != t.local_prompt_tokens),
    }


def plot_reuse(path: Path, turns: Mapping[str, Sequence[ChatTurn]]) -> Path:
    """Save a PNG: per later turn, the engine's cached tokens against the previous turn's prompt
    plus answer (whole blocks), one colour per method, with the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axis = plt.subplots(figsize=(7, 5.5))
    top = 1
    for i, (method, sent) in enumerate(turns.items()):
        points = [t for t in sent if t.previous_tokens]
        x = [t.expected_cached for t in points]
        y = [t.cached_tokens or 0 for t in points]
        top = max([top, *x, *y])
        axis.scatter(x, y, s=12, color=f"C{i}", label=method, alpha=0.7)
    axis.plot([0, top], [0, top], ":", color="grey", label="cached = previous prompt + answer")
    axis.plot([0, top], [0, REUSE_TARGET * top], "--", color="grey", label=f"{REUSE_TARGET} target")
    axis.set_xlabel("previous turn's prompt + answer tokens, whole blocks")
    axis.set_ylabel("engine cached tokens")
    axis.set_title("multi-turn with the model's own answers (SmolLM2, vLLM CPU)")
    axis.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
