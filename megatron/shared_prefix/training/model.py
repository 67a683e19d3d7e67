"""The model of pretrain_hybrid.py and its forward on one micro-batch, shared by both trainers.

The network is configured entirely by Megatron's arguments (``core_transformer_config_from_args``),
so the single-process loop and megatron.training build the same SharedPrefixHybridModel from the
same flags. A micro-batch's forward returns per-target losses shaped like its coefficients
(batching.py); their weighted sum is the micro-batch's share of the step's loss numerator.
"""

from __future__ import annotations

import argparse
import copy
from typing import Optional

import torch

from megatron.shared_prefix.training.batching import DenseMicroBatch, MicroBatch, PackedRow

__all__ = [
    "transformer_config",
    "build_model",
    "forward_micro_batch",
    "weighted_loss_sum",
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
            args.num_experts, use_te=args.transformer_impl == "transformer_engine"
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
    )


def forward_micro_batch(
    model: torch.nn.Module, micro_batch: MicroBatch, device: torch.device
) -> torch.Tensor:
    """Per-target float32 losses of a micro-batch: [E] for a packed row, [b, S] for a dense batch.

    A packed row runs the forest forward (the model builds its device tensors from the layout); a
    dense batch runs the plain HybridModel forward with labels.
    """
    if isinstance(micro_batch, PackedRow):
        return model(None, None, None, shared_prefix_layout=micro_batch.layout)
    if not isinstance(micro_batch, DenseMicroBatch):
        raise TypeError(f"unknown micro-batch type {type(micro_batch).__name__}")
    tokens = torch.from_numpy(micro_batch.tokens).to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    labels = torch.from_numpy(micro_batch.labels).to(device)
    return model(tokens, positions, None, labels=labels)


def _context_parallel(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def weighted_loss_sum(losses: torch.Tensor, micro_batch: MicroBatch, cp_group=None) -> torch.Tensor:
    """Scalar ``sum(coefficients * losses)``: the micro-batch's share of the loss numerator.

    Under context parallelism (``cp_group`` of size > 1) a packed row's forward returns the
    losses of this rank's edges only (``context_parallel_edges``), so only their coefficients are
    used; the context-parallel ranks' sums add up to the row's.
    """
    coefficients = micro_batch.coefficients
    cp_size, cp_rank = _context_parallel(cp_group)
    if cp_size > 1 and isinstance(micro_batch, PackedRow):
        from megatron.shared_prefix.context_parallel import context_parallel_edges

        coefficients = coefficients[context_parallel_edges(micro_batch.layout, cp_size, cp_rank)]
    coefficients = torch.from_numpy(coefficients).to(losses.device)
    return (losses.float() * coefficients).sum()


def micro_batch_units(micro_batch: MicroBatch, cp_group=None) -> int:
    """The micro-batch's loss units as this rank reports them: all of them, or under context
    parallelism only on context-parallel rank 0 (megatron sums units over data x context
    parallel ranks)."""
    return micro_batch.units if _context_parallel(cp_group)[1] == 0 else 0
