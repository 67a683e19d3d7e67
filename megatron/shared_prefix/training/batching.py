"""Global batch of examples -> micro-batches (packed rows, or dense padded batches), host side.

One optimizer step consumes one global batch of ``--global-batch-size`` examples. With packing, the
whole global batch (or, under data parallelism, this rank's share of it) is planned at once, so
every shared prefix in it is computed once; each planned row (at most ``--shared-prefix-capacity``
tokens) is one micro-batch and gradients accumulate across rows. Without packing,
``--micro-batch-size`` examples form a right-padded dense micro-batch for the plain HybridModel
forward.

Every micro-batch carries the loss coefficients of its targets and its ``units`` (loss.py): the
step's loss is ``sum over micro-batches of sum(coefficients * CE) / sum of units``, the same for
both paths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.training.data import Example
from megatron.shared_prefix.training.loss import (
    LossNormalization,
    example_units,
    row_coefficients,
    row_units,
    target_coefficients,
)

if TYPE_CHECKING:
    from megatron.shared_prefix.tensors import ForestTensors

__all__ = [
    "PackedRow",
    "DenseMicroBatch",
    "MicroBatch",
    "StepBatch",
    "row_mtp_targets",
    "build_step_batch",
    "empty_row",
]


@dataclasses.dataclass(frozen=True, eq=False)
class PackedRow:
    """One packed micro-batch: a forest row and the loss coefficient of each of its E edges.

    Attributes:
        layout: the row (tokens, segments, edges); the model returns its [E] edge losses.
        coefficients: [E] float32 loss coefficient of each edge.
        units: this row's share of the step's loss divisor.
        forest: the row's ForestTensors built ahead on the CPU by a DataLoader worker
            (``tensors.prepare_forest``), which the forward moves to the GPU instead of building
            its tables there; None: the forward builds them from the layout.
    """

    layout: ForestLayout
    coefficients: np.ndarray
    units: int
    forest: Optional[ForestTensors] = None

    @property
    def num_tokens(self) -> int:
        """Executed tokens of the row (T)."""
        return self.layout.num_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class DenseMicroBatch:
    """``b`` examples right-padded to a common length ``S`` for the plain (dense) forward.

    Attributes:
        tokens: [b, S] int64 token ids, 0 past each example's end.
        labels: [b, S] int64, ``labels[i, t] = tokens[i, t + 1]`` (0 where there is none).
        coefficients: [b, S] float32 coefficient of the target predicted at ``t`` (token ``t + 1``);
            0 on padding and unsupervised positions.
        units: this micro-batch's share of the step's loss divisor.
        loss_mask: [b, S] float32, 1 where ``t`` predicts a supervised target: megatron's loss
            mask, which HybridModel's MTP loss reads (rolled per depth) and normalizes by.
    """

    tokens: np.ndarray
    labels: np.ndarray
    coefficients: np.ndarray
    units: int
    loss_mask: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Executed tokens of the batch, padding included (b x S)."""
        return int(self.tokens.size)


MicroBatch = Union[PackedRow, DenseMicroBatch]


@dataclasses.dataclass(frozen=True, eq=False)
class StepBatch:
    """The micro-batches of one optimizer step and the token counts reported for it.

    Attributes:
        micro_batches: rows (packed) or dense micro-batches, run with gradient accumulation.
        num_examples: original examples in the step.
        logical_tokens: tokens a dense run computes (sum of example lengths).
        executed_tokens: tokens the micro-batches compute (row lengths, or padded dense batches).
        loss_tokens: supervised targets.
        units: the step's loss divisor (sum of the micro-batches' units).
    """

    micro_batches: tuple[MicroBatch, ...]
    num_examples: int
    logical_tokens: int
    executed_tokens: int
    loss_tokens: int
    units: int
    _mtp_targets: dict = dataclasses.field(default_factory=dict, repr=False)

    def mtp_targets(self, num_depths: int) -> np.ndarray:
        """[num_depths] int64: the targets each MTP depth has in the step's packed rows (an edge
        ``(s, j)`` has one at depth ``d`` iff ``j >= d + 1``); counted once per step."""
        if num_depths not in self._mtp_targets:
            counts = np.zeros(num_depths, dtype=np.int64)
            for micro_batch in self.micro_batches:
                if isinstance(micro_batch, PackedRow):
                    counts += row_mtp_targets(micro_batch.layout, num_depths)
            self._mtp_targets[num_depths] = counts
        return self._mtp_targets[num_depths]


