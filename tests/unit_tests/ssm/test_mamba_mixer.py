"""TreeMambaMixer's start-up warm-up (``warm_up``, ``scan_warmup_lengths``): which rows it runs, that
it leaves no trace in the parameters, and on CUDA that rows of new lengths and shapes then compile no
Triton kernel. The model-level ``precompile_tree_mamba`` is tested with the model
(tests/unit_tests/models/hybrid/test_mamba_forest.py)."""

import numpy as np
import pytest
import torch
from triton_interpreter import triton_compiles

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.ssm.mamba_mixer import (
    TreeMambaMixer,
    scan_warmup_lengths,
    warmup_forest,
)
from megatron.shared_prefix.tensors import ForestTensors, forest_scope


def twos(value: int) -> int:
    """Factors of 2 in ``value``, up to 4: what decides whether ``value`` times a width is a
    multiple of 16, the class Triton specializes an integer kernel argument on."""
    return min(4, (value & -value).bit_length() - 1)


def test_warmup_lengths_cover_every_class_of_length_and_chunk_count():
    lengths = scan_warmup_lengths(128, 32768)
    chunk_counts = {-(-n // 128) for n in lengths}
    assert chunk_counts == {1, 2, 3, 4, 8, 16, 32, 64, 128, 256}
    for chunks in chunk_counts:
        of_count = [n for n in lengths if -(-n // 128) == chunks]
        assert {twos(n) for n in of_count} == set(range(5))
        assert max(of_count) == 128 * chunks and len(of_count) == 5
    assert len(set(lengths)) == len(lengths) == 50
    assert scan_warmup_lengths(128, 300) == (
        (128, 127, 126, 124, 120) + (256, 255, 254, 252, 248) + (300, 299, 298, 296, 288)
    )
    assert scan_warmup_lengths(256, 4) == ()


@pytest.mark.parametrize("multiple", [2, 3, 16, 48, 128])
def test_warmup_lengths_of_a_pad_multiple_cover_the_classes_its_rows_can_have(multiple):
    """Rows planned with ``pad_multiple`` are multiples of it: the warm-up runs, per chunk count,
    the longest such length of every class of factors of 2 that such a length can have (one when
    the multiple has 4 or more: 10 rows instead of 50 for 32768 tokens); for a power of two, a
    subset of what it runs for rows of any length."""
    chunk_size, capacity = 128, 4096
    lengths = scan_warmup_lengths(chunk_size, capacity, multiple)
    assert lengths and all(n % multiple == 0 for n in lengths)
    if multiple & (multiple - 1) == 0:  # a power of two
        assert set(lengths) <= set(scan_warmup_lengths(chunk_size, capacity))
    for chunks in {-(-n // chunk_size) for n in scan_warmup_lengths(chunk_size, capacity)}:
        rows = range((chunks - 1) * chunk_size + 1, min(chunks * chunk_size, capacity) + 1)
        possible = {twos(n) for n in rows if n % multiple == 0 and n > 4}
        of_count = [n for n in lengths if -(-n // chunk_size) == chunks]
        assert {twos(n) for n in of_count} == possible and len(of_count) == len(possible)
        assert not of_count or max(of_count) == max(n for n in rows if n % multiple == 0)
    assert len(scan_warmup_lengths(128, 32768, 16)) == 10
    assert scan_warmup_lengths(128, 32768, 16) == tuple(
        128 * c for c in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
    )
    with pytest.raises(ValueError, match="pad_multiple"):
        scan_warmup_lengths(chunk_size, capacity, 0)


@pytest.mark.parametrize("num_tokens", [5, 127, 2048])
def test_warmup_forest_has_a_chain_of_internal_segments(num_tokens):
    """Root -> internal child -> two leaves, and a leaf under the root: the forked-state kernels
    and the parent chain all run on it."""
    from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan

    forest = warmup_forest(num_tokens, "cpu")
    assert forest.num_tokens == num_tokens
    plan = TreeScanPlan.of(forest)
    assert len(plan.internal) == 2 and (plan.segment_chain_slot >= 0).any()


@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rmsnorm", "gate"])
def test_warm_up_runs_the_forest_path_between_the_projections(megatron_world, rmsnorm):
    """The gated norm runs in the warm-up only where the forward applies it; no parameter
    gradient is written."""
    mixer = build_mixer(chunk_size=16, hidden_size=32, heads=4, state=8, dtype=torch.float32)
    mixer.rmsnorm = rmsnorm
    calls = []
    handle = mixer.norm.register_forward_hook(lambda *_: calls.append(1))
    mixer.warm_up(64, dtype=torch.float32, device="cpu")
    handle.remove()
    assert len(calls) == (1 if rmsnorm else 0)
    assert all(p.grad is None for p in mixer.parameters())


def build_mixer(*, chunk_size, hidden_size, heads, state, dtype, device="cpu"):
    """A seeded TreeMambaMixer on ``device``: ``heads`` heads in 2 groups over an inner width of
    twice ``hidden_size``."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from tiny import seed_initialization

    seed_initialization(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        mamba_state_dim=state,
        mamba_head_dim=2 * hidden_size // heads,
        mamba_num_groups=2,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
    )
    return TreeMambaMixer(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=hidden_size,
        chunk_size=chunk_size,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    ).to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_of_new_lengths_compile_nothing_after_warm_up(megatron_world):
    """After the warm-up at ``scan_warmup_lengths``, forest rows of other lengths, chunk counts and
    segment, block and split counts (one parent, many, a chain) run only kernel variants already
    compiled: mamba_ssm's are specialized on the classes of the length and chunk count, the
    forked-state kernels on none of the forest's counts. First for rows padded to a multiple of 16
    after the warm-up of that multiple (what ``--shared-prefix-precompile`` runs), then for rows of
    any length after the rest of the warm-up."""
    chunk_size, capacity = 128, 4096
    mixer = build_mixer(
        chunk_size=chunk_size,
        hidden_size=256,
        heads=8,
        state=64,
        dtype=torch.bfloat16,
        device="cuda",
    )
    rng = np.random.default_rng(0)
    rows = []
    for prompt, completions in ((300, [5]), (1000, [17] * 3), (64, [900, 7, 1]), (2500, [90] * 16)):
        shared = rng.integers(1, 50, prompt).tolist()
        rows.append([shared + rng.integers(1, 50, n).tolist() for n in completions])
    rows.append([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]] + [rng.integers(1, 50, 4000).tolist()])
    rows += [[rng.integers(1, 50, n).tolist()] for n in (650, 1812, 3068)]  # 2, 4 and 8 mod 16
    warmed = set()
    for multiple in (16, 1):
        for num_tokens in scan_warmup_lengths(chunk_size, capacity, multiple):
            if num_tokens not in warmed:
                mixer.warm_up(num_tokens, dtype=torch.bfloat16, device="cuda")
                warmed.add(num_tokens)
        with triton_compiles() as compiled:
            for sequences in rows:
                layout = plan_shared_prefix(
                    sequences, capacity=capacity, pad_multiple=multiple
                ).rows[0]
                forest = ForestTensors.from_layout(layout, "cuda")
                hidden = torch.randn(forest.num_tokens, 1, 256, device="cuda", dtype=torch.bfloat16)
                hidden.requires_grad_()
                with forest_scope(forest):
                    out = mixer(hidden)[0]
                out.backward(torch.randn_like(out))
        assert compiled == [], f"rows padded to a multiple of {multiple}"


@pytest.mark.parametrize("rmsnorm", [True, False], ids=["norm-gate", "scan-gate"])
def test_forest_path_keeps_the_gate_as_a_view_of_the_projection(megatron_world, rmsnorm):
    """z reaches its gate (the norm, or the scan and the forked-state correction) as a view of the
    input projection, as in megatron-core's unfused path: nothing saved for backward holds a copy
    of z's values, and the norm's gate shares the projection's storage."""
    mixer = build_mixer(chunk_size=16, hidden_size=32, heads=4, state=8, dtype=torch.float32)
    mixer.rmsnorm = rmsnorm
    forest = warmup_forest(40, "cpu")
    width = 2 * mixer.d_inner + 2 * mixer.ngroups * mixer.d_state + mixer.nheads
    zxBCdt = torch.randn(40, 1, width, requires_grad=True)
    z_values = zxBCdt.detach()[..., : mixer.d_inner].reshape(-1)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y, gate = mixer._tree_ssm(zxBCdt, forest)  # pylint: disable=protected-access
    projection = zxBCdt.untyped_storage().data_ptr()
    if rmsnorm:
        assert gate.shape == (40, 1, mixer.d_inner)
        assert gate.untyped_storage().data_ptr() == projection
    else:
        assert gate is None
    copies = [
        t
        for t in saved
        if t.numel() == z_values.numel()
        and t.untyped_storage().data_ptr() != projection
        and torch.equal(t.detach().reshape(-1), z_values)
    ]
    assert not copies
    assert y.shape == (40, 1, mixer.d_inner)
