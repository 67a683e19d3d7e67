"""Flash tree attention (attention/flash_backend.py): the pass tables, and the decomposition and
merged backward against the dense-mask oracle. On CPU the passes run as plain torch math; on CUDA
the flash kernels (``gpu`` tests)."""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention import flash_backend, flex_backend, torch_backend
from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

# Two stars (prompts of 3 and 2 tokens) and a sequence of its own.
STARS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8, 9, 10, 11], [7, 8, 12], [13, 14]]
# A root, a child with two children of its own, and a leaf under the root.
DEPTH_3 = [[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 6], [1, 2, 7], [20, 21]]


def _forest(sequences, device="cpu", pad_multiple=1):
    (layout,) = plan_shared_prefix(sequences, capacity=64, pad_multiple=pad_multiple).rows
    return ForestTensors.from_layout(layout, device)


@pytest.mark.parametrize("sequences", [STARS, DEPTH_3], ids=["stars", "depth-3"])
def test_each_ancestor_pass_pairs_descendants_with_their_ancestor_at_its_depth(sequences):
    """Pass d: every segment at depth d with descendants, its descendants' tokens (queries) against
    its own tokens (keys); with the segment pass, every allowed (query, key) pair once."""
    forest = _forest(sequences, pad_multiple=8)
    layout = forest.layout
    passes = flash_backend.flash_passes(forest)
    segments = passes.segments
    assert segments.causal and segments.query_index is None
    assert segments.host_query_bounds.tolist() == [*layout.segment_starts, layout.num_tokens]
    segment, depth = layout.token_segment, layout.segment_depth
    assert len(passes.ancestors) == depth.max()
    pairs = np.zeros((layout.num_tokens, layout.num_tokens), dtype=int)
    for s in range(len(depth)):
        tokens = np.flatnonzero(segment == s)
        pairs[np.ix_(tokens, tokens)] += np.tril(np.ones((len(tokens), len(tokens)), dtype=int))
    for level, ancestor in enumerate(passes.ancestors):
        assert not ancestor.causal
        rows, keys = ancestor.query_index.numpy(), ancestor.key_index.numpy()
        for i in range(len(ancestor.host_query_bounds) - 1):
            queries = rows[ancestor.host_query_bounds[i] : ancestor.host_query_bounds[i + 1]]
            owner = keys[ancestor.host_key_bounds[i] : ancestor.host_key_bounds[i + 1]]
            (root,) = set(segment[owner])
            assert depth[root] == level and len(owner) == layout.segment_lengths[root]
            assert np.all(depth[segment[queries]] > level)
            pairs[np.ix_(queries, owner)] += 1
        assert ancestor.max_query == np.diff(ancestor.host_query_bounds).max()
    assert np.array_equal(pairs, tree_attention_allow_mask(layout).astype(int))


def test_packed_dense_rows_take_the_segment_pass_only():
    passes = flash_backend.flash_passes(_forest([[1, 2, 3], [4, 5]]))
    assert passes.ancestors == () and passes.segments.host_query_bounds.tolist() == [0, 3, 5]
    assert not flash_backend.supports("cpu", torch.bfloat16, 64)
    assert not flash_backend.supports("cuda", torch.float32, 64)
    assert not flash_backend.supports("cuda", torch.bfloat16, 12)
    assert flash_backend.supports("cuda", torch.float16, 128)


@pytest.mark.parametrize(
    "sequences,pad_multiple",
    [(STARS, 1), (STARS, 8), (DEPTH_3, 1), (DEPTH_3, 8), ([[1, 2, 3], [4, 5]], 1)],
    ids=["stars", "stars-padded", "depth-3", "depth-3-padded", "roots"],
)
def test_flash_passes_match_the_dense_mask_oracle(sequences, pad_multiple):
    _assert_matches_oracle(_forest(sequences, pad_multiple=pad_multiple))


def _assert_matches_oracle(forest):
    """Output and q, k, v gradients of the merged passes are those of masked dense attention
    (``reference.tree_attention_allow_mask``; float64, GQA)."""
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