def row_mtp_targets(layout: ForestLayout, num_depths: int) -> np.ndarray:
    """[num_depths] int64: the row's edges with a target at MTP depth ``1 .. num_depths``."""
    depths = np.arange(1, num_depths + 1)
    return (layout.edge_position[None, :] >= depths[:, None] + 1).sum(axis=1).astype(np.int64)


def _packed(
    examples: Sequence[Example],
    capacity: int,
    normalization: LossNormalization,
    pad_multiple: int,
) -> StepBatch:
    plan = plan_shared_prefix(
        [e.tokens for e in examples],
        [e.loss_mask for e in examples],
        capacity=capacity,
        pad_multiple=pad_multiple,
    )
    rows = tuple(
        PackedRow(
            layout=layout,
            coefficients=row_coefficients(layout, examples, normalization),
            units=row_units(layout, examples, normalization),
        )
        for layout in plan.rows
    )
    return StepBatch(
        micro_batches=rows,
        num_examples=len(examples),
        logical_tokens=plan.logical_tokens,
        executed_tokens=plan.executed_tokens,
        loss_tokens=plan.loss_tokens,
        units=sum(row.units for row in rows),
    )


def _dense_micro_batch(
    examples: Sequence[Example], normalization: LossNormalization
) -> DenseMicroBatch:
    length = max(len(e) for e in examples)
    tokens = np.zeros((len(examples), length), dtype=np.int64)
    labels = np.zeros_like(tokens)
    coefficients = np.zeros((len(examples), length), dtype=np.float32)
    loss_mask = np.zeros((len(examples), length), dtype=np.float32)
    for i, example in enumerate(examples):
        n = len(example)
        tokens[i, :n] = example.tokens
        labels[i, : n - 1] = example.tokens[1:]
        coefficients[i, : n - 1] = target_coefficients(example, normalization)[1:]
        loss_mask[i, : n - 1] = example.loss_mask[1:]
    units = sum(example_units(e, normalization) for e in examples)
    return DenseMicroBatch(
        tokens=tokens, labels=labels, coefficients=coefficients, units=units, loss_mask=loss_mask
    )


def _dense(
    examples: Sequence[Example], micro_batch_size: int, normalization: LossNormalization
) -> StepBatch:
    batches = tuple(
        _dense_micro_batch(examples[i : i + micro_batch_size], normalization)
        for i in range(0, len(examples), micro_batch_size)
    )
    return StepBatch(
        micro_batches=batches,
        num_examples=len(examples),
        logical_tokens=sum(len(e) for e in examples),
        executed_tokens=sum(b.num_tokens for b in batches),
        loss_tokens=sum(e.num_targets for e in examples),
        units=sum(b.units for b in batches),
    )


def build_step_batch(
    examples: Sequence[Example],
    *,
    packing: bool,
    capacity: int,
    micro_batch_size: int,
    normalization: LossNormalization,
    pad_multiple: int = 1,
) -> StepBatch:
    """Micro-batches of one step: planned rows of at most ``capacity`` tokens, each padded to a
    multiple of ``pad_multiple`` (sequence parallelism splits a row into equal chunks), or dense
    batches of ``micro_batch_size`` examples."""
    if packing:
        return _packed(examples, capacity, normalization, pad_multiple)
    return _dense(examples, micro_batch_size, normalization)


@functools.lru_cache(maxsize=None)
def empty_row(pad_multiple: int = 1) -> PackedRow:
    """A one-token row (padded to ``pad_multiple`` tokens) with no loss edge: a micro-batch that
    contributes exactly nothing.

    Used to give every step the same number of micro-batches under megatron.training; it still runs
    forward and backward, so gradient hooks fire and collectives match across ranks. One object per
    ``pad_multiple``, immutable, shared by every step that pads: a step of many empty rows plans
    and ships one (planning each took about 0.4 ms on a 2-core host).
    """
    layout = plan_shared_prefix(
        [[0]], [[False]], capacity=pad_multiple, pad_multiple=pad_multiple
    ).rows[0]
    return PackedRow(layout=layout, coefficients=np.zeros(0, dtype=np.float32), units=0)
