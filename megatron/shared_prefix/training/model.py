"""The model of pretrain_hybrid.py and its forward on one micro-batch, shared by both trainers.

The network is configured entirely by Megatron's arguments (``core_transformer_config_from_args``),
so the single-process loop and megatron.training build the same SharedPrefixHybridModel from the
same flags. A micro-batch's forward returns per-target losses shaped like its coefficients
(batching.py); their weighted sum is the micro-batch's share of the step's loss numerator.

With MTP depths (``--mtp-num-layers``, a pattern ``"<main>/<mtp>/..."``) the MTP loss is megatron's
(``process_mtp_loss`` with ``--calculate-per-token-loss``): per micro-batch and depth, the summed
loss of the depth's targets times ``original_num_tokens / num_tokens``, scaled by
``mtp_loss_scaling_factor / mtp_num_layers``, added to the loss whose gradient Megatron divides by
the step's units. A dense micro-batch computes it inside HybridModel.forward from its loss mask; a
packed row returns every edge's per-depth losses (``shared_prefix_mtp_losses=True``) and
:func:`mtp_loss_sum` forms the same sum with the row as the micro-batch (its loss tokens are its
units). :func:`record_mtp_metrics` logs them through megatron's MTPLossLoggingHelper.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Optional

import numpy as np
import torch

from megatron.shared_prefix.training.batching import (
    DenseMicroBatch,
    MicroBatch,
    PackedRow,
    StepBatch,
    row_mtp_targets,
)

__all__ = [
    "transformer_config",
    "build_model",
    "precompile_kernels",
    "forward_micro_batch",
    "weighted_loss_sum",
    "mtp_loss_sum",
    "record_mtp_metrics",
    "report_mtp_losses",
    "micro_batch_units",
]

# Fused kernels that need CUDA extensions; the single-process loop runs without them.
_PORTABLE_SETTINGS = {
    "use_cpu_initialization": True,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
}


def transformer_config(args: argparse.Namespace, *, portable: bool = False):
    """Megatron's TransformerConfig for ``args``; ``portable`` turns fused CUDA kernels off."""
    from megatron.training.arguments import core_transformer_config_from_args

    if portable:
        args = copy.copy(args)
        for name, value in _PORTABLE_SETTINGS.items():
            setattr(args, name, value)
    return core_transformer_config_from_args(args)


