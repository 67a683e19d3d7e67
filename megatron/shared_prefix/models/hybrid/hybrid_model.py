"""HybridModel that trains on packed prefix forests (upstream:
megatron/core/models/hybrid/hybrid_model.py).

``SharedPrefixHybridModel.forward(..., shared_prefix_layout=layout)`` runs the model once over the
unique tokens of a forest row and returns the per-edge cross entropy: one value per supervised
target
of every original sequence in the row, equal to that sequence's dense per-token loss. Without a
layout the forward is HybridModel.forward, unchanged.
"""

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.models.hybrid.validation import validate_forest_forward
from megatron.shared_prefix.tensor_parallel.cross_entropy import vocab_parallel_edge_cross_entropy
from megatron.shared_prefix.tensor_parallel.random import bracket_for_recompute
from megatron.shared_prefix.tensors import ForestTensors, forest_scope, rank_split


def forest_forward(model: HybridModel, layout: ForestLayout, **forward_args) -> Tensor:
    """The forest forward of ``model`` (a HybridModel built from ``hybrid_stack_spec()``).

    A function of the model rather than a method, so that HybridModel.forward can hand a
    ``shared_prefix_layout`` to it directly; the subclass below does the same.

    Args:
        model: the HybridModel.
        layout: the row to run.
        forward_args: HybridModel.forward's other arguments by name (input_ids, position_ids,
            attention_mask, decoder_input, labels, inference_context, inference_params, loss_mask,
            packed_seq_params, padding_mask, runtime_gather_output); everything the layout
            defines must be None.

    Returns:
        The per-edge float32 cross entropy on the last pipeline stage, the stage's output hidden
        states on the others (see SharedPrefixHybridModel.forward).
    """
    forward_args.pop("runtime_gather_output", None)
    validate_forest_forward(model, layout, **forward_args)
    forest = ForestTensors.from_layout(layout, _device(model))
    with forest_scope(forest):
        hidden_states = _forest_stack(model, forest)
        if not model.post_process:
            # The schedule frees a stage's output after sending it: it must own its storage.
            return make_viewless_tensor(
                hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
            )
        return _edge_loss(model, hidden_states, forest)


def _device(model: HybridModel) -> torch.device:
    return next(model.parameters()).device


def _forest_rotary_pos_emb(model: HybridModel, forest: ForestTensors) -> Optional[Tensor]:
    """[T, 1, 1, D] rotary table rows gathered by each token's position (not packed index)."""
    if model.position_embedding_type != "rope":
        return None
    # The whole table, cached by RotaryEmbedding: a packed row is not sliced for context
    # parallelism there; the rows of this rank's tokens are gathered below.
    table = model.rotary_pos_emb(int(forest.layout.position_ids.max()) + 1, packed_seq=True)
    positions = forest.position_ids[0].index_select(0, _context_parallel_tokens(model, forest))
    return table.index_select(0, positions)


def _context_parallel_tokens(model: HybridModel, forest: ForestTensors) -> Tensor:
    """[T / cp] packed indices of this context-parallel rank's tokens (all of them at cp 1)."""
    cp_group = model.pg_collection.cp
    return forest.local_tokens(cp_group.size(), cp_group.rank())


def _forest_stack(model: HybridModel, forest: ForestTensors) -> Tensor:
    """This stage's embeddings (first stage) and layers over the packed row.

    Returns [T, 1, hidden] ([T / tp, 1, hidden] under sequence parallelism). A later pipeline
    stage reads its input from ``set_input_tensor``, as HybridStack does.
    """
    enter, leave = bracket_for_recompute(forest, _device(model))
    decoder_input = None
    if model.pre_process:
        held = _context_parallel_tokens(model, forest)
        decoder_input = model.embedding(
            input_ids=forest.input_ids.index_select(1, held),
            position_ids=forest.position_ids.index_select(1, held),
        )
        if model.config.sequence_parallel and not model.embedding.scatter_to_sequence_parallel:
            decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(
                decoder_input, group=model.pg_collection.tp
            )
        decoder_input = enter(decoder_input)
    else:
        model.decoder.set_input_tensor(enter(model.decoder.input_tensor))
    hidden_states = model.decoder(
        hidden_states=decoder_input,
        attention_mask=None,
        rotary_pos_emb=_forest_rotary_pos_emb(model, forest),
    )
    return leave(hidden_states)


