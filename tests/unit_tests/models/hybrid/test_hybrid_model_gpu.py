"""bf16 forest forwards on CUDA against two dense runs that differ only in how sequences are batched."""

import numpy as np
import pytest
import torch
from dense_reference import dense_edge_losses, relative_error
from tiny import GPU_BF16_MODEL, tiny_config

from megatron.shared_prefix.planning import plan_shared_prefix


def _causal_conv1d_available():
    try:
        import causal_conv1d  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except ImportError:
        return False
    return True


def padded_batch_edge_losses(model, sequences, layout):
    """[E] dense losses from one right-padded batch of the row's sequences (another packing)."""
    ids = [int(s) for s in layout.sequence_ids]
    longest = max(len(sequences[i]) for i in ids)
    tokens = torch.zeros(len(ids), longest, dtype=torch.long)
    for row, index in enumerate(ids):
        tokens[row, : len(sequences[index])] = torch.as_tensor(np.asarray(sequences[index]))
    tokens = tokens.cuda()
    positions = torch.arange(longest, device="cuda").expand_as(tokens)
    losses = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    row_of = {index: row for row, index in enumerate(ids)}
    return torch.stack(
        [
            losses[row_of[int(s)], int(j) - 1]
            for s, j in zip(layout.edge_sequence, layout.edge_position)
        ]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["*-*-", "M*-M"])
