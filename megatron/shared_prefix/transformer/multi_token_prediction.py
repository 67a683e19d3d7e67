"""The MTP layer of the shared-prefix spec (upstream: megatron/core/transformer/
multi_token_prediction.py, where MultiTokenPredictionLayer would take its inputs from the caller).

megatron-core's ``MultiTokenPredictionLayer.forward`` builds a depth's inputs itself, by rolling the
sequence's token ids and position ids left by one (``roll_tensor``). A forest has no such shift:
the token after a branch point differs per child, so the forest forward builds each depth's row
(``megatron.shared_prefix.mtp_layout``), its embeddings and its input states, and hands them to
:meth:`TreeMultiTokenPredictionLayer.forward_on_forest`, which runs the rest of megatron-core's
layer unchanged: ``enorm`` / ``hnorm``, their concatenation and ``eh_proj``, the depth's layers
(``mtp_model_layer``, whose tree-aware layers read the depth's forest), ``final_layernorm``, and
activation recompute. Called as a module, the layer is megatron-core's.
"""

from typing import Optional

import torch
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import make_viewless_tensor

__all__ = ["TreeMultiTokenPredictionLayer", "tree_mtp_block_spec"]


class TreeMultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """MultiTokenPredictionLayer that can also run one MTP depth of a forest row."""

    def forward_on_forest(
        self,
        hidden_states: torch.Tensor,
        decoder_input: torch.Tensor,
        rotary_pos_emb: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One depth over its forest row, which must be in scope (``forest_scope``).

        Args:
            hidden_states: [T_d, 1, hidden] the previous depth's state at every token's position
                (this rank's share under sequence / context parallelism, as for the main stack).
            decoder_input: [T_d, 1, hidden] the embeddings of the depth's input tokens, same share.
            rotary_pos_emb: [T_d, 1, 1, D] rotary rows of the tokens' positions, or None.

        Returns:
            [T_d, 1, hidden] the depth's output after ``final_layernorm``, as ``forward`` returns
            it (without the rolled ids it passes on).
        """
        if self.config.mtp_detach_heads:
            decoder_input = decoder_input.detach()
        # As MultiTokenPredictionLayer._get_embeddings: a viewless input that requires grad (the
        # activation checkpoint needs one even when mtp_detach_heads cut the graph).
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not hidden_states.requires_grad:
            hidden_states.requires_grad_(True)
        if self.config.recompute_granularity == "full" and self.training:
            return self._checkpointed_forward(
                hidden_states=hidden_states,
                decoder_input=decoder_input,
                rotary_pos_emb=rotary_pos_emb,
            )
        return self._proj_and_transformer_layer(
            hidden_states=hidden_states,
            decoder_input=decoder_input,
            rotary_pos_emb=rotary_pos_emb,
        )


def tree_mtp_block_spec(norm, column_linear) -> ModuleSpec:
    """The ``mtp_block_spec`` of the shared-prefix hybrid stack: megatron-core's MTP block with
    :class:`TreeMultiTokenPredictionLayer` layers; each depth's inner layers are built from the
    stack's own (tree-aware) layer specs, as megatron-core builds them.

    Args:
        norm: builder of ``enorm``, ``hnorm`` and ``final_layernorm`` (``config=, hidden_size=,
            eps=``), e.g. ``TorchNorm`` or ``TENorm``.
        column_linear: the ``eh_proj`` linear, e.g. ``ColumnParallelLinear``.
    """
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=TreeMultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=norm,
                        hnorm=norm,
                        eh_proj=column_linear,
                        mtp_model_layer=None,
                        layer_norm=norm,
                    ),
                )
            ]
        ),
    )
