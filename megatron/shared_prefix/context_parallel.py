"""Context parallelism for forest rows: the tokens and loss edges each context-parallel rank holds.

A row is split across ``cp`` ranks as megatron-core splits a sequence: into ``2 * cp`` equal chunks
of the DFS-ordered row, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``. Inside attention
and Mamba layers a head all-to-all gives every rank the whole row for ``1 / cp`` of the heads, so
tree attention and the tree scan run unchanged on the whole forest; their work is the same on
every rank whatever the split, and the token-wise layers (MLP, MoE, norms, the output layer) get
equal token counts. The chunk order is megatron-core's, which its ``MambaContextParallel`` undoes
and redoes around the scan. docs/architecture.md says why this design was chosen over gathering
keys and values to queries that stay local.

Each loss edge belongs to the rank that holds its source token: that rank has the source's hidden
state after the last layer, so it alone computes the edge's loss.

Host side (numpy only), like :mod:`megatron.shared_prefix.layout`.
"""

import numpy as np

from megatron.shared_prefix.layout import ForestLayout


def context_parallel_tokens(num_tokens: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """[T / cp] int64 ascending packed indices of the tokens context-parallel rank ``cp_rank``
    holds, in the order its local sequence has them.

    Raises:
        ValueError: when ``T`` is not a multiple of ``2 * cp`` (cp > 1) or the rank is out of range.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of size {cp_size}")
    if cp_size == 1:
        return np.arange(num_tokens, dtype=np.int64)
    if num_tokens % (2 * cp_size):
        raise ValueError(
            f"a forest row of {num_tokens} tokens cannot be split over {cp_size} context-parallel "
            f"ranks: its length must be a multiple of 2 x context_parallel_size = {2 * cp_size} "
            "(plan with pad_multiple a multiple of it)"
        )
    chunk = num_tokens // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return np.concatenate(
        [np.arange(k * chunk, (k + 1) * chunk, dtype=np.int64) for k in (first, second)]
    )


def token_context_parallel_rank(num_tokens: int, cp_size: int) -> np.ndarray:
    """[T] int64 context-parallel rank holding each packed token."""
    if cp_size == 1:
        return np.zeros(num_tokens, dtype=np.int64)
    context_parallel_tokens(num_tokens, cp_size, 0)
    chunk = np.arange(num_tokens, dtype=np.int64) // (num_tokens // (2 * cp_size))
    return np.minimum(chunk, 2 * cp_size - 1 - chunk)


def context_parallel_edges(layout: ForestLayout, cp_size: int, cp_rank: int) -> np.ndarray:
    """Ascending int64 indices of ``layout``'s loss edges owned by context-parallel rank
    ``cp_rank``: those whose source token that rank holds. At ``cp_size`` 1, every edge.

    At context-parallel size > 1 the forest forward on that rank returns exactly these edges'
    losses, in this order.
    """
    owner = token_context_parallel_rank(layout.num_tokens, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of size {cp_size}")
    return np.flatnonzero(owner[layout.edge_source] == cp_rank).astype(np.int64)