def _edge_loss(model: HybridModel, hidden_states: Tensor, forest: ForestTensors) -> Tensor:
    """Project only the distinct edge sources to the vocabulary; float32 cross entropy of the
    edges this rank owns ([E], or the context-parallel rank's ``context_parallel_edges``).

    Under sequence parallelism each rank selects the sources among its own tokens and the
    output layer's all-gather assembles them (``ForestTensors.edge_projection``); the logits
    stay vocab-parallel.
    """
    tp_group = model.pg_collection.tp
    split = rank_split(model.config, tp_group, model.pg_collection.cp)
    local_sources, edge_slot, owned_edges = forest.edge_projection(*split)
    source_states = hidden_states.index_select(0, local_sources)
    output_weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None
    )
    logits, _ = model.output_layer(source_states, weight=output_weight, runtime_gather_output=False)
    logits = model._scale_logits(logits)  # pylint: disable=protected-access
    targets = forest.edge_target if owned_edges is None else forest.edge_target[owned_edges]
    return vocab_parallel_edge_cross_entropy(logits[:, 0], edge_slot, targets, tp_group)


class SharedPrefixHybridModel(HybridModel):
    """HybridModel with a forest forward; build it with ``hybrid_stack_spec()``.

    Takes HybridModel's constructor arguments. Every layer of the pattern must have a module in the
    stack spec (megatron-core would otherwise build an identity for, e.g., ``E`` layers of a spec
    without experts).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        missing = [
            f"{index} ({symbol})"
            for index, (symbol, layer) in enumerate(
                zip(self.decoder.layer_type_list, self.decoder.layers)
            )
            if isinstance(layer, IdentityOp)
        ]
        if missing:
            raise ValueError(
                f"SharedPrefixHybridModel: layers {', '.join(missing)} of hybrid_layer_pattern "
                "have no "
                "module in hybrid_stack_spec (E layers need hybrid_stack_spec(num_experts=...))"
            )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_context=None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        padding_mask: Optional[Tensor] = None,
        shared_prefix_layout: Optional[ForestLayout] = None,
    ) -> Tensor:
        """HybridModel.forward, or with ``shared_prefix_layout`` the [E] float32 per-edge loss.

        With a layout, ``input_ids`` and ``position_ids`` are the layout's ``tokens`` and
        ``position_ids`` as [1, T] tensors (or None); the returned losses follow the layout's edge
        order. Everything that the layout defines (masks, labels, packing) must not be passed.

        Under tensor parallelism every rank returns the same [E] (the loss is vocab-parallel, so
        ``runtime_gather_output`` has nothing to gather and is not used). Under pipeline
        parallelism every stage is given the same layout; a stage that is not the last returns its
        output hidden states ([T, 1, hidden], or [T / tp, 1, hidden] with sequence parallelism)
        for the next stage, as HybridModel does.
        """
        if shared_prefix_layout is None:
            with forest_scope(None):
                return super().forward(
                    input_ids,
                    position_ids,
                    attention_mask,
                    decoder_input=decoder_input,
                    labels=labels,
                    inference_context=inference_context,
                    runtime_gather_output=runtime_gather_output,
                    inference_params=inference_params,
                    loss_mask=loss_mask,
                    packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask,
                )
        return forest_forward(
            self,
            shared_prefix_layout,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            runtime_gather_output=runtime_gather_output,
            inference_params=inference_params,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
