"""MoE layer spec with the tree-aware router, dispatcher and experts.

(upstream: megatron/core/models/gpt/moe_module_specs.py)
"""

import dataclasses
from functools import partial

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron.shared_prefix.moe.experts import ForestSequentialMLP
from megatron.shared_prefix.moe.moe_layer import TreeMoELayer
from megatron.shared_prefix.moe.router import ROW_BLOCK_SIZE, TreeTopKRouter


def tree_moe_module_spec(
    *,
    num_experts: int,
    use_te: bool = False,
    count_padding: bool,
    row_block_size: int = ROW_BLOCK_SIZE,
):
    """megatron-core's MoE layer builder (``get_moe_module_spec``) with :class:`TreeTopKRouter`,
    built as a :class:`TreeMoELayer` (sync-free all-gather dispatch on forests) whose
    SequentialMLP experts are :class:`ForestSequentialMLP` (grouped GEMMs on forests).

    Args:
        num_experts: number of routed experts.
        use_te: Transformer Engine expert linears, as ``get_moe_module_spec`` takes it.
        count_padding: whether row padding counts in the expert-bias counts (TreeTopKRouter's
            keyword, required so the choice is always explicit).
        row_block_size: rows per gating GEMM on a forest.

    Returns:
        A builder of TreeMoELayer for ``TransformerLayerSubmodules(mlp=...)``, with the submodules
        of ``get_moe_module_spec(use_te, num_experts, moe_grouped_gemm=False)`` but the router and
        the experts' class; without a forest in scope every piece behaves as megatron-core's.
    """
    stock = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=False)
    router = partial(TreeTopKRouter, count_padding=count_padding, row_block_size=row_block_size)
    submodules = stock.keywords["submodules"]
    experts = submodules.experts
    if experts.func is SequentialMLP:
        experts = partial(ForestSequentialMLP, *experts.args, **experts.keywords)
    submodules = dataclasses.replace(submodules, router=router, experts=experts)
    return partial(TreeMoELayer, *stock.args, **{**stock.keywords, "submodules": submodules})
