"""Generated answers scored against the data's reference answers, with bootstrap intervals.

Metrics per question (the best over its references), after the SQuAD v1.1 evaluation script's
normalisation (Rajpurkar et al. 2016: lower case, punctuation and the articles a/an/the
removed, whitespace collapsed):

- ``exact_match``: the normalised answer equals a normalised reference (0 or 1);
- ``f1``: token F1 between the answer's and a reference's words (bag of words);
- ``gold_contained``: a normalised reference stands in the normalised answer as a whole-word
  phrase (0 or 1): a short gold answer inside a sentence counts;
- ``label_only``: the answer is nothing but document labels (``[Doc 3]``): a small model primed
  by the labels of an order annotation answers so (docs/DESIGN.md, "SmolLM2-135M-Instruct").

References (:func:`reference_answers`, request id -> reference texts):

- ``multihop-rag``: ``ground_truth.json``'s ``answer`` (``Yes``/``No``, a name, or
  ``Insufficient information.`` for the null queries); ``locomo``: each question's ``answer``
  (adversarial questions, category 5, record none and are not scored);
- ``mtrag``, ``mtrag-conversations``: for a conversation's last user turn the task's
  ``targets``, for an earlier turn the agent's recorded reply to it.

Intervals (:func:`bootstrap_interval`, :func:`paired_difference`): percentile bootstrap over
the questions (2,000 resamples, seeded), 95%. A paired difference resamples the same questions
for both methods, so a per-question effect is not drowned by the spread between questions.
:func:`bootstrap_statistic` does the same for any statistic of paired items (the engine's hit
ratio and median TTFT per method, the ratio of two methods' median TTFT;
:mod:`~contextpilot_bench.engine_intervals`).
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contextpilot_bench.workloads import resolve_data_dir

__all__ = [
    "METRICS",
    "AnswerScore",
    "Interval",
    "MethodScores",
    "bootstrap_interval",
    "bootstrap_statistic",
    "is_label_only",
    "normalize_answer",
    "paired_difference",
    "reference_answers",
    "score_answer",
    "score_document",
    "score_methods",
]

METRICS = ("exact_match", "f1", "gold_contained", "label_only")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_LABEL = re.compile(r"\[?\s*doc(?:ument)?\s*\d+\s*\]?", re.IGNORECASE)
_LABEL_SEPARATORS = re.compile(r"[\s,.;:>&]+|\band\b", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed (SQuAD v1.1)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_label_only(answer: str) -> bool:
    """Whether ``answer`` holds nothing but document labels (``"[Doc 1]"``, ``"Doc 2, Doc 3."``)."""
    if _LABEL.search(answer) is None:
        return False
    return not _LABEL_SEPARATORS.sub("", _LABEL.sub(" ", answer))


def _f1(prediction: list[str], reference: list[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if not prediction or not reference:
        return float(prediction == reference)
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, slots=True)
class AnswerScore:
    """One answer's scores (the best over its references); see the module docstring."""

    exact_match: float
    f1: float
    gold_contained: float
    label_only: float


def score_answer(answer: str, references: Sequence[str]) -> AnswerScore:
    """Score ``answer`` against ``references`` (the best of each metric over them).

    Raises:
        ValueError: no reference, or only empty ones.
    """
    normalized = [normalize_answer(r) for r in references]
    normalized = [r for r in normalized if r]
    if not normalized:
        raise ValueError(f"no non-empty reference among {list(references)!r}")
    prediction = normalize_answer(answer)
    words = prediction.split()
    padded = f" {prediction} "
    return AnswerScore(
        exact_match=float(any(prediction == r for r in normalized)),
        f1=max(_f1(words, r.split()) for r in normalized),
        gold_contained=float(any(f" {r} " in padded for r in normalized)),
        label_only=float(is_label_only(answer)),
    )


# --- references --------------------------------------------------------------------------------


_MULTIHOP_TRUTH = "multihop_rag_sample500/ground_truth.json"
_LOCOMO_FILE = "locomo/locomo10.json"
_MTRAG_FILE = "mtrag/mtragun-human/generation_tasks/reference.jsonl"


def _multihop_references(root: Path) -> dict[str, tuple[str, ...]]:
    truth = json.loads((root / _MULTIHOP_TRUTH).read_text("utf-8"))
    return {f"multihop-{qid}": (str(entry["answer"]),) for qid, entry in truth.items()}


def _locomo_references(root: Path) -> dict[str, tuple[str, ...]]:
    samples = json.loads((root / _LOCOMO_FILE).read_text("utf-8"))
    references: dict[str, tuple[str, ...]] = {}
    for sample in samples:
        for i, qa in enumerate(sample["qa"]):
            if "answer" in qa and str(qa["answer"]).strip():
                references[f"{sample['sample_id']}-q{i}"] = (str(qa["answer"]),)
    return references


def _mtrag_references(root: Path) -> dict[str, tuple[str, ...]]:
    path = root / _MTRAG_FILE
    references: dict[str, tuple[str, ...]] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            task = json.loads(line)
            conversation = str(task["conversation_id"])
            messages = task["input"]
            number = 0
            for position, message in enumerate(messages):
                if message["speaker"] != "user":
                    continue
                number += 1
                reply = messages[position + 1] if position + 1 < len(messages) else None
                if reply is not None and reply["speaker"] == "agent":
                    references[f"{conversation}::{number}"] = (str(reply["text"]),)
                elif reply is None:
                    targets = tuple(str(t["text"]) for t in task.get("targets") or [])
                    if any(t.strip() for t in targets):
                        references[f"{conversation}::{number}"] = targets
    return references


