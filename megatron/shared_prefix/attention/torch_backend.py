"""Pure-torch tree attention: block-sparse over the keys each query block can see.

Queries are processed in blocks of ``block_size`` consecutive tokens. A block gathers only the keys
that one of its queries may attend (``ForestTensors.attention_key_blocks``) and applies the tree
mask
on that [block_size, K_b] tile, so memory is O(block_size * T) at most, far below the T x T scores
of a dense mask, and work tracks the number of attended pairs. Runs on any device; it is the CPU
path
and the oracle for the GPU backends.
"""

import torch

from megatron.shared_prefix.tensors import ForestTensors


def prepare_tree_attention(forest: ForestTensors, block_size: int = 128) -> None:
    """Build and cache what ``tree_attention`` reads of ``forest`` (its key blocks)."""
    forest.attention_key_blocks(block_size)


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    forest: ForestTensors,
    *,
    softmax_scale: float,
    block_size: int = 128,
) -> torch.Tensor:
    """Attention of every packed token over its root path.

    Args:
        query: [T, 1, H, D].
        key, value: [T, 1, G, D] with G dividing H (grouped-query attention: query head h reads
            key/value group h // (H // G), as megatron-core's DotProductAttention does).
        forest: the row's metadata; T must equal ``forest.num_tokens``.
        softmax_scale: multiplier of q.k before the softmax.
        block_size: queries per tile.

    Returns:
        [T, 1, H * D] context in the query's dtype (softmax computed in float32).
    """
    num_tokens, batch, num_heads, head_dim = query.shape
    if batch != 1 or num_tokens != forest.num_tokens:
        raise ValueError(
            f"tree attention expects [T={forest.num_tokens}, 1, H, D] queries for this forest, "
            f"got {tuple(query.shape)}"
        )
    groups = key.shape[2]
    q = query[:, 0]
    k = key[:, 0].repeat_interleave(num_heads // groups, dim=1)
    v = value[:, 0].repeat_interleave(num_heads // groups, dim=1)
    subtree_end = forest.token_subtree_end

    contexts = []
    for block, keys in enumerate(forest.attention_key_blocks(block_size)):
        start = block * block_size
        end = min(start + block_size, num_tokens)
        positions = torch.arange(start, end, device=q.device)
        allowed = (keys[None, :] <= positions[:, None]) & (
            positions[:, None] < subtree_end[keys][None, :]
        )
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[keys]) * softmax_scale
        scores = scores.float().masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        contexts.append(torch.einsum("hqk,khd->qhd", probs, v[keys]))
    return torch.cat(contexts).reshape(num_tokens, 1, num_heads * head_dim)
