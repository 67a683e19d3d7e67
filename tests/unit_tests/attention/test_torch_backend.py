"""Tree attention (torch backend) against a dense softmax over the planner's allow-mask."""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.attention.torch_backend import tree_attention
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors


def dense_masked_attention(query, key, value, allow, scale):
    """[T, 1, H*D] softmax(q k^T * scale) v over a dense [T, T] allow-mask, float64."""
    num_heads, groups = query.shape[2], key.shape[2]
    q = query[:, 0].double()
    k = key[:, 0].double().repeat_interleave(num_heads // groups, dim=1)
    v = value[:, 0].double().repeat_interleave(num_heads // groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~torch.as_tensor(allow), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(query.shape[0], 1, -1)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [1, 5, 128])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_matches_dense_mask(forest_sequences, depth, block_size, heads, groups):
    sequences = forest_sequences(seed=depth * 7 + block_size, depth=depth)
    plan = plan_shared_prefix(sequences, capacity=512, pad_multiple=8)
    layout = plan.rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    generator = torch.Generator().manual_seed(depth)
    shape = (layout.num_tokens, 1)
    query = torch.randn(*shape, heads, 8, generator=generator, requires_grad=True)
    key = torch.randn(*shape, groups, 8, generator=generator, requires_grad=True)
    value = torch.randn(*shape, groups, 8, generator=generator, requires_grad=True)

    out = tree_attention(query, key, value, forest, softmax_scale=0.3, block_size=block_size)
    expected = dense_masked_attention(query, key, value, tree_attention_allow_mask(layout), 0.3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)

    weights = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-5)


def test_key_blocks_cover_exactly_the_attended_keys(forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=3, depth=3), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    allow = tree_attention_allow_mask(layout)
    block = 4
    for index, keys in enumerate(forest.attention_key_blocks(block)):
        rows = allow[index * block : (index + 1) * block]
        np.testing.assert_array_equal(keys.numpy(), np.flatnonzero(rows.any(axis=0)))


def test_rejects_rows_of_another_forest(forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=1, depth=2), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    query = torch.zeros(layout.num_tokens + 1, 1, 2, 4)
    with pytest.raises(ValueError, match="tree attention expects"):
        tree_attention(query, query, query, forest, softmax_scale=1.0)
