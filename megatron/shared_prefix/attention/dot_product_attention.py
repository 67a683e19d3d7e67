"""Core attention that runs tree attention when a forest is in scope.

(upstream: megatron/core/transformer/dot_product_attention.py). Swapped in through the
``core_attention`` submodule of ``hybrid_stack_spec()``; with no forest in scope it is exactly
megatron-core's DotProductAttention.
"""

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron.shared_prefix.attention import flex_backend, torch_backend
from megatron.shared_prefix.tensors import current_forest

TREE_ATTENTION_BACKENDS = ("auto", "torch", "flex")


def use_flex_attention(tree_backend: str, is_cuda: bool, num_tokens: int) -> bool:
    """Whether a row runs on FlexAttention: "flex", or "auto" on CUDA for rows of at least one tile.

    FlexAttention works in tiles of ``flex_backend.BLOCK_SIZE`` tokens; a row shorter than one tile
    (e.g. a one-token filler row) costs the torch backend at most one tile of scores, and would cost
    FlexAttention a compile of its own (Dynamo specializes sizes 0 and 1).
    """
    if tree_backend == "auto":
        return is_cuda and num_tokens >= flex_backend.BLOCK_SIZE
    return tree_backend == "flex"


class TreeDotProductAttention(DotProductAttention):
    """DotProductAttention that attends over each token's root path inside a forest.

    The softmax scale is the one DotProductAttention uses (``softmax_scale``, times the layer
    number when ``apply_query_key_layer_scaling`` divided it out). Queries and keys arrive with RoPE
    already applied by ``position_ids`` (the model gathers the rotary table by position).

    Args:
        tree_backend: "flex" (FlexAttention, CUDA), "torch" (runs everywhere; the oracle), or
            "auto": flex for CUDA rows of at least one FlexAttention tile, torch otherwise.
        Everything else is DotProductAttention's.
    """

    def __init__(self, *args, tree_backend: str = "auto", **kwargs):
        if tree_backend not in TREE_ATTENTION_BACKENDS:
            raise ValueError(
                f"tree_backend must be one of {TREE_ATTENTION_BACKENDS}, got {tree_backend!r}"
            )
        super().__init__(*args, **kwargs)
        self.tree_backend = tree_backend

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        forest = current_forest()
        if forest is None:
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if (
            attention_mask is not None
            or attention_bias is not None
            or packed_seq_params is not None
        ):
            raise ValueError(
                "tree attention takes its mask from the forest: attention_mask, attention_bias and "
                "packed_seq_params must be None"
            )
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"tree attention needs a causal layer, got attn_mask_type={mask_type}")
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        use_flex = use_flex_attention(self.tree_backend, query.is_cuda, forest.num_tokens)
        backend = flex_backend if use_flex else torch_backend
        return backend.tree_attention(query, key, value, forest, softmax_scale=scale)