def test_bf16_forest_within_dense_spread(build_model, forest_sequences, pattern):
    sequences = forest_sequences(seed=1, depth=3, max_segment=120)
    plan = plan_shared_prefix(sequences, capacity=4096, pad_multiple=128)
    # The dense runs take megatron's fused Mamba path only where causal-conv1d (which it needs) imports.
    model = build_model(
        pattern, seed=0, use_mamba_mem_eff_path=_causal_conv1d_available(), **GPU_BF16_MODEL
    ).cuda()
    errors, spreads = [], []
    with torch.no_grad():
        for layout in plan.rows:
            tree = model(None, None, None, shared_prefix_layout=layout).float()
            alone = dense_edge_losses(model, sequences, layout).float()
            batched = padded_batch_edge_losses(model, sequences, layout).float()
            errors.append(relative_error(tree, alone))
            spreads.append(relative_error(batched, alone))
    print(f"{pattern}: tree vs dense {max(errors):.2e}, dense vs dense {max(spreads):.2e}")
    assert max(errors) <= 2 * max(max(spreads), 2**-8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forest_tables_reach_the_gpu_without_synchronizing(forest_sequences):
    """Every table a forest forward builds on first use is copied without stalling the host (a
    pageable copy, ``.cpu()`` or ``nonzero`` would drain the GPU queue inside the forward), and the
    copies hold the host values."""
    from types import SimpleNamespace

    from megatron.shared_prefix.models.hybrid.hybrid_model import _mtp_depths
    from megatron.shared_prefix.moe.statistics import ForestRoutingTables
    from megatron.shared_prefix.ssm.tree_conv import _fixup_windows
    from megatron.shared_prefix.attention.flex_backend import tree_block_mask
    from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan
    from megatron.shared_prefix.ssm.triton_inherited_state import ForkedStates
    from megatron.shared_prefix.tensors import ForestTensors

    # What _mtp_depths reads of a model: its MTP depth count and parallel sizes.
    mtp_model = SimpleNamespace(config=tiny_config(num_layers=2, mtp_num_layers=2))

    layout = plan_shared_prefix(forest_sequences(seed=14, depth=4), capacity=512).rows[0]
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # pylint: disable=pointless-statement  # queued work a synchronization would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        forest = ForestTensors.from_layout(layout, "cuda")
        plan = TreeScanPlan.of(forest)
        forked = ForkedStates.of(forest, plan)
        block_mask = tree_block_mask(forest, block_size=16)
        fixup = _fixup_windows(forest, 4)
        ForestRoutingTables.build(forest)
        predecessors = forest.root_path_predecessors(3)
        depths = _mtp_depths(mtp_model, forest)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = ForestTensors.from_layout(layout, "cpu")
    assert torch.equal(forest.token_subtree_end.cpu(), cpu.token_subtree_end)
    assert torch.equal(predecessors.cpu(), cpu.root_path_predecessors(3))
    cpu_plan = TreeScanPlan.of(cpu)
    assert torch.equal(plan.all_child_tokens.cpu(), cpu_plan.all_child_tokens)
    for ours, theirs in zip(plan.child_tokens, cpu_plan.child_tokens, strict=True):
        assert torch.equal(ours.cpu(), theirs)
    cpu_forked = ForkedStates.of(cpu, cpu_plan)
    for blocks, cpu_blocks in ((forked.own, cpu_forked.own), (forked.children, cpu_forked.children)):
        for name in ("tokens", "blocks", "splits", "slot_splits"):
            assert torch.equal(getattr(blocks, name).cpu(), getattr(cpu_blocks, name)), name
    cpu_mask = tree_block_mask(cpu, block_size=16)
    for ours, theirs in zip(block_mask.as_tuple(), cpu_mask.as_tuple()):
        if isinstance(ours, torch.Tensor):
            assert torch.equal(ours.cpu(), theirs)
    cpu_fixup = _fixup_windows(cpu, 4)
    names = ("tokens", "windows", "skip", "tap_tokens", "targets", "target_starts")
    for name in (*names, "target_entries"):
        assert torch.equal(getattr(fixup, name).cpu(), getattr(cpu_fixup, name)), name
    assert fixup.max_target_entries == cpu_fixup.max_target_entries
    for depth, cpu_depth in zip(depths, _mtp_depths(mtp_model, cpu), strict=True):
        assert torch.equal(depth.input_index.cpu(), cpu_depth.input_index)
        assert torch.equal(depth.main_edge_slot.cpu(), cpu_depth.main_edge_slot)


def _every_layer_kind(build_model, forest_sequences):
    """A bf16 model with every layer kind (Mamba, attention, MLP, MoE) on the GPU, and a forest
    row of a few hundred tokens for it."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the forest MoE layer's grouped GEMM needs compute capability 8.0")
    model = build_model(
        "M*-ME",
        num_moe_experts=4,
        moe_router_topk=2,
        add_bias_linear=False,
        use_mamba_mem_eff_path=False,
        **GPU_BF16_MODEL,
    ).cuda()
    layout = plan_shared_prefix(
        forest_sequences(seed=3, depth=3, max_segment=150), capacity=4096, pad_multiple=128
    ).rows[0]
    return model, layout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forest_step_never_waits_for_the_gpu(build_model, forest_sequences):
    """A whole forest training step of a model with every layer kind (Mamba, attention, MLP, MoE;
    bf16), forward and backward, with synchronizing calls turned into errors. Each forward builds
    its forest's tables anew from the layout, so every table's transfer is inside the checked
    step; a step with a single synchronization lets the GPU run dry while the host catches up."""
    model, layout = _every_layer_kind(build_model, forest_sequences)

    def step():
        model(None, None, None, shared_prefix_layout=layout).float().sum().backward()

    step()  # compiles
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # pylint: disable=pointless-statement  # queued work a synchronization would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepared_forest_step_on_the_gpu(build_model, forest_sequences):
    """A row prepared on the CPU with the model's forest tables (as DataLoader workers hand rows
    over): moved to the GPU without a synchronization, no table left to build in the forward (the
    FlexAttention BlockMask it caches is a wrapper around the moved block tables), and losses and
    gradients bitwise those of the row whose tables the forward builds."""
    from torch.nn.attention.flex_attention import BlockMask

    from megatron.shared_prefix.models.hybrid.hybrid_model import forest_tables
    from megatron.shared_prefix.tensors import ForestTensors, prepare_forest

    model, layout = _every_layer_kind(build_model, forest_sequences)
    prepared = prepare_forest(layout, forest_tables(model))
    built = set(prepared._derived)

    def step(row):
        model.zero_grad(set_to_none=True)
        losses = model(None, None, None, shared_prefix_layout=row)
        losses.float().sum().backward()
        return losses.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = step(layout)  # compiles
    moved = []
    original_to = ForestTensors.to

    def recording_to(forest, device):
        moved.append(original_to(forest, device))
        return moved[-1]

    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # pylint: disable=pointless-statement  # queued work a synchronization would wait for
    ForestTensors.to = recording_to
    torch.cuda.set_sync_debug_mode("error")
    try:
        from_workers = step(prepared)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        ForestTensors.to = original_to
    assert torch.equal(from_workers[0], plain[0])
    assert len(from_workers[1]) == len(plain[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(from_workers[1], plain[1]))
    (forest,) = moved
    assert forest.device.type == "cuda" and built <= set(forest._derived)
    for key in set(forest._derived) - built:
        block_mask = forest._derived[key]
        assert key[0] == "flex_block_mask" and isinstance(block_mask, BlockMask), key
        tables = forest._derived[("flex_block_tables", *key[1:])]
        wrapped = [t for t in block_mask.as_tuple() if isinstance(t, torch.Tensor)]
        assert len(wrapped) == len(tables) - 1  # the subtree ends are the mask function's
        assert all(a is b for a, b in zip(wrapped, tables[1:])), key
