"""The chat replay's reuse figures: which turns the target applies to, which met it, and whether
a broken prefix was the template's (the earlier prompt) or the answer's (its re-encoded ids)."""

from __future__ import annotations

from contextpilot_bench.chat_replay_report import ChatTurn, reuse_summary


def _turn(
    number: int, cached: int, previous: int, prompt: int, kept: int, **kw: object
) -> ChatTurn:
    fields: dict = {
        "request_id": f"c::{number}",
        "conversation_id": "c",
        "number": number,
        "rid": f"baseline-c::{number}",
        "prompt_tokens": previous + 100,
        "local_prompt_tokens": previous + 100,
        "cached_tokens": cached,
        "ttft_s": 0.1,
        "answer": "an answer",
        "answer_tokens": 3,
        "generated_tokens": 4,
        "previous_tokens": previous,
        "previous_prompt_tokens": prompt,
        "prefix_kept": kept,
        "expected_cached": previous // 32 * 32,
        "trimmed_turns": 0,
        "fits": True,
    }
    fields.update(kw)
    return ChatTurn(**fields)


def test_reuse_summary_tells_template_breaks_from_answer_breaks() -> None:
    turns = [
        _turn(1, 0, 0, 0, 0),
        _turn(2, 320, 330, 300, 330),  # kept, cached 10 whole blocks of 330
        _turn(3, 288, 330, 300, 310),  # broken inside the answer's ids
        _turn(4, 64, 330, 300, 70),  # broken inside the earlier prompt
        _turn(5, 0, 0, 0, 0, trimmed_turns=1, fits=False),  # trimmed: not counted
    ]
    summary = reuse_summary(turns)
    assert summary["later_turns"] == 4
    assert summary["target_applies"] == 3
    assert summary["target_met"] == 1
    assert summary["prefix_broken"] == 2
    assert summary["prefix_broken_by_template"] == 1
    assert summary["prefix_broken_in_answer"] == 1
    assert summary["cached_of_expected"] == (320 + 288 + 64) / (3 * 320)
    assert summary["generated_ids_returned"] == 5
    assert summary["trimmed"] == 1