_REFERENCES = {
    "multihop-rag": (_MULTIHOP_TRUTH, _multihop_references),
    "locomo": (_LOCOMO_FILE, _locomo_references),
    "mtrag": (_MTRAG_FILE, _mtrag_references),
    "mtrag-conversations": (_MTRAG_FILE, _mtrag_references),
}
"""Workload -> the data file its references are read from, and the reader."""


def reference_answers(
    workload: str, data_dir: str | Path | None = None
) -> dict[str, tuple[str, ...]]:
    """Request id (as the workload loader names it) -> reference answers (see the module
    docstring); requests without a reference are absent.

    Raises:
        ValueError: a workload without reference answers here.
        FileNotFoundError: the data directory or file is missing, or the file could not be
            fetched (:func:`~contextpilot_bench.workloads.resolve_data_dir`).
        ValueError: a fetched file's checksum is not the pinned one.
    """
    source = _REFERENCES.get(workload)
    if source is None:
        raise ValueError(
            f"workload {workload!r} has no reference answers here; scored workloads: "
            f"{', '.join(_REFERENCES)}"
        )
    path, reader = source
    return reader(resolve_data_dir(data_dir, files=(path,)))


# --- intervals ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Interval:
    """A mean and its 95% bootstrap interval."""

    mean: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def describe(self, *, signed: bool = True) -> str:
        """``"+1.5 [-2.0, +5.0]"``: in points (hundredths), signed for a difference."""
        sign = "+" if signed else ""
        return (
            f"{100 * self.mean:{sign}.1f} [{100 * self.low:{sign}.1f}, {100 * self.high:{sign}.1f}]"
        )


def _resample_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    return values[picks].mean(axis=1)


def bootstrap_interval(
    values: Sequence[float], *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> Interval:
    """The mean of ``values`` and its percentile-bootstrap interval.

    Raises:
        ValueError: no values.
    """
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        raise ValueError("no values to bootstrap")
    means = _resample_means(array, resamples, seed)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(array.mean()), float(low), float(high))


def bootstrap_statistic(
    statistic: Callable[[np.ndarray], float],
    items: int,
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Any statistic of ``items`` paired items and its percentile-bootstrap interval.

    ``statistic`` gets an array of item indices (``arange(items)`` for the point estimate, a
    resample drawn with replacement for each of ``resamples``) and returns a number; a paired
    statistic (a ratio of two methods' medians over the same questions) indexes both methods'
    arrays with the same indices. The :class:`Interval`'s ``mean`` is the point estimate.

    Raises:
        ValueError: no items.
    """
    if items <= 0:
        raise ValueError("no items to bootstrap")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, items, size=(resamples, items))
    values = np.array([statistic(row) for row in picks], dtype=float)
    tail = 100 * (1 - level) / 2
    low, high = np.nanpercentile(values, [tail, 100 - tail])
    return Interval(float(statistic(np.arange(items))), float(low), float(high))


def paired_difference(
    values: Sequence[float],
    reference: Sequence[float],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Mean of ``values - reference`` (paired per question) and its bootstrap interval.

    Raises:
        ValueError: different lengths, or no values.
    """
    a, b = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in length: {a.size} and {b.size}")
    return bootstrap_interval(a - b, resamples=resamples, seed=seed, level=level)


@dataclass(frozen=True)
class MethodScores:
    """One method's answer scores on the questions every compared method answered.

    Attributes:
        method: the method.
        questions: questions scored.
        metrics: metric name -> mean with its interval.
        vs_baseline: metric name -> the paired difference to the baseline (absent for the
            baseline itself or without one).
        per_question: metric name -> per-question values, in ``question_ids`` order.
        question_ids: the request ids scored.
    """

    method: str
    questions: int
    metrics: dict[str, Interval]
    vs_baseline: dict[str, Interval]
    per_question: dict[str, list[float]]
    question_ids: list[str]


def score_methods(
    answers: Mapping[str, Mapping[str, str]],
    references: Mapping[str, Sequence[str]],
    *,
    baseline: str = "baseline",
    resamples: int = 2000,
    seed: int = 0,
) -> list[MethodScores]:
    """Score every method's answers on the questions all of them answered that have a
    reference, with intervals and paired differences to ``baseline`` (when among them).

    Args:
        answers: method -> request id -> generated answer.
        references: request id -> reference answers (:func:`reference_answers`).

    Returns:
        One :class:`MethodScores` per method, in the order of ``answers``; no questions in
        common gives an empty list.
    """
    if not answers:
        return []
    common = set.intersection(*(set(a) for a in answers.values())) & set(references)
    ids = sorted(common)
    if not ids:
        return []
    values: dict[str, dict[str, list[float]]] = {}
    for method, by_id in answers.items():
        scores = [score_answer(by_id[i], references[i]) for i in ids]
        values[method] = {m: [getattr(s, m) for s in scores] for m in METRICS}
    out = []
    for method, per_metric in values.items():
        metrics = {
            m: bootstrap_interval(v, resamples=resamples, seed=seed) for m, v in per_metric.items()
        }
        differences = {}
        if baseline in values and method != baseline:
            differences = {
                m: paired_difference(v, values[baseline][m], resamples=resamples, seed=seed)
                for m, v in per_metric.items()
            }
        out.append(MethodScores(method, len(ids), metrics, differences, per_metric, ids))
    return out


def score_document(scores: MethodScores) -> dict[str, Any]:
    """``scores`` as JSON-ready data (a run's ``--out`` file): questions, each metric's and
    each paired difference's interval, the per-question values and the request ids."""
    return {
        "questions": scores.questions,
        "metrics": {m: asdict(i) for m, i in scores.metrics.items()},
        "vs_baseline": {m: asdict(i) for m, i in scores.vs_baseline.items()},
        "per_question": scores.per_question,
        "question_ids": scores.question_ids,
    }