def padded_vocab_size(args: argparse.Namespace) -> int:
    """The embedding's rows: ``--padded-vocab-size`` when set (by the tokenizer, or kept from a
    checkpoint), else the vocabulary padded as megatron.training pads it at this TP size."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    return getattr(args, "padded_vocab_size", None) or calculate_padded_vocab_size(
        args.vocab_size,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
        logging_enabled=False,
    )


def build_model(
    args: argparse.Namespace,
    config,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection=None,
    vp_stage: Optional[int] = None,
):
    """SharedPrefixHybridModel for ``args`` (pattern, vocabulary, positions) and ``config``."""
    from megatron.shared_prefix.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.shared_prefix.models.hybrid.hybrid_model import SharedPrefixHybridModel

    return SharedPrefixHybridModel(
        config,
        hybrid_stack_spec=hybrid_stack_spec(
            args.num_experts,
            use_te=args.transformer_impl == "transformer_engine",
            attention_backend=args.shared_prefix_attention_backend,
        ),
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        shared_prefix_output_chunk_tokens=args.shared_prefix_output_chunk_tokens,
    )


def precompile_kernels(model: torch.nn.Module, config, device: torch.device, log) -> None:
    """``--shared-prefix-precompile``: compile, before the first step, the model's tree attention
    kernels (``precompile_tree_attention``) and its Mamba layers' Triton kernels
    (``precompile_tree_mamba``) for rows up to the row capacity, of the rows' pad multiple (the
    parallel one when MTP depths have Mamba layers), and the edge loss's kernels
    (``precompile_edge_loss``), and log what each took.

    Args:
        config: the run's RunConfig (its ``precompile`` mode and row capacity).
        log: where the one-line reports go.
    """
    from megatron.shared_prefix.attention.dot_product_attention import precompile_tree_attention
    from megatron.shared_prefix.models.hybrid.hybrid_model import precompile_edge_loss
    from megatron.shared_prefix.models.hybrid.validation import row_length_multiple
    from megatron.shared_prefix.ssm.mamba_mixer import TreeMambaMixer, precompile_tree_mamba

    if config.precompile == "off":
        return
    capacity = config.batch.capacity
    start = time.perf_counter()
    lengths = precompile_tree_attention(
        model, capacity, mode=config.precompile, dtype=model.config.params_dtype, device=device
    )
    log(
        f"[shared-prefix] precompiled tree attention ({config.precompile}): kernels for "
        f"{len(lengths)} row lengths, rows up to {capacity} tokens, in "
        f"{time.perf_counter() - start:.1f} s"
    )
    start = time.perf_counter()
    multiple = config.batch.pad_multiple
    if any(
        isinstance(module, TreeMambaMixer) and "mtp" in name.split(".")
        for name, module in model.named_modules()
    ):
        # MTP depths' rows are padded to the parallel multiple only (mtp_layout.mtp_forests).
        multiple = row_length_multiple(model.config)
    lengths = precompile_tree_mamba(
        model, capacity, dtype=model.config.params_dtype, device=device, multiple=multiple
    )
    log(
        f"[shared-prefix] precompiled tree Mamba: rows of {len(lengths)} lengths "
        f"{list(lengths)}, in {time.perf_counter() - start:.1f} s"
    )
    start = time.perf_counter()
    widths = precompile_edge_loss(model, dtype=model.config.params_dtype, device=device)
    log(
        f"[shared-prefix] precompiled the edge loss: vocabulary widths {list(widths)}, in "
        f"{time.perf_counter() - start:.1f} s"
    )


def forward_micro_batch(model: torch.nn.Module, micro_batch: MicroBatch, device: torch.device):
    """Per-target float32 losses of a micro-batch: for a packed row the forest forward's
    ``ForestLosses`` (``edge_loss`` [E] and the MTP depths' [D, E], D = 0 without MTP), for a
    dense batch [b, S].

    A packed row runs the forest forward (the model builds its device tensors from the layout, or
    moves the ones a DataLoader worker prepared, ``PackedRow.forest``); a
    dense batch runs the plain HybridModel forward with labels and loss mask (from which it
    computes its MTP loss, if any).
    """
    if isinstance(micro_batch, PackedRow):
        row = micro_batch.layout if micro_batch.forest is None else micro_batch.forest
        return model(None, None, None, shared_prefix_layout=row, shared_prefix_mtp_losses=True)
    if not isinstance(micro_batch, DenseMicroBatch):
        raise TypeError(f"unknown micro-batch type {type(micro_batch).__name__}")
    tokens = torch.from_numpy(micro_batch.tokens).to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    labels = torch.from_numpy(micro_batch.labels).to(device)
    loss_mask = torch.from_numpy(micro_batch.loss_mask).to(device)
    return model(tokens, positions, None, labels=labels, loss_mask=loss_mask)


def _context_parallel(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def _main_losses(losses) -> torch.Tensor:
    """The main per-target losses of ``forward_micro_batch``'s result (read by position: a
    Float16Module wrapper returns a ForestLosses as a plain tuple)."""
    return losses[0] if isinstance(losses, tuple) else losses


def _mtp_losses(losses, micro_batch: MicroBatch):
    """([D, E] MTP losses, [D, E] argmax matches) of a packed row's result, or None (a dense
    micro-batch, or a model without MTP)."""
    if not isinstance(micro_batch, PackedRow) or losses[1].shape[0] == 0:
        return None
    return losses[1], losses[2]


def weighted_loss_sum(losses, micro_batch: MicroBatch, cp_group=None) -> torch.Tensor:
    """Scalar ``sum(coefficients * losses)`` of the main losses: the micro-batch's share of the
    loss numerator.

    Under context parallelism (``cp_group`` of size > 1) a packed row's forward returns the
    losses of this rank's edges only (``context_parallel_edges``), so only their coefficients are
    used; the context-parallel ranks' sums add up to the row's.
    """
    losses = _main_losses(losses)
    coefficients = micro_batch.coefficients
    cp_size, cp_rank = _context_parallel(cp_group)
    if cp_size > 1 and isinstance(micro_batch, PackedRow):
        from megatron.shared_prefix.context_parallel import context_parallel_edges

        coefficients = coefficients[context_parallel_edges(micro_batch.layout, cp_size, cp_rank)]
    coefficients = torch.from_numpy(coefficients).to(losses.device)
    return (losses.float() * coefficients).sum()


def _depth_sums(mtp_edge_loss: torch.Tensor) -> torch.Tensor:
    """[D] sum of each depth's defined (not NaN) losses."""
    return torch.where(torch.isnan(mtp_edge_loss), 0.0, mtp_edge_loss).sum(dim=1)


