"""Distance between two contexts, and its sparse pairwise computation over a batch.

ContextPilot paper (MLSys 2026), section 4.1 (context index construction): with ``S`` the
blocks that contexts ``i`` and ``j`` share and ``p(k)`` a block's position in a context,

    d(i, j) = 1 - |S| / max(|C_i|, |C_j|) + alpha * mean_{k in S} |p_i(k) - p_j(k)|

and ``d = 1`` when nothing is shared. ``alpha`` in [0.001, 0.01]; the paper uses 0.001.
With ``weights`` (tokens per block) the overlap term becomes ``tokens(S) / max(tokens(C_i),
tokens(C_j))``: two contexts that share one long block are then closer than two that share
one short block, which is what a prefix cache rewards.

Only pairs that share at least one block are ever materialised (postings per block,
vectorised with numpy): the cost is the number of co-occurring pairs, not ``N**2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SharedPairs", "context_distance", "pairwise_distances", "shared_pairs"]

DEFAULT_ALPHA = 0.001


def _check_alpha(alpha: float) -> None:
    if not (alpha >= 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


def context_distance(
    a: Sequence[int],
    b: Sequence[int],
    *,
    alpha: float = DEFAULT_ALPHA,
    weights: dict[int, float] | None = None,
) -> float:
    """Distance between two contexts (sequences of block ids, positions = indices).

    Args:
        a, b: block ids in prompt order; a block id must not repeat within one context.
        alpha: weight of the mean position gap of shared blocks.
        weights: optional tokens per block id; the overlap term is then token-weighted.

    Returns:
        ``d >= 0``; exactly 1.0 when ``a`` and ``b`` share no block.

    Raises:
        ValueError: an empty context, a repeated block, or a bad ``alpha``.
    """
    _check_alpha(alpha)
    pos_a = _positions(a, "a")
    pos_b = _positions(b, "b")
    shared = pos_a.keys() & pos_b.keys()
    if not shared:
        return 1.0
    gap = sum(abs(pos_a[k] - pos_b[k]) for k in shared) / len(shared)
    if weights is None:
        overlap = len(shared) / max(len(a), len(b))
    else:
        total_a = sum(weights[k] for k in a)
        total_b = sum(weights[k] for k in b)
        overlap = sum(weights[k] for k in shared) / max(total_a, total_b, 1e-12)
    return 1.0 - overlap + alpha * gap


def _positions(context: Sequence[int], name: str) -> dict[int, int]:
    if len(context) == 0:
        raise ValueError(f"context {name} is empty")
    pos = {block: i for i, block in enumerate(context)}
    if len(pos) != len(context):
        raise ValueError(f"context {name} repeats a block id: {list(context)!r:.200}")
    return pos


@dataclass(frozen=True)
class SharedPairs:
    """Sparse statistics of the context pairs that share blocks (upper triangle, ``i < j``).

    Attributes:
        rows, cols: int64 arrays of shape ``(P,)``, the pair indices with ``rows < cols``.
        shared: float64 ``(P,)``, shared weight (block count, or tokens when weighted).
        gap_mean: float64 ``(P,)``, mean absolute position gap of the shared blocks.
        size: float64 ``(N,)``, each context's total weight (block count or tokens).
    """

    rows: np.ndarray
    cols: np.ndarray
    shared: np.ndarray
    gap_mean: np.ndarray
    size: np.ndarray

    def distances(self, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
        """The paper's distance for each pair, float64 ``(P,)``."""
        _check_alpha(alpha)
        denominator = np.maximum(self.size[self.rows], self.size[self.cols])
        return 1.0 - self.shared / denominator + alpha * self.gap_mean


@dataclass(frozen=True)
class _Cooccurrences:
    """One entry per (pair of contexts, block they share): arrays of shape ``(E,)``."""

    rows: np.ndarray  # int64, rows < cols
    cols: np.ndarray
    gap: np.ndarray  # float64 |p_i(k) - p_j(k)|
    weight: np.ndarray  # float64 weight of the shared block
    size: np.ndarray  # float64 (N,) total weight per context


