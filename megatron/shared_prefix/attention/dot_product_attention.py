"""Core attention that runs tree attention when a forest is in scope.

(upstream: megatron/core/transformer/dot_product_attention.py). Swapped in through the
``core_attention`` submodule of ``hybrid_stack_spec()``; with no forest in scope it is exactly
megatron-core's DotProductAttention.
"""

import copy

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron.shared_prefix.attention import flash_backend, flex_backend, torch_backend
from megatron.shared_prefix.tensor_parallel.context_parallel import (
    heads_to_whole_row,
    whole_row_to_heads,
)
from megatron.shared_prefix.tensors import ForestTable, current_forest

TREE_ATTENTION_BACKENDS = ("auto", "torch", "flex", "flash")


def use_flex_attention(tree_backend: str, is_cuda: bool, num_tokens: int) -> bool:
    """Whether a row runs on FlexAttention: "flex", or "auto" (and "flash" where flash_backend
    cannot run the row) on CUDA for rows of at least one tile.

    FlexAttention works in tiles of ``flex_backend.BLOCK_SIZE`` tokens; a row shorter than one tile
    (e.g. a one-token filler row) costs the torch backend at most one tile of scores, and would cost
    FlexAttention a compile of its own (Dynamo specializes sizes 0 and 1).
    """
    if tree_backend in ("auto", "flash"):
        return is_cuda and num_tokens >= flex_backend.BLOCK_SIZE
    return tree_backend == "flex"


def tree_attention_backend(tree_backend: str, query, forest):
    """The backend module of a row: "flash" runs flash_backend where it can (on CUDA, in a flash
    dtype) and is "auto" elsewhere; the others as ``use_flex_attention`` says."""
    if tree_backend == "flash" and flash_backend.supports(
        query.device, query.dtype, query.shape[-1]
    ):
        return flash_backend
    if use_flex_attention(tree_backend, query.is_cuda, forest.num_tokens):
        return flex_backend
    return torch_backend


def prepare_tree_attention(forest, tree_backend: str, on_cuda: bool) -> None:
    """Build and cache what the backend that ``tree_backend`` picks for ``forest`` on a CUDA
    device (``on_cuda``) or elsewhere reads of it (a ``ForestTable`` build)."""
    if tree_backend == "flash" and on_cuda:
        return
    if use_flex_attention(tree_backend, on_cuda, forest.num_tokens):
        flex_backend.prepare_tree_attention(forest)
    else:
        torch_backend.prepare_tree_attention(forest)


