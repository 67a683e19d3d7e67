"""MoE layer spec with the tree-aware router.

(upstream: megatron/core/models/gpt/moe_module_specs.py)
"""

import dataclasses
from functools import partial

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

from megatron.shared_prefix.moe.router import ROW_BLOCK_SIZE, TreeTopKRouter


def tree_moe_module_spec(
    *,
    num_experts: int,
    use_te: bool = False,
    count_padding: bool,
    row_block_size: int = ROW_BLOCK_SIZE,
):
    """megatron-core's MoE layer builder (``get_moe_module_spec``) with :class:`TreeTopKRouter`.

    Args:
        num_experts: number of routed experts.
        use_te: Transformer Engine expert linears, as ``get_moe_module_spec`` takes it.
        count_padding: whether row padding counts in the expert-bias counts (TreeTopKRouter's
            keyword, required so the choice is always explicit).
        row_block_size: rows per gating GEMM on a forest.

    Returns:
        A builder of MoELayer for ``TransformerLayerSubmodules(mlp=...)``, identical to
        ``get_moe_module_spec(use_te, num_experts, moe_grouped_gemm=False)`` except for the router.
    """
    stock = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=False)
    router = partial(TreeTopKRouter, count_padding=count_padding, row_block_size=row_block_size)
    submodules = dataclasses.replace(stock.keywords["submodules"], router=router)
    return partial(stock.func, *stock.args, **{**stock.keywords, "submodules": submodules})
