"""Loss normalization shared by packed and dense training (host-side coefficients, numpy).

The loss of a global batch is a weighted sum of per-target cross entropies divided by a count:

    loss = sum over examples s, targets j of  coefficient[s][j] * CE(s, j)   /   max(units, 1)

* ``token`` normalization (Megatron's per-token loss): coefficient = target weight, units = number
  of supervised targets in the global batch, i.e. the mean over all loss tokens;
* ``sequence`` normalization: coefficient = target weight / targets of the sequence, units = number
  of sequences with at least one target, i.e. the per-sequence mean, then the mean over sequences.

The target weight is the RL weight times the per-token advantage (1.0 for SFT), see
``data.Example``. Because the coefficients only depend on (sequence, position), the packed path
reads them through a row's ``edge_sequence`` / ``edge_position`` and the dense path through label
positions: both sum the same terms, and the micro-batches' ``(sum, units)`` pairs add up to the
global batch's. Megatron's ``--calculate-per-token-loss`` reduction divides by the global unit
count in the same way.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.training.data import Example

__all__ = [
    "LossNormalization",
    "target_coefficients",
    "example_units",
    "row_coefficients",
    "row_units",
]


class LossNormalization(str, enum.Enum):
    """How the summed, weighted target losses of a global batch are averaged."""

    TOKEN = "token"
    SEQUENCE = "sequence"


def target_coefficients(example: Example, normalization: LossNormalization) -> np.ndarray:
    """[L] float32 coefficient of each target position of ``example`` (0 where unsupervised)."""
    if normalization is LossNormalization.TOKEN:
        return example.target_weights
    return example.target_weights / max(example.num_targets, 1)


def example_units(example: Example, normalization: LossNormalization) -> int:
    """The example's share of the global batch's divisor (targets, or 1 if it has any target)."""
    if normalization is LossNormalization.TOKEN:
        return example.num_targets
    return int(example.num_targets > 0)


def row_coefficients(
    layout: ForestLayout, examples: Sequence[Example], normalization: LossNormalization
) -> np.ndarray:
    """[E] float32 coefficient of every loss edge of a packed row, in the layout's edge order.

    ``examples`` is the list the row was planned from (``edge_sequence`` indexes it).
    """
    ids = layout.sequence_ids
    per_sequence = [target_coefficients(examples[int(s)], normalization) for s in ids]
    if not per_sequence:
        return np.empty(0, dtype=np.float32)
    starts = np.zeros(len(ids), dtype=np.int64)
    np.cumsum([len(c) for c in per_sequence[:-1]], out=starts[1:])
    # One gather over the row's concatenated per-position coefficients: edge -> its sequence's slot.
    order = np.argsort(ids)
    slot = order[np.searchsorted(ids, layout.edge_sequence, sorter=order)]
    flat = np.concatenate(per_sequence).astype(np.float32, copy=False)
    return flat[starts[slot] + layout.edge_position]


def row_units(
    layout: ForestLayout, examples: Sequence[Example], normalization: LossNormalization
) -> int:
    """Units of the sequences packed in a row (each sequence lives in exactly one row of a plan)."""
    return sum(example_units(examples[int(s)], normalization) for s in layout.sequence_ids)
