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
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.identity_op import IdentityOp
from torch import Tensor

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.models.hybrid.validation import validate_forest_forward
from megatron.shared_prefix.tensor_parallel.random import bracket_for_recompute
from megatron.shared_prefix.tensors import ForestTensors, forest_scope


def edge_cross_entropy(
    source_logits: Tensor, edge_source_slot: Tensor, edge_target: Tensor
) -> Tensor:
    """Cross entropy of every loss edge, computing the softmax once per distinct source.

    Args:
        source_logits: [U, V] logits of the distinct edge sources.
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge.

    Returns:
        [E] float32 ``-log softmax(source_logits[slot])[target]``.
    """
    logits = source_logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1)
    return log_normalizer[edge_source_slot] - logits[edge_source_slot, edge_target]


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
        validate_forest_forward(
            self,
            shared_prefix_layout,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            inference_params=inference_params,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        forest = ForestTensors.from_layout(shared_prefix_layout, self._device())
        with forest_scope(forest):
            hidden_states = self._forest_stack(forest)
            return self._edge_loss(hidden_states, forest, runtime_gather_output)

    def _device(self) -> torch.device:
        return self.embedding.word_embeddings.weight.device

    def _forest_rotary_pos_emb(self, forest: ForestTensors) -> Optional[Tensor]:
        """[T, 1, 1, D] rotary table rows gathered by each token's position (not packed index)."""
        if self.position_embedding_type != "rope":
            return None
        table = self.rotary_pos_emb(int(forest.layout.position_ids.max()) + 1)
        return table.index_select(0, forest.position_ids[0])

    def _forest_stack(self, forest: ForestTensors) -> Tensor:
        """Embeddings and the decoder stack over the packed row: [T, 1, hidden]."""
        enter, leave = bracket_for_recompute(forest, self._device())
        decoder_input = self.embedding(input_ids=forest.input_ids, position_ids=forest.position_ids)
        hidden_states = self.decoder(
            hidden_states=enter(decoder_input),
            attention_mask=None,
            rotary_pos_emb=self._forest_rotary_pos_emb(forest),
        )
        return leave(hidden_states)

    def _edge_loss(
        self, hidden_states: Tensor, forest: ForestTensors, runtime_gather_output
    ) -> Tensor:
        """Project only the distinct edge sources to the vocabulary; [E] float32 cross entropy."""
        source_states = hidden_states.index_select(0, forest.edge_unique_source)
        output_weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        logits, _ = self.output_layer(
            source_states, weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        logits = self._scale_logits(logits)
        return edge_cross_entropy(logits[:, 0], forest.edge_source_slot, forest.edge_target)
