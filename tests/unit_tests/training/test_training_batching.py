"""Global batch -> micro-batches, and loss normalization equal for packed rows and dense batches.

The model is replaced by a table of per-target losses CE(s, j), so these tests check the bookkeeping
(coefficients, units, token counts) against the normalization formulas directly.
"""

import numpy as np
import pytest

from megatron.shared_prefix.training.batching import (
    DenseMicroBatch,
    PackedRow,
    build_step_batch,
    empty_row,
)
from megatron.shared_prefix.training.data import parse_record
from megatron.shared_prefix.training.loss import LossNormalization


def batch_of_examples(seed=0):
    """Examples of GRPO groups (weights, per-token advantages) and of SFT records sharing a prefix,
    and one example without any supervised target."""
    rng = np.random.default_rng(seed)
    records = []
    for g in range(3):
        prompt = [1, 7 + g] + rng.integers(16, 48, 5).tolist() + [2]
        completions = []
        for c in range(4):
            ids = rng.integers(16, 48, int(rng.integers(2, 6))).tolist() + [3]
            entry = {"completion_ids": ids, "weight": float(rng.normal())}
            if c % 2:
                entry["advantages"] = rng.uniform(0, 1, len(ids)).round(3).tolist()
            completions.append(entry)
        records.append({"prompt_ids": prompt, "completions": completions})
    system = [4, 11, 12, 13, 2]
    for k in range(4):
        ids = system + rng.integers(16, 48, 6).tolist()
        records.append({"input_ids": ids, "loss_mask": [0] * 7 + [1] * (len(ids) - 7)})
    records.append({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]})
    return [e for i, r in enumerate(records) for e in parse_record(r, f"t:{i}", 64)]


def loss_table(examples, seed=1):
    """CE(s, j) for every example s and position j (position 0 unused)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 5.0, len(e)) for e in examples]


def reference_loss(examples, table, normalization):
    """The normalization formulas of loss.py, written out over the original sequences."""
    if normalization is LossNormalization.TOKEN:
        numerator = sum(
            float((e.target_weights * t)[e.loss_mask].sum()) for e, t in zip(examples, table)
        )
        return numerator / sum(e.num_targets for e in examples)
    means = [
        float((e.target_weights * t)[e.loss_mask].sum()) / e.num_targets
        for e, t in zip(examples, table)
        if e.num_targets
    ]
    return sum(means) / len(means)


def row_loss_sum(row: PackedRow, table):
    """sum(coefficients * CE) over a row's edges, CE read by (edge_sequence, edge_position)."""
    layout = row.layout
    losses = np.array([table[s][j] for s, j in zip(layout.edge_sequence, layout.edge_position)])
    return float((row.coefficients * losses).sum())


def dense_loss_sum(micro_batch: DenseMicroBatch, table, first_example):
    """sum(coefficients * CE) over a dense batch, CE of token t + 1 at column t."""
    losses = np.zeros(micro_batch.tokens.shape)
    for i in range(micro_batch.tokens.shape[0]):
        losses[i, : len(table[first_example + i]) - 1] = table[first_example + i][1:]
    return float((micro_batch.coefficients * losses).sum())


@pytest.mark.parametrize("normalization", list(LossNormalization))
@pytest.mark.parametrize("packing, micro_batch_size", [(True, 1), (False, 1), (False, 3)])
def test_step_loss_equals_normalization_formula(normalization, packing, micro_batch_size):
    examples = batch_of_examples()
    table = loss_table(examples)
    step = build_step_batch(
        examples,
        packing=packing,
        capacity=32,
        micro_batch_size=micro_batch_size,
        normalization=normalization,
    )
    if packing:
        losses = [row_loss_sum(row, table) for row in step.micro_batches]
    else:
        losses = [
            dense_loss_sum(b, table, k * micro_batch_size) for k, b in enumerate(step.micro_batches)
        ]
    assert sum(losses) / step.units == pytest.approx(
        reference_loss(examples, table, normalization), rel=1e-6
    )


def test_packed_step_counts_tokens():
    examples = batch_of_examples()
    step = build_step_batch(
        examples,
        packing=True,
        capacity=32,
        micro_batch_size=1,
        normalization=LossNormalization.TOKEN,
    )
    assert step.num_examples == len(examples)
    assert step.logical_tokens == sum(len(e) for e in examples)
    assert (
        step.executed_tokens
        == sum(row.num_tokens for row in step.micro_batches)
        < step.logical_tokens
    )
    assert step.loss_tokens == sum(e.num_targets for e in examples) == step.units
    assert all(row.num_tokens <= 32 for row in step.micro_batches)
    assert len(step.micro_batches) > 1


def test_dense_step_pads_micro_batches():
    examples = batch_of_examples()
    step = build_step_batch(
        examples,
        packing=False,
        capacity=32,
        micro_batch_size=4,
        normalization=LossNormalization.SEQUENCE,
    )
    assert len(step.micro_batches) == -(-len(examples) // 4)
    first = step.micro_batches[0]
    assert isinstance(first, DenseMicroBatch)
    assert first.tokens.shape == (4, max(len(e) for e in examples[:4]))
    assert (
        step.executed_tokens
        == sum(b.tokens.size for b in step.micro_batches)
        >= step.logical_tokens
    )
    assert step.units == sum(1 for e in examples if e.num_targets)
    np.testing.assert_array_equal(first.labels[0, : len(examples[0]) - 1], examples[0].tokens[1:])


def test_empty_row_contributes_nothing():
    row = empty_row()
    assert row.num_tokens == 1 and row.units == 0
    assert len(row.layout.edge_source) == 0 and row.coefficients.shape == (0,)
    # Shared by every step that pads (planned once), so nothing of it may change.
    assert empty_row() is row and empty_row(128) is not row and empty_row(128).num_tokens == 128
    assert not row.layout.tokens.flags.writeable  # its coefficients: none
