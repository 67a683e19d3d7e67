"""FlexAttention tree backend: block mask against the dense allow-mask, outputs against the torch
backend, row-length buckets."""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

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


def tiles(num_blocks, indices, block, num_tokens):
    """[T, T] bool: the tiles listed by a BlockMask's (num_blocks, indices) pair, per token."""
    selected = torch.zeros(indices.shape[-1], indices.shape[-1], dtype=torch.bool)
    for row, (count, keys) in enumerate(zip(num_blocks[0, 0], indices[0, 0])):
        selected[row, keys[:count]] = True
    per_token = selected.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return per_token[:num_tokens, :num_tokens]


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("padding", [0, 3, 40])
def test_block_mask_matches_dense_mask(forest_sequences, depth, block, padding):
    layout = plan_shared_prefix(
        forest_sequences(seed=depth, depth=depth, max_segment=20), capacity=1024
    ).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    num_tokens = layout.num_tokens + padding
    mask = flex_backend.tree_block_mask(forest, block_size=block, num_tokens=num_tokens)
    dense = mask.to_dense()[0, 0].numpy().astype(bool)
    # Padded tokens attend nothing and are attended by nothing.
    allow = np.pad(tree_attention_allow_mask(layout), (0, padding))
    visible, full = block_truth(allow, block)
    # FlexAttention's dense view marks partial and full tiles alike.
    np.testing.assert_array_equal(dense, visible)
    # Full tiles skip the mask; diagonal tiles are always left partial (a ragged 1 x 1 corner is
    # technically full, and evaluating its mask costs nothing).
    full_tiles = tiles(mask.full_kv_num_blocks, mask.full_kv_indices, 1, len(full)).numpy()
    np.testing.assert_array_equal(full_tiles, full & ~np.eye(len(full), dtype=bool))
    # Query blocks of padding alone are skipped entirely.
    first_padded_block = -(-layout.num_tokens // block)
    assert not mask.kv_num_blocks[0, 0, first_padded_block:].any()
    assert not mask.full_kv_num_blocks[0, 0, first_padded_block:].any()


@pytest.mark.parametrize("padding", [0, 5])
def test_block_mask_query_lists_are_flex_attentions(forest_sequences, padding):
    """The query-side lists built on the host are the ones FlexAttention's own
    ``BlockMask.from_kv_blocks`` derives from the key-side lists, entry for entry."""
    layout = plan_shared_prefix(
        forest_sequences(seed=7, depth=3, max_segment=24), capacity=1024
    ).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    mask = flex_backend.tree_block_mask(
        forest, block_size=8, num_tokens=layout.num_tokens + padding
    )
    stock = BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        mask.kv_indices,
        mask.full_kv_num_blocks,
        mask.full_kv_indices,
        BLOCK_SIZE=8,
        mask_mod=mask.mask_mod,
        seq_lengths=mask.seq_lengths,
    )
    assert mask.q_num_blocks.any() and mask.full_q_num_blocks.any()
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        ours, theirs = getattr(mask, name), getattr(stock, name)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        assert torch.equal(ours, theirs), name
    assert mask.BLOCK_SIZE == stock.BLOCK_SIZE and mask.seq_lengths == stock.seq_lengths


def test_bucket_length():
    block = flex_backend.BLOCK_SIZE
    bucket = flex_backend.bucket_length
    short = (1, block, block + 1, 4 * block + 1)
    assert [bucket(n) for n in short] == [block, block, 2 * block, 5 * block]
    assert (bucket(20480), bucket(20481), bucket(2**20)) == (20480, 24576, 2**20)
    lengths = np.arange(1, 70000)
    buckets = np.array([bucket(int(n)) for n in lengths])
    assert (buckets >= lengths).all() and (np.diff(buckets) >= 0).all()
    assert (buckets % block == 0).all()
    # Under 25% padding from 4 blocks up, under one block below.
    long = lengths >= 4 * block
    assert ((buckets - lengths)[long] < lengths[long] / 4).all()
    assert ((buckets - lengths)[~long] < block).all()
    # At most four buckets in each octave [2^e, 2^(e+1)).
    _, per_octave = np.unique(np.floor(np.log2(np.unique(buckets))), return_counts=True)
    assert per_octave.max() == 4


