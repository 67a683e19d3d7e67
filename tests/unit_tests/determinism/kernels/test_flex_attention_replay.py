"""Bitwise replay of tree attention through FlexAttention (attention/flex_backend.py).

On GPU the compiled FlexAttention path is an inductor-generated Triton kernel whose backward
reduces dK/dV over query blocks, the classic place for run-to-run differences. The GPU test replays
it forward and backward in bf16, three times against concurrent stream work, rebuilding the forest
every run so that the block mask (cached on the forest) is replayed too. On CPU, FlexAttention has
no backward, its eager forward needs Dynamo (which tests/conftest.py turns off for speed), and
training uses torch_backend instead, so the CPU test replays the part of this file that runs on
any device: the block-mask construction, for the row's own length and padded to a longer one. On GPU
four rows are replayed: one padded to a multiple of 128 tokens and one that is a multiple
already (both on the dynamic-shape kernel, which runs on [T / 128, 128, 1, H, D] views of the rows,
the block count its dynamic size), and one whose length is a bucket (the static kernel),
the last also with a value that is a strided view into a wider tensor, as megatron-core's is.
Which kernel runs, and the forward's kernel options (``flex_backend.KERNEL_OPTIONS``: TMA loads),
are speed choices only: GPU tests check that they give bitwise the same results.
"""

import contextlib

import pytest
import torch

from megatron.shared_prefix.attention import flex_backend
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

from ..replay import assert_bitwise_replay


@contextlib.contextmanager
def _dynamo_enabled():
    """Compile for real even where TORCH_COMPILE_DISABLE=1 (tests/conftest.py sets it for speed).

    Dynamo remembers functions it skipped while disabled, so its caches are reset on the way in and
    again on the way out, leaving later tests as they would have been.
    """
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(disable=False):
            yield
    finally:
        torch._dynamo.reset()


