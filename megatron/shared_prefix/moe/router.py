"""Top-k router that routes a prefix forest as the dense batch would (upstream:
megatron/core/transformer/moe/router.py).

Swapped in through the ``router`` submodule of the MoE spec (``tree_moe_module_spec``); with no
forest in scope every method is megatron-core's TopKRouter. With a forest in scope:

* the gating GEMM runs in fixed-size row blocks, so a token's logits are bitwise the same at any
  row and offset it is packed at (a GEMM's rounding may depend on its row count);
* expert-bias counts (``local_tokens_per_expert``) add each token ``multiplicity`` times, in int64;
* the load-balancing losses (aux_loss, seq_aux_loss, global_aux_loss) and the z-loss weight each
  token by its multiplicity, so their values and gradients are those of the dense micro-batch
  holding the row's sequences (see :class:`TreeTopKRouter` for that reference).

Under sequence parallelism (required by megatron-core for MoE with tensor parallelism) and
context parallelism each rank routes its share of the row (``ForestTensors.local_tokens``): its
statistics weight those tokens by their multiplicities, counts are reduced over the tensor- and
context-parallel group as megatron-core reduces them, and every normalizer uses the dense token
count of the whole row, so the sum over ranks is the dense statistic. Multiplicities
are not needed after routing (expert computation is token-wise), so they do not travel with the
tokens through dispatch.

MTP layers route their own depth's forest row (``megatron.shared_prefix.mtp_layout``), whose
multiplicities count the sequences through each token, sequence-end positions included.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter

from megatron.shared_prefix.moe.statistics import (
    ForestRoutingTables,
    forest_routing_tables,
    weighted_expert_counts,
)
from megatron.shared_prefix.moe.validation import moe_forest_errors
from megatron.shared_prefix.tensors import ForestTable, ForestTensors, current_forest, rank_split

# Rows per gating GEMM on a forest: large enough to keep the GEMM efficient, small enough that
# padding the last block costs little.
ROW_BLOCK_SIZE = 256


class RowBlockGating(torch.autograd.Function):
    """Gating GEMM ``x @ W.T (+ b)`` of a packed row, one GEMM per fixed-size block of rows.

    A GEMM's rounding may depend on its row count, so the forward runs every block as a GEMM of
    exactly ``block`` rows (the last one zero-padded): a token's logits are the same bits at any row
    length and offset. The backward needs no such invariance and runs one GEMM per gradient, as
    megatron-core's router gating does. One autograd node for the whole row: a node per block costs
    the host more than the GPU spends on the block.

    Shapes: hidden [T, H], weight [E, H], bias [E] or None -> logits [T, E] in ``router_dtype``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, router_dtype, block):
        ctx.save_for_backward(hidden, weight, bias)
        ctx.router_dtype = router_dtype
        num_tokens = hidden.shape[0]
        rows = F.pad(hidden.to(router_dtype), (0, 0, 0, -num_tokens % block))
        weight_t = weight.to(router_dtype).t()
        logits = rows.new_empty(rows.shape[0], weight.shape[0])
        for start in range(0, rows.shape[0], block):
            end = start + block
            if bias is None:
                torch.mm(rows[start:end], weight_t, out=logits[start:end])
            else:
                torch.addmm(
                    bias.to(router_dtype), rows[start:end], weight_t, out=logits[start:end]
                )
        return logits[:num_tokens]

    @staticmethod
    def backward(ctx, grad_logits):
        hidden, weight, bias = ctx.saved_tensors
        dtype = ctx.router_dtype
        grad_hidden = (grad_logits @ weight.to(dtype)).to(hidden.dtype)
        grad_weight = (grad_logits.t() @ hidden.to(dtype)).to(weight.dtype)
        grad_bias = None if bias is None else grad_logits.sum(0).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


