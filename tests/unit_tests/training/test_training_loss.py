"""Per-edge loss coefficients of packed rows against a per-edge lookup."""

import numpy as np
import pytest

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.training.data import Example
from megatron.shared_prefix.training.loss import (
    LossNormalization,
    row_coefficients,
    row_units,
    target_coefficients,
)


def random_examples(seed, count=12):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 50, 9)
    examples = []
    for _ in range(count):
        tokens = np.concatenate(
            [prompt[: rng.integers(1, 10)], rng.integers(1, 50, rng.integers(1, 8))]
        )
        mask = rng.random(len(tokens)) < 0.7
        mask[0] = False
        weights = np.where(mask, rng.normal(size=len(tokens)), 0).astype(np.float32)
        examples.append(Example(tokens.astype(np.int64), mask, weights, source="test"))
    return examples


@pytest.mark.parametrize("normalization", list(LossNormalization))
def test_row_coefficients_are_the_targets_coefficients(normalization):
    examples = random_examples(seed=3)
    plan = plan_shared_prefix(
        [e.tokens for e in examples], [e.loss_mask for e in examples], capacity=24
    )
    assert len(plan.rows) > 1
    units = 0
    for layout in plan.rows:
        expected = [
            target_coefficients(examples[int(s)], normalization)[int(j)]
            for s, j in zip(layout.edge_sequence, layout.edge_position)
        ]
        np.testing.assert_array_equal(row_coefficients(layout, examples, normalization), expected)
        units += row_units(layout, examples, normalization)
    per_example = [e.num_targets for e in examples]
    if normalization is LossNormalization.TOKEN:
        assert units == sum(per_example)
    else:
        assert units == sum(n > 0 for n in per_example)