def test_run_length():
    """Rows run at the next multiple of a tile, on a static kernel iff that length is a bucket."""
    run = flex_backend.run_length
    assert [run(n) for n in (1, 128, 129, 256)] == [(128, True)] * 2 + [(256, True)] * 2
    assert run(20480) == (20480, True) and run(20481) == (20608, False)
    assert run(18432) == (18432, False) and run(18400) == (18432, False)
    lengths = np.arange(1, 70000, 37)
    runs = [run(int(n)) for n in lengths]
    padded = np.array([length for length, _ in runs])
    assert (padded >= lengths).all() and (padded - lengths < flex_backend.BLOCK_SIZE).all()
    assert (padded % flex_backend.BLOCK_SIZE == 0).all()
    assert all(static == (flex_backend.bucket_length(length) == length) for length, static in runs)


def row_layout(forest_sequences, num_tokens):
    """A row of exactly ``num_tokens``: a random depth-3 forest, padded by the planner."""
    sequences = forest_sequences(seed=num_tokens, depth=3, max_segment=num_tokens // 3)
    return plan_shared_prefix(sequences, capacity=num_tokens, pad_multiple=num_tokens).rows[0]


def cpu_qkv(num_tokens, seed, heads=4, groups=2, head_dim=8, requires_grad=False):
    """[T, 1, heads | groups, head_dim] float32 query, key, value on CPU (GQA)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(num_tokens, 1, h, head_dim, generator=generator, requires_grad=requires_grad)
        for h in (heads, groups, groups)
    )


@pytest.fixture
def dynamo_enabled():
    """Eager FlexAttention traces its reference implementation through Dynamo, which
    tests/conftest.py disables; caches are reset around the test, as in the replay tests."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("dynamo_enabled")
@pytest.mark.parametrize("num_tokens", [130, 300, 1000])
@pytest.mark.parametrize("groups", [2, 1], ids=["grouped-query-kernel", "repeated-groups"])
def test_padded_row_matches_torch_backend(forest_sequences, num_tokens, groups):
    """Eager FlexAttention at the bucket length (no CPU backward in FlexAttention: forward only);
    4 query heads over 2 key/value heads run FlexAttention's grouped-query kernel, over 1 the key
    and value are repeated to the query heads first."""
    assert flex_backend.run_length(num_tokens)[0] > num_tokens
    assert flex_backend.repeats_groups(4, groups) == (groups == 1)
    forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cpu")
    query, key, value = cpu_qkv(num_tokens, seed=num_tokens, groups=groups)
    out = flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.3, compiled=False)
    expected = torch_backend.tree_attention(query, key, value, forest, softmax_scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def flex_semantics(query, key, value, *, block_mask, scale, **_):
    """FlexAttention's result, densely in float64 and differentiable on CPU ([1, H, T, D] in and out):
    query q attends key k iff their tile is full, or partial and mask_mod holds; a query attending
    nothing outputs zeros."""
    num_tokens, block = query.shape[2], block_mask.BLOCK_SIZE[0]
    index = torch.arange(num_tokens)
    allowed = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block, num_tokens)
    allowed |= tiles(block_mask.kv_num_blocks, block_mask.kv_indices, block, num_tokens) & (
        block_mask.mask_mod(0, 0, index[:, None], index[None, :])
    )
    groups = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ key.transpose(-1, -2) * scale
    weights = torch.where(allowed, torch.exp(scores - scores.amax(-1, keepdim=True)), 0.0)
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    return (probs @ value).to(query.dtype)


