"""A forest prepared on the host (``prepare_forest`` with the model's ``forest_tables``), as
DataLoader workers build it, against the forest the forward builds itself: same losses and
gradients bit for bit, and nothing left to build in the forward."""

import pickle

import numpy as np
import pytest
import torch

from megatron.shared_prefix import plan_shared_prefix
from megatron.shared_prefix.models.hybrid.hybrid_model import forest_tables
from megatron.shared_prefix.tensors import ForestTensors, prepare_forest


def _losses_and_grads(model, row):
    model.zero_grad(set_to_none=True)
    losses = model(None, None, None, shared_prefix_layout=row)
    losses.sum().backward()
    return losses.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("pattern,chunk", [("M*-ME", 0), ("M*M", 3)])
def test_prepared_forest_runs_as_the_plain_row(build_model, forest_sequences, pattern, chunk):
    model = build_model(
        pattern,
        num_moe_experts=4 if "E" in pattern else None,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    model.shared_prefix_output_chunk_tokens = chunk
    layout = plan_shared_prefix(forest_sequences(seed=3, depth=3), capacity=512).rows[0]
    tables = forest_tables(model)
    assert len(tables) == len(set(tables))
    prepared = pickle.loads(pickle.dumps(prepare_forest(layout, tables)))  # as from a worker
    built = set(prepared._derived)

    seen = []
    original_to = ForestTensors.to

    def recording_to(forest, device):
        moved = original_to(forest, device)
        seen.append(moved)
        return moved

    ForestTensors.to = recording_to
    try:
        prepared_run = _losses_and_grads(model, prepared)
    finally:
        ForestTensors.to = original_to
    plain_run = _losses_and_grads(model, layout)

    assert torch.equal(prepared_run[0], plain_run[0])
    assert len(prepared_run[1]) == len(plain_run[1]) > 0
    for prepared_grad, plain_grad in zip(prepared_run[1], plain_run[1]):
        assert torch.equal(prepared_grad, plain_grad)
    # The forward built nothing the preparation had not built.
    (forest,) = seen
    assert set(forest._derived) == built


def test_to_moves_every_table_and_keeps_sharing(megatron_world, forest_sequences):
    from megatron.shared_prefix.moe.statistics import forest_routing_tables
    from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan, prepare_tree_scan
    from megatron.shared_prefix.tensors import ForestTable

    layout = plan_shared_prefix(forest_sequences(seed=4, depth=3), capacity=512).rows[0]
    tables = [ForestTable(prepare_tree_scan), ForestTable(forest_routing_tables)]
    host = prepare_forest(layout, tables)
    moved = host.to("meta")
    assert moved is not host and moved.layout is host.layout
    assert moved._derived is not host._derived and set(moved._derived) == set(host._derived)
    assert moved.input_ids.device.type == "meta" and moved.input_ids.shape == host.input_ids.shape
    plan, host_plan = TreeScanPlan.of(moved), TreeScanPlan.of(host)
    assert plan.seq_idx.device.type == "meta" and plan.seq_idx.dtype == host_plan.seq_idx.dtype
    assert plan.internal == host_plan.internal
    assert plan.host_child_tokens is host_plan.host_child_tokens
    routing = forest_routing_tables(moved)
    assert routing.multiplicity is moved.token_multiplicity  # shared before, shared after
    assert routing.num_dense_tokens == forest_routing_tables(host).num_dense_tokens
    assert host.to("cpu") is host


def test_to_refuses_what_it_cannot_move(megatron_world, forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=1, depth=2), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    forest.derive("opaque", lambda: object())
    with pytest.raises(TypeError, match="object, which ForestTensors.to cannot move"):
        forest.to("meta")
    on_meta = ForestTensors.from_layout(layout, "cpu").to("meta")
    with pytest.raises(ValueError, match="built on the CPU"):
        on_meta.to("cpu")


def test_prepared_values_equal_the_host_tables(megatron_world, forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=6, depth=3), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    assert np.array_equal(forest.token_subtree_end.numpy(), forest.host_subtree_end())


def test_forest_tables_follow_the_device_and_the_modules(build_model):
    from megatron.shared_prefix.attention.dot_product_attention import prepare_tree_attention
    from megatron.shared_prefix.moe.statistics import forest_routing_tables
    from megatron.shared_prefix.ssm.tree_conv import prepare_tree_conv
    from megatron.shared_prefix.ssm.tree_scan import prepare_tree_scan
    from megatron.shared_prefix.tensors import ForestTable

    model = build_model("M*E", num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    on_gpu = forest_tables(model, torch.device("cuda"))
    assert on_gpu == (
        ForestTable(ForestTensors.local_tokens, (1, 0, 1, 0)),
        ForestTable(ForestTensors.edge_projection, (1, 0, 1, 0)),
        ForestTable(prepare_tree_scan),
        ForestTable(prepare_tree_conv, (model.decoder.layers[0].mixer.d_conv,)),
        ForestTable(prepare_tree_attention, ("auto", True)),
        ForestTable(forest_routing_tables),
    )
    assert forest_tables(model) == on_gpu[:4] + (
        ForestTable(prepare_tree_attention, ("auto", False)),
        on_gpu[5],
    )
    model.shared_prefix_output_chunk_tokens = 5
    chunks = ForestTable(ForestTensors.edge_projection_chunks, (5, 1, 0, 1, 0))
    assert chunks in forest_tables(model)
