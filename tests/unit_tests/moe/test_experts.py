"""TreeMoELayer on a forest (sync-free dispatch, grouped-GEMM experts) against megatron-core's
MoELayer with SequentialMLP experts and the same weights: outputs, gradients, the dispatcher's
tensors, which path ran, and (on CUDA) that nothing waits for the GPU."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from megatron.shared_prefix.tensors import ForestTensors, forest_scope

from .conftest import moe_config
from .forests import relative_error, shared_padded_row

GATED = dict(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=1.5)


def _layers(config, device):
    """(TreeMoELayer from tree_moe_module_spec, stock MoELayer with SequentialMLP experts and the
    same router), with the tree layer's weights loaded into the stock one."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron.shared_prefix.moe import tree_moe_module_spec

    spec = tree_moe_module_spec(num_experts=config.num_moe_experts, count_padding=False)
    submodules = spec.keywords["submodules"]
    stock_submodules = type(submodules)(
        experts=partial(SequentialMLP, **submodules.experts.keywords),
        router=submodules.router,
    )
    torch.manual_seed(0)
    tree = spec(config=config, pg_collection=get_default_pg_collection(), layer_number=1)
    stock = MoELayer(
        config, submodules=stock_submodules, layer_number=1, pg_collection=get_default_pg_collection()
    )
    stock.load_state_dict(tree.state_dict())  # same parameter names: checkpoints carry over
    with torch.no_grad():
        tree.router.weight.normal_()  # routing far from ties
        stock.router.weight.copy_(tree.router.weight)
    return tree.to(device).train(), stock.to(device).train()


def _forward_backward(layer, hidden, forest, probe):
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    with forest_scope(forest):
        output, _ = layer(hidden)
    output.backward(probe)
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return output.detach(), hidden.grad, grads


def _count_grouped_mm(monkeypatch):
    from megatron.shared_prefix.moe import experts

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return grouped_mm(*args, **kwargs)

    grouped_mm = experts.grouped_mm
    monkeypatch.setattr(experts, "grouped_mm", counting)
    return calls


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_moe_experts=4, moe_router_topk=2),
        # More experts than the row's tokens fill: some get no token.
        dict(num_moe_experts=16, moe_router_topk=1, moe_router_pre_softmax=True, **GATED),
    ],
    ids=["gelu", "gated-some-experts-empty"],
)
def test_forest_layer_matches_stock_layer(megatron_world, monkeypatch, settings):
    config = moe_config(**settings)
    _, layout = shared_padded_row(2, num_sequences=4, max_len=12, pad_multiple=8)
    tree, stock = _layers(config, "cpu")
    forest = ForestTensors.from_layout(layout, "cpu")
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(layout.num_tokens, 1, config.hidden_size, generator=generator)
    probe = torch.randn(layout.num_tokens, 1, config.hidden_size, generator=generator)

    calls = _count_grouped_mm(monkeypatch)
    out, grad_in, grads = _forward_backward(tree, hidden, forest, probe)
    routed = layout.num_tokens * config.moe_router_topk
    # fc1 and fc2 once each, then per layer (fc2 first) one GEMM for the input's gradient and one
    # for the weights' (whose first operand is grad_output^T: out-features rows).
    fc1_out = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    assert calls == [routed, routed, routed, config.hidden_size, routed, fc1_out]
    stock_out, stock_grad_in, stock_grads = _forward_backward(stock, hidden, forest, probe)
    assert len(calls) == 6  # the stock layer ran SequentialMLP's loop

    if settings["num_moe_experts"] == 16:
        routed = torch.zeros(16, dtype=torch.bool)
        with torch.no_grad(), forest_scope(forest):
            routed[tree.router(hidden)[1].any(0)] = True
        assert not routed.all()
    assert relative_error(out, stock_out) < 1e-6
    assert relative_error(grad_in, stock_grad_in) < 1e-6
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        expected = stock_grads[name]
        if expected.any():
            assert relative_error(grad, expected) < 1e-6, name
        else:  # an expert no token reached: zero gradients in both
            assert torch.equal(grad, expected), name


def _expert_operands(device, dtype, in_features=24, out_features=40):
    """Rows sorted by expert for 4 experts, the third with no row, and one weight per expert."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([7, 12, 0, 5])
    x = torch.randn(int(counts.sum()), in_features, generator=generator).to(device, dtype)
    weights = [
        torch.randn(out_features, in_features, generator=generator).to(device, dtype)
        for _ in counts
    ]
    probe = torch.randn(x.shape[0], out_features, generator=generator).to(device, dtype)
    return x, counts.cumsum(0).to(device, torch.int32), weights, probe


def _grouped_linear_forward_backward(linear, x, offsets, weights, probe):
    x = x.detach().clone().requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in weights]
    output = linear(x, offsets, weights)
    output.backward(probe)
    return output.detach(), x.grad, [w.grad for w in weights]


def _through_stack(x, offsets, weights):
    from megatron.shared_prefix.moe.experts import grouped_mm

    return grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)


def _stacked_experts_linear(x, offsets, weights):
    from megatron.shared_prefix.moe.experts import StackedExpertsLinear

    return StackedExpertsLinear.apply(x, offsets, *weights)


def _assert_stacked_linear_matches_autograd_through_stack(device, dtype):
    operands = _expert_operands(device, dtype)
    expected = _grouped_linear_forward_backward(_through_stack, *operands)
    actual = _grouped_linear_forward_backward(_stacked_experts_linear, *operands)
    assert torch.equal(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])
    assert all(torch.equal(a, e) for a, e in zip(actual[2], expected[2], strict=True))
    assert not actual[2][2].any() and actual[2][0].any()  # the empty expert's gradient is zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_linear_matches_autograd_through_stack(dtype):
    """Output, input and weight gradients bitwise those of autograd through torch.stack."""
    _assert_stacked_linear_matches_autograd_through_stack("cpu", dtype)


def _saved_storages(linear, x, offsets, weights):
    """The storages (data pointers) autograd keeps for the backward of linear's forward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().data_ptr()) or t, lambda t: t
    ):
        linear(x.requires_grad_(), offsets, [w.requires_grad_() for w in weights])
    return set(saved)