class TreeDotProductAttention(DotProductAttention):
    """DotProductAttention that attends over each token's root path inside a forest.

    The softmax scale is the one DotProductAttention uses (``softmax_scale``, times the layer
    number when ``apply_query_key_layer_scaling`` divided it out). Queries and keys arrive with RoPE
    already applied by ``position_ids`` (the model gathers the rotary table by position).

    Under context parallelism a head all-to-all gives every rank the whole row for ``H / cp``
    heads (``tensor_parallel/context_parallel.py``), the tree backend runs on it unchanged, and a
    second all-to-all returns this rank's tokens. megatron-core's local DotProductAttention has no
    context parallelism (it asserts at construction), so the parent is built with a context
    parallel size of 1 and a dense (non-forest) forward under context parallelism is refused.

    Args:
        tree_backend: "flex" (FlexAttention, CUDA), "torch" (runs everywhere; the oracle),
            "auto": flex for CUDA rows of at least one FlexAttention tile, torch otherwise, or
            "flash": flash attention, one pass per segment and one per ancestor depth, merged
            by log-sum-exp (flash_backend; CUDA, bf16/fp16), "auto" where it cannot run.
        Everything else is DotProductAttention's.
    """

    def __init__(self, *args, tree_backend: str = "auto", **kwargs):
        if tree_backend not in TREE_ATTENTION_BACKENDS:
            raise ValueError(
                f"tree_backend must be one of {TREE_ATTENTION_BACKENDS}, got {tree_backend!r}"
            )
        if "config" in kwargs:
            config = kwargs.pop("config")
        else:
            config, *args = args
        local = config
        if config.context_parallel_size > 1:
            local = copy.copy(config)
            local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.config = config
        self.tree_backend = tree_backend
        self.cp_group = getattr(self.pg_collection, "cp", None)
        if self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()

    def forest_tables(self, device: torch.device) -> tuple[ForestTable, ...]:
        """What this layer builds from every forest on ``device`` (``hybrid_model.forest_tables``):
        the tables of the backend that runs there (flash's passes are left to the forward)."""
        return (ForestTable(prepare_tree_attention, (self.tree_backend, device.type == "cuda")),)

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
            if self.cp_group.size() > 1:
                raise ValueError(
                    f"TreeDotProductAttention: a dense forward with context_parallel_size="
                    f"{self.cp_group.size()} (megatron-core's local attention has no context "
                    "parallelism; only forest forwards do here)"
                )
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
        scale = self._tree_softmax_scale()
        backend = tree_attention_backend(self.tree_backend, query, forest)
        if self.cp_group.size() == 1:
            return backend.tree_attention(query, key, value, forest, softmax_scale=scale)
        return whole_row_to_heads(
            backend.tree_attention(
                *self._whole_row(query, key, value), forest, softmax_scale=scale
            ),
            self.cp_group,
        )

    def _tree_softmax_scale(self) -> float:
        """DotProductAttention's softmax scale, with the layer number that query-key layer scaling
        divided out put back."""
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        return scale

    def kernel_signature(self) -> tuple[int, int, int, float]:
        """(query heads, key/value groups, head dim, softmax scale) of the rows the tree backend
        runs for this layer on this rank: the tensor-parallel rank's heads, and under context
        parallelism ``1 / cp`` of them over the whole row (``_whole_row``)."""
        heads = self.num_attention_heads_per_partition
        groups = self.num_query_groups_per_partition
        cp_size = self.cp_group.size()
        if cp_size > 1:
            groups = groups // cp_size if groups % cp_size == 0 else heads // cp_size
            heads //= cp_size
        return heads, groups, self.hidden_size_per_attention_head, self._tree_softmax_scale()

    def _whole_row(self, query, key, value):
        """This rank's tokens -> the whole row for its ``1 / cp`` of the heads.

        Key/value groups travel with their query heads when the group count divides by ``cp``
        (consecutive query heads share a group); otherwise each query head gets its own copy of its
        group first.
        """
        cp_size = self.cp_group.size()
        heads, groups = query.shape[2], key.shape[2]
        if heads % cp_size:
            raise ValueError(
                f"{heads} attention heads per tensor-parallel rank cannot be split over "
                f"context_parallel_size={cp_size}"
            )
        if groups % cp_size:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        return tuple(heads_to_whole_row(x, self.cp_group) for x in (query, key, value))


def precompile_tree_attention(
    model: torch.nn.Module,
    max_tokens: int,
    *,
    mode: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[int, ...]:
    """``flex_backend.precompile`` for every distinct ``kernel_signature`` of the model's tree
    attention layers, rows of up to ``max_tokens`` tokens: every FlexAttention kernel of the run is
    compiled before its first step (mode "dynamic": one dynamic-shape kernel per signature;
    "buckets": a static kernel per bucket length as well). Forward without autograd is compiled
    too when the model recomputes activations. Layers of tree_backend "flash" that flash_backend
    runs at ``dtype`` on ``device`` compile nothing (flash attention is not compiled).

    Returns:
        The row lengths compiled (empty when no attention layer runs FlexAttention).
    """

    def runs_flex(layer):
        head_dim = layer.hidden_size_per_attention_head
        return layer.tree_backend != "flash" or not flash_backend.supports(device, dtype, head_dim)

    signatures = sorted(
        {
            m.kernel_signature()
            for m in model.modules()
            if isinstance(m, TreeDotProductAttention) and runs_flex(m)
        }
    )
    recompute = getattr(model.config, "recompute_granularity", None) is not None
    compiled = ()
    for heads, groups, head_dim, scale in signatures:
        compiled = flex_backend.precompile(
            max_tokens,
            mode=mode,
            num_heads=heads,
            num_groups=groups,
            head_dim=head_dim,
            softmax_scale=scale,
            dtype=dtype,
            device=device,
            no_grad_forward=recompute,
        )
    return compiled