def mtp_loss_sum(losses, micro_batch: MicroBatch, mtp_loss_scaling_factor: float) -> torch.Tensor:
    """A packed row's MTP loss as megatron's ``process_mtp_loss`` forms it with
    ``calculate_per_token_loss`` (the row as the micro-batch, its units as its loss tokens):
    ``scale / D * sum_d (sum of depth d's losses) * units / (row targets at depth d)``.

    This rank's share under context parallelism (its edges; the targets are the row's). Zero for
    a dense micro-batch, whose MTP loss HybridModel.forward attaches itself, and without MTP.
    """
    mtp = _mtp_losses(losses, micro_batch)
    if mtp is None:
        return _main_losses(losses).new_zeros(())
    depths = len(mtp[0])
    targets = row_mtp_targets(micro_batch.layout, depths)
    factor = torch.as_tensor(
        micro_batch.units / np.maximum(targets, 1), dtype=torch.float32, device=mtp[0].device
    )
    return (_depth_sums(mtp[0]) * factor).sum() * (mtp_loss_scaling_factor / depths)


def record_mtp_metrics(losses, micro_batch: MicroBatch, step: StepBatch, cp_group, dp_group):
    """Log a packed row's MTP losses and acceptance through megatron's MTPLossLoggingHelper,
    which megatron.training (and the loop) report per step as ``mtp_k loss`` (sum over the
    step's micro-batches divided by their number, averaged over data-parallel ranks).

    Each row records its share of the per-token mean over the step's targets at the depth
    (``sum * micro-batches / step targets``), so the report is the step's mean loss per target,
    padding rows and rows of other sizes notwithstanding; context-parallel ranks' shares are
    summed. Nothing for a dense micro-batch (HybridModel.forward records it) or without MTP.
    """
    mtp = _mtp_losses(losses, micro_batch)
    if mtp is None:
        return
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    mtp_edge_loss, mtp_edge_correct = mtp
    depths = len(mtp_edge_loss)
    step_targets = np.maximum(step.mtp_targets(depths), 1)
    sums = _depth_sums(mtp_edge_loss.detach())
    correct = mtp_edge_correct.sum(dim=1).float()
    defined = (~torch.isnan(mtp_edge_loss)).sum(dim=1).float()
    for depth in range(depths):
        MTPLossLoggingHelper.save_metrics_to_tracker(
            sums[depth] * (len(step.micro_batches) / step_targets[depth]),
            correct[depth],
            defined[depth],
            depth,
            depths,
            reduce_group=cp_group if cp_group is not None and cp_group.size() > 1 else None,
            avg_group=dp_group,
        )


def micro_batch_units(micro_batch: MicroBatch, cp_group=None) -> int:
    """The micro-batch's loss units as this rank reports them: all of them, or under context
    parallelism only on context-parallel rank 0 (megatron sums units over data x context
    parallel ranks)."""
    return micro_batch.units if _context_parallel(cp_group)[1] == 0 else 0


def report_mtp_losses(
    num_depths: Optional[int], num_micro_batches: int, iteration: int, writer=None
) -> tuple[float, ...]:
    """The step's ``mtp_k loss`` of ``num_depths`` MTP depths from MTPLossLoggingHelper, as
    megatron.training reports them (``track_mtp_metrics`` with ``1 / num_micro_batches``: reduced
    over the recorded groups, written to ``writer`` if given, then cleared); empty without MTP
    and on a pipeline stage that records nothing (no loss there)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if not num_depths or "loss_values" not in MTPLossLoggingHelper.tracker:
        return ()
    depths = num_depths
    totals = {}
    MTPLossLoggingHelper.track_mtp_metrics(
        1.0 / num_micro_batches, iteration, writer, total_loss_dict=totals
    )
    return tuple(float(totals[f"mtp_{depth + 1} loss"]) for depth in range(depths))
