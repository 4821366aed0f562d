"""The vectorised pairwise distance equals the scalar definition (paper section 4.1)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.ordering.distance import (
    context_distance,
    pairwise_distances,
    shared_pairs,
)

contexts_strategy = st.lists(
    st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True), min_size=2, max_size=20
)


@settings(max_examples=100, deadline=None)
@given(contexts_strategy, st.booleans(), st.floats(0, 0.01))
def test_condensed_and_sparse_match_scalar(contexts, weighted, alpha):
    token_of = {b: 1 + (b * 37) % 11 for c in contexts for b in c}
    weights = [[token_of[b] for b in c] for c in contexts] if weighted else None
    condensed = pairwise_distances(contexts, alpha=alpha, weights=weights)
    pairs = shared_pairs(contexts, weights)
    sparse_d = dict(zip(zip(pairs.rows.tolist(), pairs.cols.tolist()), pairs.distances(alpha)))
    k = 0
    for i in range(len(contexts)):
        for j in range(i + 1, len(contexts)):
            expected = context_distance(
                contexts[i], contexts[j], alpha=alpha, weights=token_of if weighted else None
            )
            assert condensed[k] == pytest.approx(expected, abs=1e-12)
            if expected < 1.0 or (i, j) in sparse_d:
                assert sparse_d[(i, j)] == pytest.approx(expected, abs=1e-12)
            k += 1


def test_only_sharing_pairs_are_materialised():
    pairs = shared_pairs([[1, 2], [3, 4], [2, 5], [6]])
    assert list(zip(pairs.rows.tolist(), pairs.cols.tolist())) == [(0, 2)]
    assert np.allclose(pairs.gap_mean, [1.0])


@pytest.mark.parametrize(
    ("contexts", "message"),
    [([], "contexts is empty"), ([[1], []], "empty"), ([[1, 1]], "repeats")],
)
def test_bad_contexts(contexts, message):
    with pytest.raises(ValueError, match=message):
        pairwise_distances(contexts)


def test_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        context_distance([1], [1], alpha=-1)