@pytest.mark.parametrize("num_tokens", [130, 300, 1000])
@pytest.mark.parametrize("groups", [2, 1], ids=["grouped-query-kernel", "repeated-groups"])
def test_padded_row_gradients_match_torch_backend(
    forest_sequences, monkeypatch, num_tokens, groups
):
    """Padding, block mask, repeated groups and slicing under autograd, with FlexAttention
    replaced by its dense semantics (FlexAttention has no CPU backward; the GPU tests run the real
    kernel)."""
    monkeypatch.setattr(flex_backend, "flex_attention", flex_semantics)
    forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cpu")
    query, key, value = cpu_qkv(num_tokens, seed=num_tokens, groups=groups, requires_grad=True)
    out = flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.3, compiled=False)
    expected = torch_backend.tree_attention(query, key, value, forest, softmax_scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


def test_repeats_groups():
    assert flex_backend.REPEAT_GROUPS_FROM == 4
    assert not flex_backend.repeats_groups(8, 8)  # no grouped queries
    assert not flex_backend.repeats_groups(16, 8)
    assert flex_backend.repeats_groups(32, 8)
    assert flex_backend.repeats_groups(64, 8)
    assert flex_backend.repeats_groups(8, 1)


@pytest.mark.parametrize("repeat_groups", [None, True, False])
def test_repeated_groups_are_what_the_kernel_gets(forest_sequences, monkeypatch, repeat_groups):
    """8 query heads over 2 key/value heads (repeated by default): the kernel gets 8 key and value
    heads, each query head its own group's, without enable_gqa; or 2 with enable_gqa. Outputs and
    gradients agree either way."""
    calls = []

    def recorded(query, key, value, **kwargs):
        calls.append((key.shape[1], value.shape[1], kwargs["enable_gqa"]))
        return flex_semantics(query, key, value, **kwargs)

    monkeypatch.setattr(flex_backend, "flex_attention", recorded)
    num_tokens = 256
    forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cpu")
    query, key, value = cpu_qkv(num_tokens, seed=3, heads=8, groups=2, requires_grad=True)

    def attend(repeat):
        out = flex_backend.tree_attention(
            query, key, value, forest, softmax_scale=0.3, compiled=False, repeat_groups=repeat
        )
        return (out, *torch.autograd.grad(out.square().sum(), (query, key, value)))

    results = attend(repeat_groups)
    repeated = repeat_groups in (None, True)
    assert calls == [(8, 8, False) if repeated else (2, 2, True)]
    expected = attend(not repeated)
    for result, other in zip(results, expected):
        torch.testing.assert_close(result, other, rtol=1e-5, atol=1e-6)


def test_dynamic_kernel_gets_block_views_of_the_rows(forest_sequences, monkeypatch):
    """The dynamic-shape kernel gets [T / 128, 128, 1, H, D] views of the rows (no copies), all
    but the block count marked static, and computes what the rows give (FlexAttention replaced by
    its dense semantics on CPU)."""
    monkeypatch.setattr(flex_backend, "flex_attention", flex_semantics)
    calls = []

    def kernel(query, key, value, **kwargs):
        calls.append((query, key, value, kwargs["kernel_options"]))
        return flex_backend._flex_attention_blocks(  # pylint: disable=protected-access
            query, key, value, **kwargs
        )

    # pylint: disable-next=protected-access
    monkeypatch.setitem(flex_backend._compiled_kernels, False, kernel)
    num_tokens = 3 * flex_backend.BLOCK_SIZE
    forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cpu")
    block_mask = flex_backend.tree_block_mask(forest)
    query, key, value = cpu_qkv(num_tokens, seed=5, requires_grad=True)
    out = flex_backend._flex_attention_compiled(  # pylint: disable=protected-access
        False, query, key, value, block_mask=block_mask, scale=0.3, kernel_options={}
    )
    ((*views, options),) = calls
    for view, row in zip(views, (query, key, value)):
        assert view.shape == (3, flex_backend.BLOCK_SIZE, *row.shape[1:])
        assert view.data_ptr() == row.data_ptr()
        assert view._dynamo_static_indices == {1, 3, 4}  # pylint: disable=protected-access
    assert options == {}  # the caller's options are not changed; IS_DIVISIBLE is added inside
    expected = flex_backend._flex_attention_rows(  # pylint: disable=protected-access
        query, key, value, block_mask=block_mask, scale=0.3, kernel_options={}
    )
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)


