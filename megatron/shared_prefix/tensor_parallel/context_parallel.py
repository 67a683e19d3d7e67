"""Head all-to-all of a context-parallel forest row around tree attention (upstream:
megatron/core/tensor_parallel/mappings.py, next to ``all_to_all_sp2hp``).

Under context parallelism rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of the row's ``2 cp``
chunks (megatron's split, ``megatron.shared_prefix.context_parallel``). Tree attention needs every
ancestor of a query, wherever it lives; exchanging sequence for heads gives every rank the whole row
for ``H / cp`` heads, in which the existing tree kernels run unchanged. After the all-to-all the
ranks' pieces arrive in rank order (chunks ``0, 2cp-1, 1, 2cp-2, ...``); putting them back in row
order is a permutation of ``2 cp`` contiguous chunks (views and one concatenation, whose backward is
a split: no scatter).

Multi-token prediction needs two more exchanges: every MTP depth reads its tokens' input states from
anywhere in the previous depth's row (:func:`whole_row`), and hands each per-edge loss to the rank
that owns the edge in the main row (:func:`share_over_context_parallel`).
"""

import torch
from megatron.core.tensor_parallel.mappings import (
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    gather_from_sequence_parallel_region,
)


def _rank_order_chunks(cp_size: int) -> list[int]:
    """Row chunk at each position of the rank-ordered sequence: 0, 2cp-1, 1, 2cp-2, ..."""
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def _rank_order_to_row(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp_size, dim=0)
    position = {chunk: k for k, chunk in enumerate(_rank_order_chunks(cp_size))}
    return torch.cat([chunks[position[chunk]] for chunk in range(2 * cp_size)], dim=0)


def _row_to_rank_order(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp_size, dim=0)
    return torch.cat([chunks[chunk] for chunk in _rank_order_chunks(cp_size)], dim=0)


def heads_to_whole_row(x: torch.Tensor, group) -> torch.Tensor:
    """[T / cp, b, H, D] this rank's tokens, all heads -> [T, b, H / cp, D] the whole row in row
    order, this rank's ``H / cp`` consecutive heads. ``H`` must be a multiple of ``cp``."""
    cp_size = group.size()
    tokens, batch, heads, dim = x.shape
    gathered = all_to_all_sp2hp(x.reshape(tokens * batch, heads * dim), group=group)
    whole = gathered.reshape(tokens * cp_size, batch, heads // cp_size, dim)
    return _rank_order_to_row(whole, cp_size)


def whole_row_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[T, b, h] the whole row for this rank's heads (``h = H / cp * D``) -> [T / cp, b, H * D]
    this rank's tokens for all heads; the inverse of :func:`heads_to_whole_row`."""
    cp_size = group.size()
    tokens, batch, width = x.shape
    ranked = _row_to_rank_order(x, cp_size)
    local = all_to_all_hp2sp(ranked.reshape(tokens * batch, width), group=group)
    return local.reshape(tokens // cp_size, batch, width * cp_size)


def whole_row(x: torch.Tensor, cp_size: int, cp_group, sp_group=None) -> torch.Tensor:
    """[T / (cp * sp), b, h] this rank's tokens of a row -> [T, b, h] the whole row, in row order.

    The sequence-parallel chunks are all-gathered over ``sp_group`` (None: no sequence
    parallelism), then the context-parallel shares over ``cp_group`` (``cp_size`` 1: none) and put
    back in row order. Backward: each rank receives the sum over the ranks of the gradients of its
    own tokens (reduce-scatters), so a rank may read any token of the row.
    """
    if sp_group is not None and sp_group.size() > 1:
        x = gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=sp_group
        )
    if cp_size > 1:
        x = gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=cp_group
        )
        x = _rank_order_to_row(x, cp_size)
    return x


class _AllReduceBothWays(torch.autograd.Function):
    """Sum over a group in the forward pass and of the gradients in the backward pass."""

    @staticmethod
    def forward(ctx, x, group):  # pylint: disable=arguments-differ
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def share_over_context_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank of ``group`` gets the sum of the ranks' ``x``, differentiably on every rank.

    For values that each rank computes for a disjoint set of entries (zeros elsewhere): any rank
    may then use any entry, and the entry's gradient reaches the rank that computed it.
    """
    if group.size() == 1:
        return x
    return _AllReduceBothWays.apply(x, group)
