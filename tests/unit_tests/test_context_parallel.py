"""Context-parallel split of a forest row: token ownership, edge ownership, local projections.

The multi-process runs (tests/unit_tests/distributed) check the split end to end against the dense
reference; these check its bookkeeping on random forests without a process group.
"""

import numpy as np
import pytest
import torch

from megatron.shared_prefix import context_parallel_edges, plan_shared_prefix
from megatron.shared_prefix.context_parallel import (
    context_parallel_tokens,
    token_context_parallel_rank,
)
from megatron.shared_prefix.tensors import ForestTensors


def test_tokens_follow_megatrons_chunk_order():
    # 2 x cp = 4 chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert context_parallel_tokens(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert context_parallel_tokens(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    assert token_context_parallel_rank(12, 2).tolist() == [0] * 3 + [1] * 6 + [0] * 3
    assert context_parallel_tokens(5, 1, 0).tolist() == list(range(5))
    with pytest.raises(ValueError, match="multiple of 2 x context_parallel_size = 4"):
        context_parallel_tokens(10, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        context_parallel_tokens(12, 2, 2)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_every_edge_has_exactly_the_owner_of_its_source(forest_sequences, cp_size, depth):
    sequences = forest_sequences(seed=depth, depth=depth)
    layout = plan_shared_prefix(sequences, capacity=4096, pad_multiple=2 * cp_size).rows[0]
    owned = [context_parallel_edges(layout, cp_size, rank) for rank in range(cp_size)]
    assert all(o.dtype == np.int64 and np.all(np.diff(o) > 0) for o in owned)
    assert sorted(np.concatenate(owned).tolist()) == list(range(len(layout.edge_source)))
    for rank, edges in enumerate(owned):
        held = set(context_parallel_tokens(layout.num_tokens, cp_size, rank).tolist())
        assert all(int(layout.edge_source[e]) in held for e in edges)


@pytest.mark.parametrize("cp_size,sp_size", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_local_projections_select_each_owned_source_once(forest_sequences, cp_size, sp_size):
    """Per context-parallel rank: the sequence-parallel ranks' selected sources, stacked as the
    output layer's all-gather stacks them, give every owned edge its own source token."""
    sequences = forest_sequences(seed=7, depth=3)
    multiple = sp_size * (2 * cp_size if cp_size > 1 else 1)
    layout = plan_shared_prefix(sequences, capacity=4096, pad_multiple=multiple).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    for cp_rank in range(cp_size):
        blocks, slots, owned = [], None, None
        for sp_rank in range(sp_size):
            held = forest.local_tokens(cp_size, cp_rank, sp_size, sp_rank)
            assert len(held) == layout.num_tokens // (cp_size * sp_size)
            local, slots, owned = forest.edge_projection(cp_size, cp_rank, sp_size, sp_rank)
            blocks.append(held[local])
        stacked = torch.cat(blocks)
        expected = context_parallel_edges(layout, cp_size, cp_rank)
        if cp_size == 1:
            assert owned is None
            owned = torch.arange(len(layout.edge_source))
        assert owned.tolist() == expected.tolist()
        assert stacked[slots].tolist() == layout.edge_source[expected].tolist()
