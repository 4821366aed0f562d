"""How a pilot orders blocks: one frozen, validated value (:class:`OrderingConfig`).

A single request is aligned to the index's longest matched prefix and the rest of it ordered
(:mod:`.alignment`); whether the aligned order is kept is the ``reorder`` rule. A batch is
ordered jointly by the offline build (:mod:`.clustering`, distances :mod:`.distance`) and
scheduled (:mod:`.scheduling`). The two memories feed the single request's rest order
(:mod:`.popularity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from contextpilot_integrations.core.ordering.alignment import RestOrder
from contextpilot_integrations.core.ordering.clustering import DEFAULT_CLUSTER_LIMIT, BuildMethod
from contextpilot_integrations.core.ordering.distance import DEFAULT_ALPHA
from contextpilot_integrations.core.ordering.scheduling import ScheduleMethod

__all__ = ["OrderingConfig", "Reorder"]

Reorder = Literal["cost-aware", "always"]
"""When a single request is reordered (:attr:`OrderingConfig.reorder`)."""


@dataclass(frozen=True)
class OrderingConfig:
    """The ordering settings of a :class:`~contextpilot_integrations.core.pilot.ContextPilot`.

    Attributes:
        reorder: ``"cost-aware"`` (default): a single request is reordered only when the
            tokens its aligned order is expected to reuse beyond what its retriever order would
            (the matched prefix now, plus the reuse later requests can expect of its leading
            blocks while the cache holds it: see ``CooccurrenceMemory.future_reuse``, with the
            index's size as the cache's lifetime in requests) exceed what the order annotation
            costs, so planning adds no prefill tokens for nothing; ``"always"``: always aligned
            (the paper's online rule). A batch is always ordered jointly.
        rest_order: order of the unmatched blocks of a single request, ``"co-occurrence"``
            (default), ``"popularity"`` or ``"retriever"`` (:mod:`.alignment`).
        build_method: offline build of a batch, ``"auto"``, ``"cluster"`` or ``"frequency"``.
        cluster_limit: largest batch the agglomerative build takes (``"auto"``), >= 1.
        schedule_method: ``"prefix-tree"`` (default) or ``"first-step"`` (paper Alg. 5).
        alpha: position-gap weight of the paper's distance (offline build), finite, >= 0.
        weight_by_tokens: weigh shared blocks by tokens (else by count) when ordering.
        popularity_memory: blocks whose request counts are remembered after eviction, for
            the popularity order (0: use only the requests the index holds).
        cooccurrence_memory: recent requests whose blocks the co-occurrence order reads.

    Raises:
        TypeError / ValueError: a bad field (the message names the field and the value).
    """

    reorder: Reorder = "cost-aware"
    rest_order: RestOrder = "co-occurrence"
    build_method: BuildMethod = "auto"
    cluster_limit: int = DEFAULT_CLUSTER_LIMIT
    schedule_method: ScheduleMethod = "prefix-tree"
    alpha: float = DEFAULT_ALPHA
    weight_by_tokens: bool = True
    popularity_memory: int = 262_144
    cooccurrence_memory: int = 2_000

    def __post_init__(self) -> None:
        for name, kind in (
            ("reorder", Reorder),
            ("rest_order", RestOrder),
            ("build_method", BuildMethod),
            ("schedule_method", ScheduleMethod),
        ):
            value = getattr(self, name)
            if value not in get_args(kind):
                raise ValueError(f"{name} must be one of {get_args(kind)}, got {value!r:.80}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a number, got {alpha!r:.80}")
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        if not isinstance(self.weight_by_tokens, bool):
            raise TypeError(f"weight_by_tokens must be a bool, got {self.weight_by_tokens!r:.80}")
        for name, least in (
            ("cluster_limit", 1),
            ("popularity_memory", 0),
            ("cooccurrence_memory", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r:.80}")