def test_repeated_heads_follow_the_grouped_query_convention():
    """Query head h reads group h // (heads // groups), as repeat_interleave and FlexAttention's
    enable_gqa have it."""
    x = torch.randn(5, 1, 2, 3)
    repeated = flex_backend._repeated_heads(x, 8)  # pylint: disable=protected-access
    assert torch.equal(repeated, x.repeat_interleave(4, dim=2))


def test_first_tokens_backward_pads_the_gradient_in_row_order():
    """The output slice of a padded row: same values and gradient as slicing, the gradient laid out
    as a contiguous [T_run, ...] tensor (FlexAttention's output order), zeros past T."""
    padded = torch.randn(12, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    out = flex_backend._FirstTokens.apply(padded, 9)  # pylint: disable=protected-access
    assert torch.equal(out, padded[:9]) and out.data_ptr() == padded.data_ptr()
    upstream = torch.randn(9, 1, 3, 4, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, padded, upstream)
    (sliced_grad,) = torch.autograd.grad(padded[:9], padded, upstream)
    assert torch.equal(grad, sliced_grad)
    assert grad.is_contiguous() and not grad[9:].any()


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
@pytest.mark.parametrize("depth, groups", [(1, 2), (3, 2), (3, 4)])
def test_flex_matches_torch_backend_on_cuda(forest_sequences, dtype, depth, groups):
    """Outputs and gradients of the compiled FlexAttention path against the torch backend
    (float32); 8 query heads over 2 key/value heads (repeated to the query heads before the
    kernel) or over 4 (FlexAttention's grouped-query kernel)."""
    sequences = forest_sequences(seed=depth, depth=depth, max_segment=300)
    layout = plan_shared_prefix(sequences, capacity=8192).rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    query, key, value = _random_qkv(layout.num_tokens, dtype, seed=depth, groups=groups)
    out = flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125)
    expected = torch_backend.tree_attention(
        *(t.float() for t in (query, key, value)), forest, softmax_scale=0.125
    )
    # Seeded: drawn from the global generator, the weights depended on the tests run before (the
    # test was order dependent; measured on an H200, the flex gradients stay within 0.85 of the
    # tolerance for 8 seeds, where the torch backend computing in bf16 goes 1.8x past it).
    generator = torch.Generator(device="cuda").manual_seed(depth)
    weights = torch.randn(expected.shape, generator=generator, device="cuda")
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
    """Lengths that are not a bucket share the one dynamic-shape kernel; a bucket compiles once."""
    from torch._dynamo.utils import counters

    def unique_graphs_after(num_tokens):
        forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cuda")
        query, key, value = _random_qkv(num_tokens, torch.bfloat16, seed=num_tokens)
        flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125).sum().backward()
        return counters["stats"]["unique_graphs"]

    dynamic, bucket = (4097, 4500, 4608, 4736, 6000), 5120
    assert not any(flex_backend.run_length(n)[1] for n in dynamic)
    assert flex_backend.run_length(bucket) == (bucket, True)
    # The first length compiles the dynamic kernel (unless an earlier test did); others reuse it.
    graphs = unique_graphs_after(dynamic[0])
    assert [unique_graphs_after(n) for n in dynamic[1:]] == [graphs] * (len(dynamic) - 1)
    graphs_with_bucket = unique_graphs_after(bucket)
    assert graphs_with_bucket <= graphs + 1
    assert unique_graphs_after(bucket) == graphs_with_bucket


def test_auto_backend_uses_flex_for_cuda_rows_of_a_tile_or_more():
    from megatron.shared_prefix.attention.dot_product_attention import use_flex_attention

    tile = flex_backend.BLOCK_SIZE
    assert use_flex_attention("auto", True, tile)
    assert not use_flex_attention("auto", True, tile - 1)
    assert not use_flex_attention("auto", True, 1)
    assert not use_flex_attention("auto", False, 10 * tile)
    assert use_flex_attention("flex", True, 1) and not use_flex_attention("torch", True, 10 * tile)


