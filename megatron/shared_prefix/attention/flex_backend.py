"""Tree attention on CUDA through PyTorch FlexAttention, with a block mask built from the forest.

The mask is the forest's one-line rule ``k <= q < token_subtree_end[k]``. FlexAttention skips tiles
that
no query of a block may attend, computes tiles that every query may attend without evaluating the
mask,
and evaluates the mask only on the tiles in between, so work follows the attended pairs of the
forest.

The block mask is derived in O(T + (T / block)^2) tensor work, with no [T, T] mask and no scatter:
in DFS order the queries that may attend a key ``k`` are the contiguous range ``[k, end_k)``, so the
query blocks that may attend key block ``j`` are the contiguous range from ``j`` to the block of
``max end_k - 1``, and those that attend every key of block ``j`` with every query are the blocks
strictly after ``j`` that end before ``min end_k``.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megatron.shared_prefix.tensors import ForestTensors

BLOCK_SIZE = 128

_compiled_flex_attention = None  # pylint: disable=invalid-name


def _flex_attention():
    """flex_attention compiled once per process, with dynamic shapes so new row lengths reuse it."""
    global _compiled_flex_attention  # pylint: disable=global-statement
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex_attention


def tree_mask_mod(token_subtree_end: torch.Tensor):
    """FlexAttention mask_mod of a forest: query ``q`` sees key ``k`` iff ``k <= q < end[k]``."""

    def mask_mod(batch, head, q_idx, kv_idx):  # pylint: disable=unused-argument
        return (kv_idx <= q_idx) & (q_idx < token_subtree_end[kv_idx])

    return mask_mod


def _block_ranges(token_subtree_end: torch.Tensor, block_size: int):
    """Per key block ``j``: the last query block that sees any of its keys, and the last that
    sees all of them."""
    num_tokens = token_subtree_end.shape[0]
    num_blocks = -(-num_tokens // block_size)
    padding = num_blocks * block_size - num_tokens
    ends = torch.nn.functional.pad(token_subtree_end, (0, padding), value=num_tokens)
    ends = ends.view(num_blocks, block_size)
    last_any = (ends.amax(dim=1) - 1) // block_size
    # A query block sees all of key block j iff it lies after j and ends before min end_k; the last
    # (partial) query block ends at T.
    min_end = ends.amin(dim=1)
    block_ends = torch.clamp(
        torch.arange(1, num_blocks + 1, device=ends.device) * block_size, max=num_tokens
    )
    return num_blocks, last_any, min_end, block_ends


def tree_block_mask(forest: ForestTensors, block_size: int = BLOCK_SIZE) -> BlockMask:
    """FlexAttention BlockMask of the forest (built on the forest's device, no [T, T] tensor)."""
    end = forest.token_subtree_end
    num_tokens = forest.num_tokens
    num_blocks, last_any, min_end, block_ends = _block_ranges(end, block_size)
    q_block = torch.arange(num_blocks, device=end.device)[:, None]
    kv_block = torch.arange(num_blocks, device=end.device)[None, :]
    visible = (q_block >= kv_block) & (q_block <= last_any[None, :])
    full = (q_block > kv_block) & (block_ends[:, None] <= min_end[None, :])
    partial = visible & ~full

    def as_kv_lists(blocks: torch.Tensor):
        counts = blocks.sum(dim=1, dtype=torch.int32)
        # Stable descending sort puts the selected key blocks first, in ascending order.
        indices = torch.argsort(blocks.to(torch.int8), dim=1, descending=True, stable=True)
        return counts[None, None], indices.to(torch.int32)[None, None]

    kv_num_blocks, kv_indices = as_kv_lists(partial)
    full_num_blocks, full_indices = as_kv_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_num_blocks,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(end),
        seq_lengths=(num_tokens, num_tokens),
    )


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    forest: ForestTensors,
    *,
    softmax_scale: float,
    compiled: bool = True,
) -> torch.Tensor:
    """Same contract as ``torch_backend.tree_attention`` ([T, 1, H, D] in, [T, 1, H * D] out).

    The block mask is built once per forest and cached on it. ``compiled=False`` runs FlexAttention
    eagerly (its reference implementation; used on CPU in tests).
    """
    num_tokens, batch, num_heads, head_dim = query.shape
    if batch != 1 or num_tokens != forest.num_tokens:
        raise ValueError(
            f"tree attention expects [T={forest.num_tokens}, 1, H, D] queries for this forest, "
            f"got {tuple(query.shape)}"
        )
    block_mask = forest.derive(("flex_block_mask", BLOCK_SIZE), lambda: tree_block_mask(forest))
    attend = _flex_attention() if compiled else flex_attention
    # [T, 1, H, D] -> [1, H, T, D]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = attend(
        q, k, v, block_mask=block_mask, scale=softmax_scale, enable_gqa=key.shape[2] != num_heads
    )
    return out.permute(2, 0, 1, 3).reshape(num_tokens, 1, num_heads * head_dim)
