"""FlexAttention tree backend: block mask against the dense allow-mask, outputs against the torch backend."""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention import flex_backend, torch_backend
from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors


def block_truth(allow, block):
    """(visible, full) [nb, nb] from the dense mask: any / all allowed pairs in each tile."""
    num_tokens = allow.shape[0]
    num_blocks = -(-num_tokens // block)
    visible = np.zeros((num_blocks, num_blocks), dtype=bool)
    full = np.zeros_like(visible)
    for i in range(num_blocks):
        for j in range(num_blocks):
            tile = allow[i * block : (i + 1) * block, j * block : (j + 1) * block]
            visible[i, j], full[i, j] = tile.any(), tile.all()
    return visible, full


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("block", [4, 16])
def test_block_mask_matches_dense_mask(forest_sequences, depth, block):
    layout = plan_shared_prefix(
        forest_sequences(seed=depth, depth=depth, max_segment=20), capacity=1024
    ).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    mask = flex_backend.tree_block_mask(forest, block_size=block)
    dense = mask.to_dense()[0, 0].numpy().astype(bool)
    visible, full = block_truth(tree_attention_allow_mask(layout), block)
    # FlexAttention's dense view marks partial and full tiles alike.
    np.testing.assert_array_equal(dense, visible)
    # Full tiles skip the mask; diagonal tiles are always left partial (a ragged 1 x 1 corner is
    # technically full, and evaluating its mask costs nothing).
    full_blocks = np.zeros_like(full)
    for row, (count, indices) in enumerate(
        zip(mask.full_kv_num_blocks[0, 0].numpy(), mask.full_kv_indices[0, 0].numpy())
    ):
        full_blocks[row, indices[:count]] = True
    np.testing.assert_array_equal(full_blocks, full & ~np.eye(len(full), dtype=bool))


def _random_qkv(num_tokens, dtype, seed, heads=8, groups=2, head_dim=64):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(  # noqa: E731
        num_tokens,
        1,
        h,
        head_dim,
        generator=generator,
        device="cuda",
        dtype=dtype,
        requires_grad=True,
    )
    return make(heads), make(groups), make(groups)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [1, 3])
def test_flex_matches_torch_backend_on_cuda(forest_sequences, dtype, depth):
    """Outputs and gradients of the compiled FlexAttention path against the torch backend (float32)."""
    sequences = forest_sequences(seed=depth, depth=depth, max_segment=300)
    layout = plan_shared_prefix(sequences, capacity=8192).rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    query, key, value = _random_qkv(layout.num_tokens, dtype, seed=depth)
    out = flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125)
    expected = torch_backend.tree_attention(
        *(t.float() for t in (query, key, value)), forest, softmax_scale=0.125
    )
    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((out.float() * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    # bf16 inputs: flex accumulates in float32 but rounds q/k/v/out to bf16 (2^-8 relative).
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-4, atol=2e-4)
    )
    torch.testing.assert_close(out.float(), expected, **tolerance)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.float(), expected_grad.float(), **tolerance)


@pytest.mark.gpu
def test_new_row_lengths_do_not_recompile(forest_sequences):
    from torch._dynamo.utils import counters

    lengths = []
    for seed in range(4):
        layout = plan_shared_prefix(
            forest_sequences(seed=seed, depth=2, max_segment=200), capacity=8192
        ).rows[0]
        forest = ForestTensors.from_layout(layout, "cuda")
        query, key, value = _random_qkv(layout.num_tokens, torch.bfloat16, seed=seed)
        flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125).sum().backward()
        lengths.append(layout.num_tokens)
        if seed == 1:
            graphs_after_two = counters["stats"]["unique_graphs"]
    assert len(set(lengths)) == 4
    assert counters["stats"]["unique_graphs"] == graphs_after_two


def test_auto_backend_uses_flex_for_cuda_rows_of_a_tile_or_more():
    from megatron.shared_prefix.attention.dot_product_attention import use_flex_attention

    tile = flex_backend.BLOCK_SIZE
    assert use_flex_attention("auto", True, tile)
    assert not use_flex_attention("auto", True, tile - 1)
    assert not use_flex_attention("auto", True, 1)
    assert not use_flex_attention("auto", False, 10 * tile)
    assert use_flex_attention("flex", True, 1) and not use_flex_attention("torch", True, 10 * tile)