def test_merges_in_place_leave_the_inputs_and_saved_tensors_alone():
    """The merges update the forward's and backward's own tensors in place: q, k, v, the
    incoming gradient and a second backward through a retained graph are untouched by them."""
    forest = _forest(DEPTH_3, pad_multiple=8)
    generator = torch.Generator().manual_seed(1)
    inputs = [
        torch.randn(forest.num_tokens, 1, heads, 8, generator=generator, dtype=torch.float64)
        for heads in (4, 2, 2)
    ]
    grad = torch.randn(forest.num_tokens, 1, 32, generator=generator, dtype=torch.float64)
    originals = [t.clone() for t in (*inputs, grad)]
    leaves = [t.requires_grad_() for t in inputs]
    out = flash_backend.tree_attention(*leaves, forest, softmax_scale=0.3)
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad)
    assert all(torch.equal(a, b) for a, b in zip((*inputs, grad), originals))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_deep_random_forests_match_the_dense_mask_oracle(forest_sequences):
    """Forests of depth 5, so that four ancestor passes merge into some tokens."""
    forest = ForestTensors.from_layout(
        plan_shared_prefix(forest_sequences(seed=4, depth=5), capacity=4096).rows[0], "cpu"
    )
    assert len(flash_backend.flash_passes(forest).ancestors) >= 4
    _assert_matches_oracle(forest)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "prompt,turns", [(1024, [[512] * 8]), (300, [[77] * 5]), (700, [[300] * 3, [200] * 2])]
)
def test_flash_is_as_close_to_float32_as_flex_on_cuda(prompt, turns):
    """bf16 on the flash kernels: output and gradients within FlexAttention's distance from the
    float32 oracle on the same inputs (GRPO stars and a depth-3 tree, GQA 8 / 2 heads of 64) times
    the number of passes (the segment pass and one per turn). Flash's backward rounds each pass's dq, dk and dv to bf16
    before their float32 sum, so a key that the segment pass and m ancestor passes reach carries
    m + 1 roundings where FlexAttention's one kernel rounds once (on the depth-3 tree, dv came out
    at 2.45 times FlexAttention's distance on one random draw)."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 100, prompt).tolist()]
    for widths in turns:  # each turn branches every sequence so far
        sequences = [s + rng.integers(1, 100, n).tolist() for s in sequences for n in widths]
    sequences.append(rng.integers(1, 100, 200).tolist())
    forest = _forest_of(sequences, "cuda")
    assert len(flash_backend.flash_passes(forest).ancestors) == len(turns)
    assert flash_backend.supports("cuda", torch.bfloat16, 64)
    bound = 1 + len(turns)
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = [
        torch.randn(forest.num_tokens, 1, h, 64, device="cuda", generator=generator)
        for h in (8, 2, 2)
    ]
    grad = torch.randn(forest.num_tokens, 1, 8 * 64, device="cuda", generator=generator)

    def run(backend, dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in inputs]
        out = backend.tree_attention(*leaves, forest, softmax_scale=0.125)
        out.backward(grad.to(dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    oracle = run(torch_backend, torch.float32)
    flash, flex = run(flash_backend, torch.bfloat16), run(flex_backend, torch.bfloat16)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), flash, flex, oracle):
        flash_error, flex_error = (a - c).abs().max().item(), (b - c).abs().max().item()
        assert flash_error <= bound * flex_error, (name, flash_error, flex_error, bound)


def _forest_of(sequences, device):
    capacity = sum(len(s) for s in sequences) + 128
    (layout,) = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=128).rows
    return ForestTensors.from_layout(layout, device)


def test_flash_tree_backend_runs_where_flash_can_and_is_auto_elsewhere(monkeypatch):
    from megatron.shared_prefix.attention.dot_product_attention import tree_attention_backend

    forest = _forest(STARS)
    query = torch.zeros(forest.num_tokens, 1, 2, 8)
    assert tree_attention_backend("flash", query, forest) is torch_backend  # CPU: no flash
    monkeypatch.setattr(flash_backend, "supports", lambda device, dtype, head_dim: True)
    assert tree_attention_backend("flash", query, forest) is flash_backend
    assert tree_attention_backend("auto", query, forest) is torch_backend
    assert tree_attention_backend("flex", query, forest) is flex_backend
