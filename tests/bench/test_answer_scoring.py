"""Answer scoring: SQuAD normalisation, the three metrics, label-only answers, the references of
the real workloads and the bootstrap intervals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from contextpilot_bench.answer_scoring import (
    bootstrap_interval,
    bootstrap_statistic,
    is_label_only,
    normalize_answer,
    paired_difference,
    reference_answers,
    score_answer,
    score_methods,
)
from contextpilot_bench.workloads import load_workload


def test_normalisation_is_squads() -> None:
    assert normalize_answer("  The  Capital, of France! ") == "capital of france"
    assert normalize_answer("An apple a day") == "apple day"


@pytest.mark.parametrize(
    ("answer", "reference", "exact", "contained"),
    [
        ("Yes.", "Yes", 1.0, 1.0),
        ("Yes, the article says so.", "yes", 0.0, 1.0),
        ("The answer is: no.", "no", 0.0, 1.0),
        ("Google", "Google", 1.0, 1.0),
        ("Googles", "Google", 0.0, 0.0),  # a whole-word phrase, not a substring
        ("Not mentioned", "Polygon", 0.0, 0.0),
        ("", "Yes", 0.0, 0.0),
    ],
)
def test_exact_match_and_gold_contained(
    answer: str, reference: str, exact: float, contained: float
) -> None:
    score = score_answer(answer, [reference])
    assert score.exact_match == exact
    assert score.gold_contained == contained
    assert 0.0 <= score.f1 <= 1.0
    assert score.f1 == 1.0 if exact else True


def test_f1_is_token_overlap_and_the_best_reference_counts() -> None:
    score = score_answer("Paris in France", ["Paris"])
    assert score.f1 == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert score_answer("7 May 2023", ["May 7, 2023", "7 May 2023"]).exact_match == 1.0
    with pytest.raises(ValueError):
        score_answer("x", ["", "  "])


@pytest.mark.parametrize(
    ("answer", "only"),
    [
        ("[Doc 1]", True),
        ("[Doc 3] > [Doc 1].", True),
        ("Doc 2 and Doc 4", True),
        ("Yes [Doc 1]", False),
        ("Yes", False),
        ("", False),
    ],
)
def test_label_only_answers(answer: str, only: bool) -> None:
    assert is_label_only(answer) is only


def test_bootstrap_interval_is_seeded_and_brackets_the_mean() -> None:
    values = [1.0] * 30 + [0.0] * 70
    first = bootstrap_interval(values, seed=3)
    assert first == bootstrap_interval(values, seed=3)
    assert first.mean == pytest.approx(0.3)
    assert first.low < first.mean < first.high
    assert first.low > 0.15 and first.high < 0.45
    with pytest.raises(ValueError):
        bootstrap_interval([])


def test_bootstrap_statistic_of_the_mean_is_the_bootstrap_interval() -> None:
    values = np.random.default_rng(3).normal(size=40)
    by_index = bootstrap_statistic(lambda picks: float(values[picks].mean()), len(values))
    assert by_index == bootstrap_interval(values)  # the same seeded resamples
    median = bootstrap_statistic(lambda picks: float(np.median(values[picks])), len(values))
    assert median.mean == pytest.approx(float(np.median(values)))
    assert median.low < median.mean < median.high
    with pytest.raises(ValueError):
        bootstrap_statistic(lambda picks: 0.0, 0)


def test_paired_difference_sees_a_per_question_effect() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, 200).astype(float)
    better = np.maximum(base, rng.integers(0, 2, 200) * (rng.random(200) < 0.2))
    assert paired_difference(base, base).mean == 0.0
    assert not paired_difference(base, base).excludes_zero()
    difference = paired_difference(better, base)
    assert difference.mean > 0 and difference.excludes_zero()
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 0.0])


def test_score_methods_pairs_on_the_questions_all_answered() -> None:
    references = {"q1": ("yes",), "q2": ("no",), "q3": ("Paris",)}
    answers = {
        "baseline": {"q1": "Yes", "q2": "Yes", "q3": "Paris", "q4": "x"},
        "other": {"q1": "Yes", "q2": "No", "q3": "[Doc 1]"},
    }
    scored = score_methods(answers, references, resamples=200)
    assert [s.method for s in scored] == ["baseline", "other"]
    assert all(s.questions == 3 and s.question_ids == ["q1", "q2", "q3"] for s in scored)
    assert scored[0].vs_baseline == {}
    assert scored[0].metrics["exact_match"].mean == pytest.approx(2 / 3)
    assert scored[1].metrics["label_only"].mean == pytest.approx(1 / 3)
    assert scored[1].vs_baseline["exact_match"].mean == pytest.approx(0.0)
    assert score_methods({}, references) == []
    assert score_methods({"a": {"zz": "x"}}, references) == []


def test_references_of_the_real_workloads(data_dir: Path) -> None:
    multihop = reference_answers("multihop-rag", data_dir)
    ids = {r.id for r in load_workload("multihop-rag", data_dir).requests}
    assert set(multihop) == ids and len(ids) == 500
    assert all(len(r) == 1 and r[0] for r in multihop.values())

    locomo = reference_answers("locomo", data_dir)
    requests = load_workload("locomo", data_dir).requests
    assert set(locomo) < {r.id for r in requests}
    assert 1400 < len(locomo) < len(requests)  # adversarial questions record no answer

    mtrag = reference_answers("mtrag", data_dir)
    turns = load_workload("mtrag-conversations", data_dir).requests
    assert set(mtrag) == {r.id for r in turns}
    last = {}
    for r in turns:
        last[r.conversation_id] = r
    for r in turns:
        if r.answer is not None:
            assert mtrag[r.id] == (r.answer,)  # an earlier turn: the recorded reply
    assert all(mtrag[r.id] for r in last.values())  # the last turn: the task's targets
    with pytest.raises(ValueError, match="no reference answers"):
        reference_answers("hotpotqa", data_dir)
