"""Two-pass flash tree attention for forests of stars (attention/flash_backend.py): the pass tables,
and the decomposition and merged backward against the torch backend (the oracle). On CPU the passes
run as plain torch math; on CUDA the flash kernels (``gpu`` tests)."""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention import flash_backend, flex_backend, torch_backend
from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

# Two stars (prompts of 3 and 2 tokens) and a sequence of its own: a forest of stars.
STARS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8, 9, 10, 11], [7, 8, 12], [13, 14]]
DEPTH_3 = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7]]


def _forest(sequences, device="cpu", pad_multiple=1):
    (layout,) = plan_shared_prefix(sequences, capacity=64, pad_multiple=pad_multiple).rows
    return ForestTensors.from_layout(layout, device)


def test_star_passes_pair_every_leaf_token_with_its_root():
    forest = _forest(STARS, pad_multiple=8)
    layout = forest.layout
    passes = flash_backend.star_passes(forest)
    segment_bounds = passes.segments.host_query_bounds
    assert segment_bounds.tolist() == [*layout.segment_starts.tolist(), layout.num_tokens]
    assert passes.segments.causal and passes.segments.query_index is None
    leaves = passes.leaves
    assert not leaves.causal and len(leaves.host_query_bounds) == 3  # the two stars
    query_tokens, key_tokens = leaves.query_index.numpy(), leaves.key_index.numpy()
    segment = layout.token_segment
    for i in range(2):
        rows = query_tokens[leaves.host_query_bounds[i] : leaves.host_query_bounds[i + 1]]
        keys = key_tokens[leaves.host_key_bounds[i] : leaves.host_key_bounds[i + 1]]
        (root,) = set(segment[keys])
        assert layout.segment_parents[root] == -1
        assert keys.tolist() == list(range(layout.segment_starts[root], keys[-1] + 1))
        assert len(keys) == layout.segment_lengths[root]
        assert set(layout.segment_parents[segment[rows]]) == {root}
    leaf_tokens = np.flatnonzero(layout.segment_parents[segment] >= 0)
    assert sorted(query_tokens.tolist()) == leaf_tokens.tolist()
    assert leaves.max_query == np.diff(leaves.host_query_bounds).max()
    assert leaves.max_key == 3


def test_star_passes_of_other_forests():
    assert flash_backend.star_passes(_forest(DEPTH_3)) is None
    roots = flash_backend.star_passes(_forest([[1, 2, 3], [4, 5]]))
    assert roots.leaves is None and roots.segments.host_query_bounds.tolist() == [0, 3, 5]
    assert not flash_backend.supports(torch.zeros(5, 1, 2, 8), _forest([[1, 2, 3], [4, 5]]))


@pytest.mark.parametrize(
    "sequences,pad_multiple",
    [(STARS, 1), (STARS, 8), ([[1, 2, 3], [4, 5]], 1)],
    ids=["stars", "stars-padded", "roots"],
)
def test_flash_passes_match_the_dense_mask_oracle(sequences, pad_multiple):
    """Output and q, k, v gradients of the merged passes are those of masked dense attention
    (``reference.tree_attention_allow_mask``; float64, GQA)."""
    forest = _forest(sequences, pad_multiple=pad_multiple)
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(forest.num_tokens, 1, heads, 8, generator=generator, dtype=torch.float64)
        for heads in (4, 2, 2)
    ]
    grad = torch.randn(forest.num_tokens, 1, 32, generator=generator, dtype=torch.float64)
    allowed = torch.from_numpy(tree_attention_allow_mask(forest.layout))

    def dense(query, key, value, forest, softmax_scale):
        key, value = (t[:, 0].repeat_interleave(2, dim=1) for t in (key, value))
        scores = torch.einsum("qhd,khd->hqk", query[:, 0], key) * softmax_scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, value).reshape(forest.num_tokens, 1, -1)

    results = []
    for attention in (flash_backend.tree_attention, dense):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attention(*leaves, forest, softmax_scale=0.3)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for flash, oracle in zip(*results):
        torch.testing.assert_close(flash, oracle, rtol=1e-12, atol=1e-12)


def test_flash_tree_attention_refuses_deeper_forests():
    forest = _forest(DEPTH_3)
    query = torch.randn(forest.num_tokens, 1, 2, 8)
    with pytest.raises(ValueError, match="forest of stars"):
        flash_backend.tree_attention(query, query, query, forest, softmax_scale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prompt,completion,group", [(1024, 512, 8), (300, 77, 5)])
def test_flash_is_as_close_to_float32_as_flex_on_cuda(prompt, completion, group):
    """bf16 on the flash kernels: output and gradients within twice FlexAttention's distance from
    the float32 oracle on the same inputs (a GRPO star, GQA 8 / 2 heads of 64)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 100, prompt).tolist()
    sequences = [shared + rng.integers(1, 100, completion).tolist() for _ in range(group)]
    sequences.append(rng.integers(1, 100, 200).tolist())
    forest = _forest_of(sequences, "cuda")
    assert flash_backend.supports(
        torch.empty(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16), forest
    )
    inputs = [torch.randn(forest.num_tokens, 1, h, 64, device="cuda") for h in (8, 2, 2)]
    grad = torch.randn(forest.num_tokens, 1, 8 * 64, device="cuda")

    def run(backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        out = backend.tree_attention(*leaves, forest, softmax_scale=0.125)
        out.backward(grad.to(dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    oracle = run(torch_backend, torch.float32)
    flash, flex = run(flash_backend, torch.bfloat16), run(flex_backend, torch.bfloat16)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), flash, flex, oracle):
        flash_error, flex_error = (a - c).abs().max().item(), (b - c).abs().max().item()
        assert flash_error <= 2 * flex_error, (name, flash_error, flex_error)


def _forest_of(sequences, device):
    capacity = sum(len(s) for s in sequences) + 128
    (layout,) = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=128).rows
    return ForestTensors.from_layout(layout, device)


def test_flash_tree_backend_runs_forests_of_stars_and_is_auto_elsewhere(monkeypatch):
    from megatron.shared_prefix.attention.dot_product_attention import tree_attention_backend

    forest = _forest(STARS)
    query = torch.zeros(forest.num_tokens, 1, 2, 8)
    assert tree_attention_backend("flash", query, forest) is torch_backend  # CPU: no flash
    monkeypatch.setattr(flash_backend, "supports", lambda query, forest: True)
    assert tree_attention_backend("flash", query, forest) is flash_backend
    assert tree_attention_backend("auto", query, forest) is torch_backend
    assert tree_attention_backend("flex", query, forest) is flex_backend