def test_stacked_experts_linear_keeps_no_stacked_weights():
    """Its backward keeps only the input, the offsets and the weights themselves; autograd through
    torch.stack keeps a stacked copy besides (what the function exists to drop)."""
    x, offsets, weights, _ = _expert_operands("cpu", torch.float32)
    own = {t.untyped_storage().data_ptr() for t in (x, offsets, *weights)}
    assert _saved_storages(_stacked_experts_linear, x, offsets, weights) <= own
    assert _saved_storages(_through_stack, x, offsets, weights) - own


def test_dispatcher_returns_the_stock_permutation(megatron_world):
    """Same permuted tokens, probabilities and inverse mapping as megatron-core's dispatcher, and
    the same counts, left as computed (no host copy)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    config = moe_config(num_moe_experts=4, moe_router_topk=2)
    _, layout = shared_padded_row(3, pad_multiple=8)
    tree, _ = _layers(config, "cpu")
    dispatcher = tree.token_dispatcher
    forest = ForestTensors.from_layout(layout, "cpu")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(layout.num_tokens, config.hidden_size, generator=generator)
    scores = torch.rand(layout.num_tokens, 4, generator=generator)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(2).indices, True)
    probs = scores * routing_map

    results = []
    for method in (type(dispatcher).dispatch_postprocess, MoEAllGatherTokenDispatcher.dispatch_postprocess):
        dispatcher.routing_map = routing_map
        with forest_scope(forest):
            permuted, counts, permuted_probs = method(dispatcher, hidden, probs)
        results.append(
            (permuted, counts, permuted_probs, dispatcher.reversed_local_input_permutation_mapping)
        )
    (permuted, counts, permuted_probs, mapping), stock = results
    assert counts.dtype == torch.int64 and torch.equal(counts, stock[1])
    assert torch.equal(permuted, stock[0])
    assert torch.equal(permuted_probs, stock[2])
    assert torch.equal(mapping, stock[3])


def test_settings_the_grouped_path_cannot_run_keep_the_loop(megatron_world, monkeypatch):
    from megatron.shared_prefix.moe.experts import grouped_experts_errors

    config = moe_config(
        num_moe_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_apply_probs_on_input=True,
    )
    _, layout = shared_padded_row(2, pad_multiple=8)
    tree, stock = _layers(config, "cpu")
    assert grouped_experts_errors(config, tree.experts) == ["moe_apply_probs_on_input=True"]
    calls = _count_grouped_mm(monkeypatch)
    forest = ForestTensors.from_layout(layout, "cpu")
    hidden = torch.randn(layout.num_tokens, 1, config.hidden_size)
    probe = torch.randn_like(hidden)
    out, _, _ = _forward_backward(tree, hidden, forest, probe)
    assert calls == []
    assert torch.equal(out, _forward_backward(stock, hidden, forest, probe)[0])


def test_without_a_forest_the_layer_is_stock(megatron_world, monkeypatch):
    config = moe_config(num_moe_experts=4, moe_router_topk=2)
    tree, stock = _layers(config, "cpu")
    calls = _count_grouped_mm(monkeypatch)
    hidden = torch.randn(10, 2, config.hidden_size)
    assert torch.equal(tree(hidden)[0], stock(hidden)[0])
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forest_layer_on_cuda_never_waits_for_the_gpu(megatron_world):
    """bf16 on CUDA: forward and backward of the MoE layer on a forest run with synchronizing calls
    turned into errors, replay bitwise, and stay within bf16 rounding of the stock layer."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's grouped GEMM needs compute capability 8.0")
    config = moe_config(
        num_moe_experts=8,
        moe_router_topk=2,
        hidden_size=256,
        ffn_hidden_size=512,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    _, layout = shared_padded_row(5, num_sequences=8, max_len=300, capacity=4096, pad_multiple=64)
    tree, stock = _layers(config, "cuda")
    forest = ForestTensors.from_layout(layout, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(layout.num_tokens, 1, 256, device="cuda", generator=generator).bfloat16()
    probe = torch.randn(layout.num_tokens, 1, 256, device="cuda", generator=generator).bfloat16()

    first = _forward_backward(tree, hidden, forest, probe)  # compiles and fills the forest's tables
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # pylint: disable=pointless-statement  # queued work a synchronization would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = _forward_backward(tree, hidden, forest, probe)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name, grad in first[2].items():
        assert torch.equal(grad, second[2][name]), name
    stock_out, stock_grad_in, _ = _forward_backward(stock, hidden, forest, probe)
    assert relative_error(first[0], stock_out) < 2e-2
    assert relative_error(first[1], stock_grad_in) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stacked_experts_linear_on_cuda_matches_autograd_through_stack():
    """bf16 on CUDA, where the grouped GEMM's kernel depends on its operands' layouts."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's grouped GEMM needs compute capability 8.0")
    _assert_stacked_linear_matches_autograd_through_stack("cuda", torch.bfloat16)
