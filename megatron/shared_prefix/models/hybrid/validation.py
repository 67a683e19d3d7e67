"""Checks that a forest forward can be exact, run before any compute or state change.

Every check raises ValueError naming the setting or argument, so a user sees what to change. The
rules follow from what a forest shares: a packed token stands for every sequence through it, so
anything that would treat those sequences differently (dropout masks, sliding windows, token
dropping) or that reads the packed row as if it were one sequence (labels, packed_seq_params,
inference caches) cannot be reproduced.
"""

from typing import Any, Optional

import numpy as np
import torch
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.moe.validation import moe_forest_errors, moe_router_errors
from megatron.shared_prefix.transformer.multi_token_prediction import TreeMultiTokenPredictionLayer

SUPPORTED_LAYER_SYMBOLS = frozenset({Symbols.MAMBA, Symbols.ATTENTION, Symbols.MLP, Symbols.MOE})
SUPPORTED_POSITION_EMBEDDINGS = ("rope", "none", "learned_absolute")


def _config_errors(config) -> list[str]:
    errors = []
    if config.attention_dropout > 0:
        errors.append(
            f"attention_dropout={config.attention_dropout} (must be 0: siblings share masks)"
        )
    if config.hidden_dropout > 0:
        errors.append(f"hidden_dropout={config.hidden_dropout} (must be 0: siblings share masks)")
    if config.window_size is not None:
        errors.append(f"window_size={config.window_size} (sliding-window attention)")
    for name in ("attn_logit_softcapping", "attention_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            errors.append(f"{name}={getattr(config, name)} (softcapping)")
    if config.softmax_type != "vanilla":
        errors.append(f"softmax_type={config.softmax_type!r} (only 'vanilla')")
    if config.multi_latent_attention:
        errors.append("multi_latent_attention=True (MLA layers)")
    if config.experimental_attention_variant is not None:
        errors.append(f"experimental_attention_variant={config.experimental_attention_variant!r}")
    if config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths:
        errors.append(
            f"pipeline_model_parallel_size={config.pipeline_model_parallel_size} with "
            "variable_seq_lengths=False (forest rows differ in length, so the pipeline schedule "
            "must send each micro-batch's shape)"
        )
    if (
        config.num_moe_experts
        and config.tensor_model_parallel_size > 1
        and not config.sequence_parallel
    ):
        errors.append(
            f"tensor_model_parallel_size={config.tensor_model_parallel_size} with MoE layers and "
            "sequence_parallel=False (every tensor-parallel rank would route and count the whole "
            "row; megatron-core requires sequence parallelism for MoE under tensor parallelism)"
        )
    cp_size = config.context_parallel_size
    heads_per_rank = config.num_attention_heads // config.tensor_model_parallel_size
    if cp_size > 1 and heads_per_rank % cp_size:
        errors.append(
            f"context_parallel_size={cp_size} with {heads_per_rank} attention heads per "
            "tensor-parallel rank (the head all-to-all gives each rank an equal share)"
        )
    if config.cuda_graph_impl != "none" or config.enable_cuda_graph or config.external_cuda_graph:
        errors.append(f"cuda_graph_impl={config.cuda_graph_impl!r} (CUDA graphs)")
    if config.fp8:
        errors.append(f"fp8={config.fp8!r}")
    if config.fp4:
        errors.append(f"fp4={config.fp4!r}")
    return errors


def row_length_multiple(config) -> int:
    """What every forest row's length (the main row's, and each MTP depth's) must be a multiple
    of: the tensor-parallel size under sequence parallelism times ``2 x cp`` under context
    parallelism, so that the row splits into equal chunks."""
    tp_size = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return tp_size * (2 * config.context_parallel_size if config.context_parallel_size > 1 else 1)


def _mtp_errors(model) -> list[str]:
    """MTP layers the forest forward can run: megatron-core's block with the shared-prefix layer
    (``hybrid_stack_spec()``), on the stage that computes the loss, for as many depths as it
    has layers."""
    if not getattr(model, "mtp_process", False):
        return []
    errors = []
    config = model.config
    if not model.post_process:
        errors.append(
            "MTP layers on a pipeline stage without the output layer (pipeline_model_parallel_"
            "layout places them before the last stage)"
        )
    layers = model.mtp.layers
    if not all(isinstance(layer, TreeMultiTokenPredictionLayer) for layer in layers):
        errors.append(
            f"MTP layers of type {type(layers[0]).__name__} (the forest forward needs "
            "TreeMultiTokenPredictionLayer, from hybrid_stack_spec()'s mtp_block_spec)"
        )
    depths = config.mtp_num_layers
    if depths is None or depths < 1:
        errors.append(f"mtp_num_layers={depths} with MTP depths in hybrid_layer_pattern")
    elif not config.mtp_use_repeated_layer and depths > len(layers):
        errors.append(
            f"mtp_num_layers={depths} with {len(layers)} MTP depths in hybrid_layer_pattern "
            f"{model.hybrid_layer_pattern!r}"
        )
    unsupported = sorted(set(model.mtp_pattern) - SUPPORTED_LAYER_SYMBOLS)
    if unsupported:
        errors.append(f"MTP layers {unsupported} in hybrid_layer_pattern (supported: M, *, -, E)")
    if (
        Symbols.MOE in model.mtp_pattern
        and config.expert_model_parallel_size > 1
        and config.moe_token_dispatcher_type == "allgather"
    ):
        errors.append(
            f"moe_token_dispatcher_type='allgather' with expert_model_parallel_size="
            f"{config.expert_model_parallel_size} and MoE layers in the MTP depths (the dispatcher "
            "stacks equal-length rows, and the MTP depths' rows differ in length between ranks; "
            "use the alltoall dispatcher)"
        )
    return errors


def _layer_errors(model) -> list[str]:
    errors = []
    unsupported = sorted(set(model.decoder.layer_type_list) - SUPPORTED_LAYER_SYMBOLS)
    if unsupported:
        errors.append(f"hybrid_layer_pattern layers {unsupported} (supported: M, *, -, E)")
    if model.position_embedding_type not in SUPPORTED_POSITION_EMBEDDINGS:
        errors.append(f"position_embedding_type={model.position_embedding_type!r}")
    if not model.pre_process and model.decoder.input_tensor is None:
        errors.append(
            "no input tensor on this pipeline stage (pre_process=False: call set_input_tensor "
            "with the previous stage's output first, as megatron's schedule does)"
        )
    return errors


def _layout_errors(model, layout: ForestLayout) -> list[str]:
    errors = []
    if not isinstance(layout, ForestLayout):
        return [f"shared_prefix_layout must be a ForestLayout, got {type(layout).__name__}"]
    if layout.num_tokens == 0:
        errors.append("shared_prefix_layout has no tokens")
    if layout.num_tokens and int(layout.tokens.max()) >= model.vocab_size:
        errors.append(
            f"shared_prefix_layout token id {int(layout.tokens.max())} >= vocab_size "
            f"{model.vocab_size}"
        )
    if len(layout.edge_target) and int(layout.edge_target.max()) >= model.vocab_size:
        errors.append(
            f"edge target {int(layout.edge_target.max())} >= vocab_size {model.vocab_size}"
        )
    config = model.config
    multiple = row_length_multiple(config)
    if layout.num_tokens % multiple:
        errors.append(
            f"shared_prefix_layout of {layout.num_tokens} tokens with sequence_parallel="
            f"{config.sequence_parallel}, tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} and context_parallel_size="
            f"{config.context_parallel_size} (the row must split into equal chunks: plan with "
            f"pad_multiple a multiple of {multiple})"
        )
    errors += _expert_parallel_row_errors(model.config, layout.num_tokens)
    if model.position_embedding_type == "learned_absolute" and layout.num_tokens:
        if int(layout.position_ids.max()) >= model.max_sequence_length:
            errors.append(
                f"position {int(layout.position_ids.max())} >= max_sequence_length "
                f"{model.max_sequence_length}"
            )
    return errors


def _expert_parallel_row_errors(config, num_tokens: int) -> list[str]:
    """The allgather dispatcher under expert parallelism stacks every expert-parallel rank's
    tokens, so every rank's row must have one length; checked with one small collective."""
    if not (
        config.num_moe_experts
        and config.expert_model_parallel_size > 1
        and config.moe_token_dispatcher_type == "allgather"
    ):
        return []
    from megatron.core import parallel_state

    lengths = torch.tensor([num_tokens, -num_tokens], device=torch.cuda.current_device())
    torch.distributed.all_reduce(
        lengths,
        op=torch.distributed.ReduceOp.MAX,
        group=parallel_state.get_expert_model_parallel_group(),
    )
    longest, shortest = int(lengths[0]), -int(lengths[1])
    if longest == shortest:
        return []
    return [
        f"moe_token_dispatcher_type='allgather' with expert_model_parallel_size="
        f"{config.expert_model_parallel_size} and rows of {shortest}..{longest} tokens on the "
        "expert-parallel ranks (the dispatcher stacks equal-length rows: plan with pad_multiple "
        "equal to the capacity, or use the alltoall dispatcher)"
    ]


def _matches(tensor: Optional[torch.Tensor], expected: np.ndarray) -> bool:
    if tensor is None:
        return True
    if tuple(tensor.shape) != (1, len(expected)):
        return False
    return bool(np.array_equal(tensor.detach().reshape(-1).cpu().numpy(), expected))


def validate_forest_forward(model, layout: ForestLayout, **forward_args: Any) -> None:
    """Raise ValueError listing every reason ``model(..., shared_prefix_layout=layout)`` can't be
    exact.

    Args:
        model: the SharedPrefixHybridModel.
        layout: the row to run.
        forward_args: the other arguments of the forward call, by name (input_ids, position_ids,
            attention_mask, decoder_input, labels, inference_context, inference_params, loss_mask,
            packed_seq_params, padding_mask).
    """
    errors = (
        _config_errors(model.config)
        + moe_forest_errors(model.config)
        + _layer_errors(model)
        + _mtp_errors(model)
        + moe_router_errors(model)
    )
    for name in (
        "attention_mask",
        "decoder_input",
        "labels",
        "loss_mask",
        "packed_seq_params",
        "padding_mask",
        "inference_context",
        "inference_params",
    ):
        if forward_args.get(name) is not None:
            errors.append(
                f"{name} given together with shared_prefix_layout (the layout defines it)"
            )
    errors += _layout_errors(model, layout)
    if isinstance(layout, ForestLayout):
        if not _matches(forward_args.get("input_ids"), layout.tokens):
            errors.append("input_ids do not match shared_prefix_layout.tokens (expected [1, T])")
        if not _matches(forward_args.get("position_ids"), layout.position_ids):
            errors.append(
                "position_ids do not match shared_prefix_layout.position_ids (expected [1, T])"
            )
    if errors:
        raise ValueError(
            "SharedPrefixHybridModel cannot run this forest forward: " + "; ".join(errors)
        )
