"""Helpers shared by the Mamba tests: the exactness metric, a hand-made forest and one-row layouts."""

import torch

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

# float64 relative error bound of a computation against its oracle (rounding alone gives ~1e-15).
EXACT = 1e-10

# Root "1"; children "2 3" and "9"; "2 3" has children "4 5" and "8"; "4 5" has children "6" and "7".
# With conv width 4, the windows of 6, 7 and 8 reach two segments up, and 9's passes the root.
SHORT_CHAIN = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 8], [1, 9]]


def rel_err(actual, expected):
    """max|actual - expected| / max|expected| (0 when both are all zeros)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max()
    diff = (actual - expected).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def make_forest(sequences, pad_multiple=1, device="cpu"):
    """(layout, ForestTensors on ``device``) of one row holding every sequence."""
    capacity = sum(len(s) for s in sequences) + pad_multiple
    layout = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=pad_multiple).rows[0]
    layout.validate()
    return layout, ForestTensors.from_layout(layout, device)