class TreeTopKRouter(TopKRouter):
    """TopKRouter whose statistics count every packed token once per sequence through it.

    Dense reference (what the forest reproduces): the row's ``n`` sequences as one right-padded
    dense micro-batch ``[S_max, n]`` whose ``padding_mask`` marks the padding, i.e. megatron-core's
    own convention for padded batches:

    * ``aux_loss`` and ``global_aux_loss``: statistics over all ``N = sum(multiplicity)`` tokens of
      the row's sequences; ``global_aux_loss`` accumulates the dense counts across micro-batches.
    * ``seq_aux_loss``: ``(1/n) * sum_i E * coeff / (k * S^2) * sum_e P_ie * c_ie`` over the
      sequences ``i`` (``P_ie``, ``c_ie`` summed over sequence ``i``'s root path), with
      ``S = N / n`` as megatron-core uses for a padded batch; when all sequences have one length
      this is also the unpadded batch's value.
    * ``z_loss``: mean of ``logsumexp(logits)^2`` over the ``N`` tokens.
    * ``local_tokens_per_expert``: counts of the ``N`` tokens, plus each row-padding token once
      when ``count_padding`` (the convention of a dense run over a padded batch with
      ``padding_mask=None``).

    Args:
        config, pg_collection, is_mtp_layer: as TopKRouter.
        count_padding: whether the row's padding tokens (multiplicity 0) are counted, once each, in
            ``local_tokens_per_expert``. Keyword-only and required: whether padding counts is a
            training choice, never inferred. Padding never enters the losses (the dense reference
            has its padding masked).
        row_block_size: rows per gating GEMM on a forest.

    ``local_tokens_per_expert`` is an int64 buffer (also without a forest, where it holds the same
    integers as TopKRouter's float32 buffer): megatron-core's expert-bias update stacks, all-reduces
    and averages it, which int64 supports, and the counts stay exact beyond 2**24 tokens.
    """

    def __init__(
        self,
        config,
        pg_collection=None,
        is_mtp_layer: bool = False,
        *,
        count_padding: bool,
        row_block_size: int = ROW_BLOCK_SIZE,
    ) -> None:
        if not isinstance(count_padding, bool):
            raise TypeError(
                f"TreeTopKRouter: count_padding must be True or False, got {count_padding!r}"
            )
        if row_block_size < 1:
            raise ValueError(f"TreeTopKRouter: row_block_size must be >= 1, got {row_block_size}")
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.count_padding = count_padding
        self.row_block_size = row_block_size
        if self.enable_expert_bias:
            self.local_tokens_per_expert = torch.zeros_like(
                self.local_tokens_per_expert, dtype=torch.int64
            )

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """TopKRouter.forward; on a forest, ``input`` is the packed row [T, 1, hidden] (this
        rank's [T / tp, 1, hidden] under sequence parallelism)."""
        forest = current_forest()
        if forest is not None:
            self._check_forest_input(forest, input, padding_mask)
        return super().forward(input, padding_mask)

    def _check_forest_input(
        self,
        forest: ForestTensors,
        router_input: torch.Tensor,
        padding_mask,
    ) -> None:
        errors = moe_forest_errors(self.config)
        if padding_mask is not None:
            errors.append("padding_mask given (the forest's multiplicities mark padding)")
        if self.tp_group.size() > 1 and not self.config.sequence_parallel:
            errors.append(
                f"tensor parallel size {self.tp_group.size()} without sequence_parallel (every "
                "rank would count the whole row)"
            )
        local = len(self._local_tokens(forest))
        if math.prod(router_input.shape[:-1]) != local:
            errors.append(
                f"router input holds {math.prod(router_input.shape[:-1])} tokens, this rank's "
                f"share of the forest {local}"
            )
        if errors:
            raise ValueError("TreeTopKRouter cannot route this forest: " + "; ".join(errors))

    def forest_tables(self, device: torch.device) -> tuple[ForestTable, ...]:
        """What this router builds from every forest (``hybrid_model.forest_tables``)."""
        split = rank_split(self.config, self.tp_group, self.cp_group)
        return (
            ForestTable(forest_routing_tables),
            ForestTable(ForestTensors.local_tokens, split),
        )

    def _local_tokens(self, forest: ForestTensors) -> torch.Tensor:
        """[T_local] packed indices of the tokens this rank routes (its context- and
        sequence-parallel share of the row, in its local order)."""
        return forest.local_tokens(*rank_split(self.config, self.tp_group, self.cp_group))

    def _local_multiplicity(self, forest: ForestTensors, tables: ForestRoutingTables):
        """[T_local] int64 multiplicities of the tokens this rank routes."""
        return tables.multiplicity[self._local_tokens(forest)]

    def _local_dense_tokens(self, tables: ForestRoutingTables) -> float:
        """This rank's share of the row's dense tokens, ``N / (tp * cp)``: what megatron-core's
        normalizations call the local token count (their products with the group size are
        ``N``)."""
        return tables.num_dense_tokens / self.tp_cp_group.size()

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits [..., E]; on a forest computed in fixed-size row blocks.

        Every block is one GEMM of ``row_block_size`` rows (the last one zero-padded), so a token's
        logits do not depend on the row's length or the token's offset in it
        (:class:`RowBlockGating`). Computed in ``moe_router_dtype`` as TopKRouter computes them.
        """
        if current_forest() is None:
            return super().gating(input)
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        hidden = input.reshape(-1, input.shape[-1])
        logits = RowBlockGating.apply(
            hidden, self.weight, self.bias, router_dtype, self.row_block_size
        )
        return logits.view(*input.shape[:-1], -1)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Attach the z-loss; on a forest ``coeff * sum_t m_t * lse_t^2 / N`` (the dense mean)."""
        forest = current_forest()
        if forest is None:
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        tables = forest_routing_tables(forest)
        coeff = self.config.moe_z_loss_coeff / self.tp_cp_group.size()
        squared = torch.logsumexp(logits, dim=-1).square()
        multiplicity = self._local_multiplicity(forest, tables)
        local_tokens = self._local_dense_tokens(tables)
        z_loss = (squared * multiplicity.to(squared.dtype)).sum() / local_tokens * coeff
        if self.calculate_per_token_loss:
            # As TopKRouter: cancel the per-token normalisation of finalize_model_grads.
            logits = MoEAuxLossAutoScaler.apply(
                logits, z_loss * local_tokens * self.tp_cp_group.size()
            )
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        get_moe_metrics_tracker().record(
            "z_loss", z_loss / coeff, self.layer_number, num_layers, avg_group=self.tp_dp_cp_group
        )
        return logits

    def _dense_counts(self, routing_map: torch.Tensor, multiplicity: torch.Tensor, group):
        """Dense per-expert counts [E] int64 of ``routing_map`` summed over ``group``, and the
        group's dense token count (a float tensor, as megatron-core computes it for padded batches).
        """
        counts = reduce_from_tensor_model_parallel_region(
            weighted_expert_counts(routing_map, multiplicity), group
        )
        return counts, counts.sum() / self.topk

    def _weighted_switch_loss(
        self, scores, multiplicity, tokens_per_expert, total_num_tokens, coeff
    ):
        """megatron-core's switch load-balancing loss with ``P_e = sum_t m_t * scores[t, e]``."""
        return switch_load_balancing_loss_func(
            probs=scores * multiplicity.unsqueeze(-1).to(scores.dtype),
            tokens_per_expert=tokens_per_expert,
            total_num_tokens=total_num_tokens,
            topk=self.topk,
            num_experts=self.num_experts,
            moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """Attach aux_loss; on a forest over the ``N`` dense tokens of the row."""
        forest = current_forest()
        if forest is None:
            return super()._apply_aux_loss(
                probs, scores_for_aux_loss, routing_map, with_padding_mask
            )
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tables = forest_routing_tables(forest)
        multiplicity = self._local_multiplicity(forest, tables)
        tokens_per_expert, total_num_tokens = self._dense_counts(
            routing_map, multiplicity, self.tp_cp_group
        )
        aux_loss = self._weighted_switch_loss(
            scores_for_aux_loss, multiplicity, tokens_per_expert, total_num_tokens, coeff
        )
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            aux_loss,
            "load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=self._local_dense_tokens(tables),
        )

    def _apply_seq_aux_loss(
        self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False
    ):
        """Attach seq_aux_loss; on a forest per original sequence (see the class docstring).

        ``sum_i sum_e P_ie * c_ie = sum_t sum_e scores[t, e] * G[t, e]`` with ``G[t, e]`` the sum of
        ``c_ie`` over the sequences through token ``t``; ``G`` is exact (int64). Under sequence
        parallelism ``c_ie`` sums every rank's tokens (reduced over the group, as megatron-core
        reduces per-sequence counts) and each rank adds its own tokens' ``scores * G``.
        """
        forest = current_forest()
        if forest is None:
            return super()._apply_seq_aux_loss(
                probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask
            )
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        tables = forest_routing_tables(forest)
        local = self._local_tokens(forest)
        row_map = routing_map.to(torch.int64)
        if len(local) != forest.num_tokens:
            # This rank's tokens at their row positions, zero elsewhere (each index once).
            row_map = row_map.new_zeros(forest.num_tokens, row_map.shape[-1]).index_copy(
                0, local, row_map
            )
        sequence_counts = reduce_from_tensor_model_parallel_region(
            tables.sequence_counts(row_map), self.tp_cp_group
        )
        per_token = tables.sum_over_sequences_through(sequence_counts)[local]
        n, total = tables.num_sequences, tables.num_dense_tokens
        aux_loss = (scores_for_aux_loss * per_token.to(scores_for_aux_loss.dtype)).sum() * (
            self.num_experts * coeff * n / (self.topk * total * total)
        )
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            aux_loss,
            "seq_load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=self._local_dense_tokens(tables),
        )

    def _apply_global_aux_loss(
        self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False
    ):
        """Attach global_aux_loss; on a forest the running counts accumulate dense counts."""
        forest = current_forest()
        if forest is None:
            return super()._apply_global_aux_loss(
                probs, scores_for_aux_loss, routing_map, with_padding_mask
            )
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        tables = forest_routing_tables(forest)
        multiplicity = self._local_multiplicity(forest, tables)
        tokens_per_expert, total_num_tokens = self._dense_counts(
            routing_map, multiplicity, self.tp_dp_cp_group
        )
        self.global_tokens_per_expert += tokens_per_expert
        self.ga_steps += 1
        aux_loss = self._weighted_switch_loss(
            scores_for_aux_loss,
            multiplicity,
            self.global_tokens_per_expert / self.ga_steps,
            total_num_tokens,
            coeff,
        )
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            aux_loss,
            "global_load_balancing_loss",
            self.tp_dp_cp_group,
            needs_dp_avg=False,
            valid_token_count=self._local_dense_tokens(tables),
        )

    def _apply_expert_bias(
        self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ):
        """Count the routed tokens in ``local_tokens_per_expert``; on a forest, by multiplicity.

        As in TopKRouter, only when gradients are enabled: not in evaluation, and once per step
        under activation recompute.
        """
        forest = current_forest()
        if forest is None:
            super()._apply_expert_bias(routing_map, padding_mask=padding_mask)
        elif self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                weights = forest_routing_tables(forest).count_weights(self.count_padding)
                weights = weights[self._local_tokens(forest)]
                self.local_tokens_per_expert += weighted_expert_counts(routing_map, weights)
