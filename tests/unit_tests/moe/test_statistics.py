"""Exact weighted counts and the per-forest tables behind the sequence-level statistics."""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.moe.statistics import (
    _sorted_ranges,
    forest_routing_tables,
    weighted_expert_counts,
)
from megatron.shared_prefix.tensors import ForestTensors

from .forests import random_rows, root_paths, shared_padded_row


def test_weighted_counts_exact_beyond_float32():
    """Multiplicities far beyond 2**24 (and sums beyond 2**53) are counted exactly."""
    rng = np.random.default_rng(0)
    routing_map = torch.as_tensor(rng.random((50, 4)) < 0.5)
    weights = torch.as_tensor(rng.integers(2**24, 2**56, size=50) | 1, dtype=torch.int64)
    expected = [
        sum(int(w) for w, routed in zip(weights, routing_map[:, e]) if routed) for e in range(4)
    ]
    counts = weighted_expert_counts(routing_map, weights)
    assert counts.dtype == torch.int64
    assert counts.tolist() == expected
    # The same sum in float32 is wrong: the test would catch a float accumulator.
    as_float = (routing_map.float() * weights.float().unsqueeze(-1)).sum(0)
    assert as_float.long().tolist() != expected


def test_weighted_counts_by_hand():
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    weights = torch.tensor([3, 0, 2**30])
    assert weighted_expert_counts(routing_map, weights).tolist() == [3 + 2**30, 2**30, 3]


def _token_paths(layout):
    """Brute force: packed indices on each token's root path, through the segment parents."""
    paths = []
    for t in range(layout.num_tokens):
        segment = int(layout.token_segment[t])
        path = list(range(int(layout.segment_starts[segment]), t + 1))
        segment = int(layout.segment_parents[segment])
        while segment >= 0:
            start = int(layout.segment_starts[segment])
            path = list(range(start, start + int(layout.segment_lengths[segment]))) + path
            segment = int(layout.segment_parents[segment])
        paths.append(path)
    return paths


@pytest.mark.parametrize("seed", range(6))
def test_tables_match_brute_force(seed):
    _, rows = random_rows(seed, num_sequences=8, capacity=64)
    for layout in rows:
        tables = forest_routing_tables(ForestTensors.from_layout(layout, "cpu"))
        values = torch.randint(0, 1000, (layout.num_tokens, 3))

        path_sums = tables.root_path_sums(values)
        for t, path in enumerate(_token_paths(layout)):
            assert path_sums[t].tolist() == values[path].sum(0).tolist()

        paths = root_paths(layout)
        counts = tables.sequence_counts(values)
        assert counts.tolist() == [values[p].sum(0).tolist() for p in paths]

        per_sequence = torch.randint(0, 1000, (len(paths), 3))
        through = tables.sum_over_sequences_through(per_sequence)
        expected = torch.zeros_like(through)
        for i, path in enumerate(paths):
            expected[path] += per_sequence[i]
        assert torch.equal(through, expected)

        ones = torch.ones(len(paths), dtype=torch.int64)
        assert torch.equal(tables.sum_over_sequences_through(ones), tables.multiplicity)
        assert tables.num_dense_tokens == sum(len(p) for p in paths)


@pytest.mark.parametrize("seed", range(4))
def test_sorted_ranges_select_the_keys_between_the_bounds(seed):
    """order[start:stop] holds exactly the items with lower <= key < upper, in stable key order,
    with repeated keys, unused values and bounds at both ends of the range."""
    rng = np.random.default_rng(seed)
    num_values = int(rng.integers(1, 40))
    keys = rng.integers(0, num_values, size=int(rng.integers(1, 60)))
    lower = rng.integers(0, num_values + 1, size=30)
    upper = np.maximum(lower, rng.integers(0, num_values + 1, size=30))
    order, start, stop = _sorted_ranges(keys, lower, upper, num_values)
    assert order.tolist() == sorted(range(len(keys)), key=lambda i: keys[i])
    for low, high, first, end in zip(lower, upper, start, stop):
        assert sorted(order[first:end].tolist()) == [
            i for i, key in enumerate(keys) if low <= key < high
        ]


def test_tables_are_cached_per_forest():
    _, rows = random_rows(0)
    forest = ForestTensors.from_layout(rows[0], "cpu")
    assert forest_routing_tables(forest) is forest_routing_tables(forest)
    assert forest_routing_tables(
        ForestTensors.from_layout(rows[0], "cpu")
    ) is not forest_routing_tables(forest)


def test_count_weights_padding_keyword():
    _, layout = shared_padded_row(1, pad_multiple=16)
    tables = forest_routing_tables(ForestTensors.from_layout(layout, "cpu"))
    multiplicity = torch.tensor(layout.token_multiplicity)
    assert torch.equal(tables.count_weights(False), multiplicity)
    padded = tables.count_weights(True)
    assert torch.equal(padded[: -layout.num_padding], multiplicity[: -layout.num_padding])
    assert padded[-layout.num_padding :].tolist() == [1] * layout.num_padding