def _cooccurrences(
    contexts: Sequence[Sequence[int]], weights: Sequence[Sequence[float]] | None
) -> _Cooccurrences:
    n = len(contexts)
    if n == 0:
        raise ValueError("contexts is empty")
    lengths = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=n)
    if (lengths == 0).any():
        raise ValueError(f"context {int(np.argmin(lengths))} is empty")
    flat = np.fromiter((b for c in contexts for b in c), dtype=np.uint64, count=int(lengths.sum()))
    ctx = np.repeat(np.arange(n, dtype=np.int64), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    pos = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, lengths)
    if weights is None:
        w = np.ones(flat.size, dtype=np.float64)
    else:
        if len(weights) != n or any(len(wc) != len(c) for wc, c in zip(weights, contexts)):
            raise ValueError("weights must have the same shape as contexts")
        w = np.fromiter((x for wc in weights for x in wc), dtype=np.float64, count=flat.size)
    size = np.bincount(ctx, weights=w, minlength=n).astype(np.float64)

    _, block_index = np.unique(flat, return_inverse=True)
    # Sort by (block, context): equal neighbours mean a block repeated inside one context.
    order = np.lexsort((ctx, block_index))
    b_sorted = block_index[order]
    c_sorted = ctx[order]
    repeated = (b_sorted[1:] == b_sorted[:-1]) & (c_sorted[1:] == c_sorted[:-1])
    if repeated.any():
        raise ValueError(f"context {int(c_sorted[1:][repeated][0])} repeats a block id")

    group_end = np.searchsorted(b_sorted, b_sorted, side="right")
    t = np.arange(order.size, dtype=np.int64)
    partners = group_end - t - 1  # later members of the same block's posting list
    total = int(partners.sum())
    left = np.repeat(t, partners)
    # right = left + 1 + (rank of the pair among left's pairs), computed in place.
    right = np.arange(total, dtype=np.int64)
    right -= np.repeat(np.cumsum(partners) - partners - t - 1, partners)
    # Gather from arrays already in posting order: one indirection per co-occurrence.
    # Within a posting list contexts are ascending, so rows < cols already.
    pos_sorted = pos[order]
    return _Cooccurrences(
        rows=c_sorted[left],
        cols=c_sorted[right],
        gap=np.abs(pos_sorted[left] - pos_sorted[right]).astype(np.float64),
        weight=w[order][left],
        size=size,
    )


def shared_pairs(
    contexts: Sequence[Sequence[int]],
    weights: Sequence[Sequence[float]] | None = None,
) -> SharedPairs:
    """Overlap statistics for every pair of contexts that shares at least one block.

    Args:
        contexts: ``N`` contexts, each a sequence of block ids (no repeats within one).
        weights: optional, same shape as ``contexts``: tokens per block occurrence.

    Returns:
        :class:`SharedPairs`. Memory and time are linear in the number of co-occurrences
        (``sum over blocks of m*(m-1)/2``, ``m`` = contexts holding the block).

    Raises:
        ValueError: empty contexts list, an empty context, a repeated block, or ``weights``
            whose shape differs from ``contexts``.
    """
    co = _cooccurrences(contexts, weights)
    n = co.size.size
    if co.rows.size == 0:
        empty_i = np.empty(0, dtype=np.int64)
        empty_f = np.empty(0, dtype=np.float64)
        return SharedPairs(empty_i, empty_i, empty_f, empty_f, co.size)
    pair_key, inverse = np.unique(co.rows * n + co.cols, return_inverse=True)
    count = np.bincount(inverse)
    return SharedPairs(
        rows=pair_key // n,
        cols=pair_key % n,
        shared=np.bincount(inverse, weights=co.weight),
        gap_mean=np.bincount(inverse, weights=co.gap) / count,
        size=co.size,
    )


def pairwise_distances(
    contexts: Sequence[Sequence[int]],
    *,
    alpha: float = DEFAULT_ALPHA,
    weights: Sequence[Sequence[float]] | None = None,
) -> np.ndarray:
    """Condensed distance vector (scipy ``pdist`` layout) of the paper's distance.

    Co-occurrences are summed straight into the condensed layout with ``np.bincount``
    (no sort), so the cost is ``O(co-occurrences + N**2)``.

    Returns:
        float64 array of shape ``(N*(N-1)/2,)``; pairs sharing nothing are 1.0. This is
        dense in ``N``: callers bound ``N`` (the offline build does, see ``clustering``).
    """
    _check_alpha(alpha)
    co = _cooccurrences(contexts, weights)
    n = co.size.size
    m = n * (n - 1) // 2
    if co.rows.size == 0:
        return np.ones(m, dtype=np.float64)
    i, j = co.rows, co.cols
    slot = n * i - i * (i + 1) // 2 + (j - i - 1)
    count = np.bincount(slot, minlength=m)
    # The overlap term sum_k w_k / max(size_i, size_j) is summed per co-occurrence, so the
    # pair indices of the condensed slots never have to be rebuilt.
    overlap = np.bincount(slot, weights=co.weight / np.maximum(co.size[i], co.size[j]), minlength=m)
    gap = np.bincount(slot, weights=co.gap, minlength=m)
    # Pairs that share nothing have overlap 0 and gap 0, hence exactly 1.0: no masking needed.
    out = 1.0 - overlap
    out += alpha * gap / np.maximum(count, 1)
    return out