def _compiled_forward_backward(num_tokens, seed):
    """``run(static, block_mask) -> (out, dq, dk, dv)``: the compiled kernel (static or
    dynamic-shape) called directly, on seeded bf16 queries [T, 1, 8, 128] over keys and values
    [T, 1, 2, 128] and a seeded output gradient, the same tensors on every call."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    query, key, value = (
        torch.randn(num_tokens, 1, heads, 128, generator=generator, device="cuda")
        .to(torch.bfloat16)
        .requires_grad_()
        for heads in (8, 2, 2)
    )
    upstream = torch.randn(num_tokens, 1, 8 * 128, generator=generator, device="cuda").bfloat16()

    def run(static, block_mask):
        # pylint: disable-next=protected-access
        out = flex_backend._flex_attention_compiled(
            static,
            query,
            key,
            value,
            block_mask=block_mask,
            scale=0.088,
            kernel_options=flex_backend.KERNEL_OPTIONS,
        )
        return (out, *torch.autograd.grad(out, (query, key, value), upstream))

    return run


@pytest.mark.parametrize("padding", [0, 37])
def test_flex_block_mask_replay_cpu(forest_sequences, padding):
    sequences = forest_sequences(seed=3, depth=3, max_segment=40)

    def make_inputs():
        return ForestTensors.from_layout(
            plan_shared_prefix(sequences, capacity=8192).rows[0], "cpu"
        )

    def fn(forest):
        mask = flex_backend.tree_block_mask(
            forest, block_size=16, num_tokens=forest.num_tokens + padding
        )
        return (
            mask.kv_num_blocks,
            mask.kv_indices,
            mask.full_kv_num_blocks,
            mask.full_kv_indices,
            mask.q_num_blocks,
            mask.q_indices,
            mask.full_q_num_blocks,
            mask.full_q_indices,
        )

    assert_bitwise_replay(fn, make_inputs)
    # A second mask of the same forest is built around the tables cached by the first (the tables
    # a DataLoader worker prepares, flex_backend.tree_block_tables): the same tensors.
    forest = make_inputs()
    first, second = fn(forest), fn(forest)
    assert all(a is b for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_block_mask_keeps_the_bits_gpu(forest_sequences):
    """The block mask's query-side lists, which the backward walks for dK and dV, are built on the
    host (``tree_block_mask``); FlexAttention's own ``BlockMask.from_kv_blocks`` derives them on
    the device. The compiled kernel's output and gradients must be bitwise the same with either."""
    from torch.nn.attention.flex_attention import (  # pylint: disable=import-outside-toplevel
        BlockMask,
    )

    sequences = forest_sequences(seed=9, depth=3, max_segment=300)
    layout = plan_shared_prefix(sequences, capacity=8192, pad_multiple=128).rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    host_mask = flex_backend.tree_block_mask(forest)
    device_mask = BlockMask.from_kv_blocks(
        host_mask.kv_num_blocks,
        host_mask.kv_indices,
        host_mask.full_kv_num_blocks,
        host_mask.full_kv_indices,
        BLOCK_SIZE=flex_backend.BLOCK_SIZE,
        mask_mod=host_mask.mask_mod,
        seq_lengths=host_mask.seq_lengths,
    )
    run, static = flex_backend.run_length(layout.num_tokens)
    assert run == layout.num_tokens  # no padding: the kernels see the row as it is
    forward_backward = _compiled_forward_backward(layout.num_tokens, seed=9)

    with _dynamo_enabled():
        host = forward_backward(static, host_mask)
        device = forward_backward(static, device_mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), host, device):
        assert torch.equal(a, b), f"{name} differs between the host-built and the stock block mask"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "num_tokens, expected_run, fused_value, groups",
    [
        (4500, (4608, False), False, 2),
        (4608, (4608, False), False, 2),
        (5120, (5120, True), False, 2),
        (5120, (5120, True), True, 2),
        (4608, (4608, False), False, 4),
        (5120, (5120, True), False, 4),
    ],
    ids=[
        "padded-dynamic-kernel",
        "dynamic-kernel",
        "static-kernel",
        "static-kernel-fused-value",
        "dynamic-kernel-grouped-query-kernel",
        "static-kernel-grouped-query-kernel",
    ],
)
def test_flex_tree_attention_replay_gpu(
    forest_sequences, num_tokens, expected_run, fused_value, groups
):
    """``fused_value``: the value is a strided view into a larger projection output, as
    megatron-core's is (tree_attention copies it contiguous before the kernel). 8 query heads
    over ``groups`` key/value heads: over 2 the keys and values are repeated to the query heads
    before the kernel (``flex_backend.repeats_groups``), over 4 FlexAttention's grouped-query
    kernel runs."""
    # Long segments, so rows span many 128-token blocks and the backward reduces across them.
    sequences = forest_sequences(seed=3, depth=3, max_segment=300)
    assert flex_backend.run_length(num_tokens) == expected_run
    assert flex_backend.repeats_groups(8, groups) == (groups == 2)

    def make_inputs():
        layout = plan_shared_prefix(sequences, capacity=num_tokens, pad_multiple=num_tokens).rows[0]
        # A fused value source holds 3 heads' width per group, the value the last 64.
        qkv = (
            torch.randn(layout.num_tokens, 1, heads, width, device="cuda", dtype=torch.bfloat16)
            for heads, width in ((8, 64), (groups, 64), (groups, 192 if fused_value else 64))
        )
        return (*(t.requires_grad_() for t in qkv), ForestTensors.from_layout(layout, "cuda"))

    def fn(query, key, value, forest):
        value = value[..., -64:]
        assert value.is_contiguous() != fused_value
        return flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.125)

    with _dynamo_enabled():
        assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_options_keep_the_bits_gpu(forest_sequences, monkeypatch, dtype):
    sequences = forest_sequences(seed=5, depth=3, max_segment=300)
    layout = plan_shared_prefix(sequences, capacity=8192).rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(5)
    query, key, value = (
        torch.randn(
            layout.num_tokens, 1, heads, 128, generator=generator, device="cuda", dtype=dtype
        ).requires_grad_()
        for heads in (8, 2, 2)
    )
    upstream = torch.randn(
        layout.num_tokens, 1, 8 * 128, generator=generator, device="cuda", dtype=dtype
    )

    def forward_backward():
        out = flex_backend.tree_attention(query, key, value, forest, softmax_scale=0.088)
        return (out, *torch.autograd.grad(out, (query, key, value), upstream))

    assert flex_backend.KERNEL_OPTIONS, "nothing to compare: the default kernel runs already"
    with _dynamo_enabled():
        tuned = forward_backward()
        monkeypatch.setattr(flex_backend, "KERNEL_OPTIONS", {})
        default = forward_backward()
    for name, a, b in zip(("out", "dq", "dk", "dv"), tuned, default):
        assert torch.equal(a, b), f"{name} differs between the tuned and the default kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_static_and_dynamic_kernels_agree_bitwise_gpu(forest_sequences):
    """At a bucket length both compiled kernels may run a row; they must give the same bits (the
    dynamic one compiled on the block count, as every row that is not a bucket runs it)."""
    num_tokens = 5120
    assert flex_backend.run_length(num_tokens) == (num_tokens, True)
    sequences = forest_sequences(seed=7, depth=3, max_segment=400)
    layout = plan_shared_prefix(sequences, capacity=num_tokens, pad_multiple=num_tokens).rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    block_mask = flex_backend.tree_block_mask(forest)
    forward_backward = _compiled_forward_backward(num_tokens, seed=7)

    with _dynamo_enabled():
        static = forward_backward(True, block_mask)
        dynamic = forward_backward(False, block_mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), static, dynamic):
        assert torch.equal(a, b), f"{name} differs between the static and the dynamic kernel"