def test_precompile_lengths():
    """ "buckets": every bucket up to the capacity's run length; both modes: one dynamic length."""
    static, dynamic = flex_backend.precompile_lengths(20000, "buckets")
    block = flex_backend.BLOCK_SIZE
    assert static == tuple(
        n for n in range(block, 20096 + 1, block) if flex_backend.bucket_length(n) == n
    )
    # Rows of up to 20000 tokens run at up to 20096 tokens: 16384 is the last bucket they reach.
    assert static[:3] == (128, 256, 384) and static[-1] == 16384
    assert not flex_backend.run_length(dynamic)[1]
    assert flex_backend.precompile_lengths(20000, "dynamic") == ((), dynamic)
    with pytest.raises(ValueError, match="precompile mode"):
        flex_backend.precompile_lengths(20000, "off")


# The head shape, scale, dtype and device the CPU precompile tests compile for (cpu_qkv's).
CPU_SIGNATURE = dict(
    num_heads=4, num_groups=2, head_dim=8, softmax_scale=0.3, dtype=torch.float32, device="cpu"
)


@pytest.fixture
def recorded_kernels(monkeypatch):
    """Replaces the compiled kernels by a recorder of (static, row length, autograd on) that
    returns a differentiable stand-in, and restores the precompiled lengths afterwards."""
    calls = []

    def kernel(static, query, key, value, **_):
        calls.append((static, query.shape[0], torch.is_grad_enabled()))
        return (query * 1.0).reshape(query.shape[0], 1, -1)

    monkeypatch.setattr(flex_backend, "_flex_attention_compiled", kernel)
    monkeypatch.setattr(flex_backend, "_precompiled_static_lengths", None)
    return calls


def test_precompile_runs_every_kernel_then_only_those(recorded_kernels, forest_sequences):
    compiled = flex_backend.precompile(
        3000,
        mode="buckets",
        **CPU_SIGNATURE,
        no_grad_forward=True,
    )
    static, dynamic = flex_backend.precompile_lengths(3000, "buckets")
    assert static[-3:] == (2048, 2560, 3072)
    assert compiled == static + (dynamic,)
    expected = [(True, n, grad) for n in static for grad in (True, False)]
    assert recorded_kernels == expected + [(False, dynamic, True), (False, dynamic, False)]
    # After it: lengths it compiled run their static kernel (2560; 2500 runs at 2560 too), every
    # other length the dynamic one: 2304 is no bucket, 20480 is one beyond the capacity.
    recorded_kernels.clear()
    for num_tokens in (2560, 2500, 2304, 20480):
        forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cpu")
        flex_backend.tree_attention(*cpu_qkv(num_tokens, seed=0), forest, softmax_scale=0.3)
    assert recorded_kernels == [
        (True, 2560, True),
        (True, 2560, True),
        (False, 2304, True),
        (False, 20480, True),
    ]


def test_precompile_dynamic_leaves_every_row_to_the_dynamic_kernel(
    recorded_kernels, forest_sequences
):
    flex_backend.precompile(
        4096,
        mode="dynamic",
        **CPU_SIGNATURE,
    )
    assert recorded_kernels == [(False, flex_backend.DYNAMIC_WARMUP_TOKENS, True)]
    recorded_kernels.clear()
    forest = ForestTensors.from_layout(row_layout(forest_sequences, 2048), "cpu")
    flex_backend.tree_attention(*cpu_qkv(2048, seed=0), forest, softmax_scale=0.3)
    assert recorded_kernels == [(False, 2048, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompiled_kernels_leave_nothing_to_compile(forest_sequences, monkeypatch):
    """After precompile, rows of any length up to the capacity (and beyond it) compile nothing."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex_backend, "_precompiled_static_lengths", None)
    flex_backend.precompile(
        2048,
        mode="buckets",
        num_heads=4,
        num_groups=2,
        head_dim=64,
        softmax_scale=0.125,
        dtype=torch.bfloat16,
        device="cuda",
    )
    graphs = counters["stats"]["unique_graphs"]
    for num_tokens in (130, 640, 1000, 1280, 2048, 3000):
        forest = ForestTensors.from_layout(row_layout(forest_sequences, num_tokens), "cuda")
        query, key, value = (
            torch.randn(num_tokens, 1, h, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for h in (4, 2, 2)
        )
        flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
