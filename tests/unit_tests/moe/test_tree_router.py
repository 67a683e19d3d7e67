"""TreeTopKRouter alone: forest statistics against the dense padded batch and the oracle,
packing-invariant gating, the unchanged dense path, and bitwise replay."""

import numpy as np
import pytest
import torch
from determinism.replay import assert_bitwise_replay
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter

from megatron.shared_prefix import plan_shared_prefix
from megatron.shared_prefix.moe.reference import dense_router_statistics
from megatron.shared_prefix.tensors import ForestTensors, forest_scope

from .conftest import ALL_AUX_LOSSES, EXPERT_BIAS
from .forests import dense_gather_index, random_rows, relative_error, root_paths, shared_padded_row

HIDDEN, EXPERTS = 32, 4
METRIC_OF_LOSS = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
}
ROUTER_CASES = {
    "softmax": dict(ALL_AUX_LOSSES),
    "sigmoid_expert_bias": dict(ALL_AUX_LOSSES, **EXPERT_BIAS),
    "router_bias_per_token_loss": dict(
        ALL_AUX_LOSSES,
        add_bias_linear=True,
        calculate_per_token_loss=True,
        moe_router_topk_scaling_factor=2.0,
    ),
}


def _tracked(metrics):
    """{metric name: value of layer 1}, then clear the tracker."""
    values = {name: entry.values[0].clone() for name, entry in metrics.metrics.items()}
    metrics.clear()
    return values


def _forest_step(router, layout, hidden, targets):
    """Route the packed row; backpropagate sum_t multiplicity_t * <probs_t, targets_t>."""
    x = hidden.clone().requires_grad_()
    multiplicity = torch.tensor(layout.token_multiplicity, dtype=torch.float32)
    with forest_scope(ForestTensors.from_layout(layout, "cpu")):
        probs, routing_map = router(x)
    ((probs * targets).sum(-1) * multiplicity).sum().backward()
    return probs.detach(), routing_map, x.grad


def _dense_step(router, layout, hidden, targets):
    """Route the row's sequences as one right-padded batch with padding_mask; same objective.

    megatron-core 0.19.2's expert-bias counting cannot take a padding mask (it broadcasts the
    [tokens] mask against the [tokens, experts] map), so this run routes with the expert bias but
    does not count; :func:`_dense_counts` counts sequence by sequence instead.
    """
    index, padding = dense_gather_index(layout)
    x = hidden[index].clone().requires_grad_()
    counting, router.enable_expert_bias = router.enable_expert_bias, False
    try:
        probs, routing_map = router(x, padding_mask=padding)
    finally:
        router.enable_expert_bias = counting
    valid = ~padding.reshape(-1)
    objective = (probs * targets[index].reshape(-1, EXPERTS)).sum(-1)
    (objective * valid).sum().backward()
    # Gradient of each packed token: the sum over its dense copies.
    grad = torch.zeros_like(hidden).index_add_(
        0, index.reshape(-1)[valid], x.grad.reshape(-1, 1, HIDDEN)[valid]
    )
    return probs.detach()[valid], routing_map[valid], index.reshape(-1)[valid], grad


def _dense_counts(router, layout, hidden):
    """Add the expert-bias counts of the row's sequences, each routed alone as a dense [L, 1] batch."""
    for path in root_paths(layout):
        router(hidden[path])


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_forest_router_matches_dense_padded_batch(build_router, metrics, case):
    """Several rows (micro-batches): probs, experts, counts, every loss value and gradient."""
    forest_router = build_router(**ROUTER_CASES[case])
    dense_router = build_router(**ROUTER_CASES[case])
    counting_router = build_router(**ROUTER_CASES[case])
    _, rows = random_rows(11, num_sequences=10, capacity=64)
    assert len(rows) > 1
    torch.manual_seed(1)
    for layout in rows:
        hidden = torch.randn(layout.num_tokens, 1, HIDDEN)
        targets = torch.randn(layout.num_tokens, EXPERTS)
        probs, routing_map, grad = _forest_step(forest_router, layout, hidden, targets)
        forest_losses = _tracked(metrics)
        dense_probs, dense_map, dense_index, dense_grad = _dense_step(
            dense_router, layout, hidden, targets
        )
        dense_losses = _tracked(metrics)
        if counting_router.enable_expert_bias:
            _dense_counts(counting_router, layout, hidden)
            metrics.clear()

        assert torch.equal(routing_map[dense_index], dense_map)
        assert relative_error(probs[dense_index], dense_probs) < 1e-6
        assert relative_error(grad, dense_grad) < 1e-5
        assert forest_losses.keys() == dense_losses.keys() == set(METRIC_OF_LOSS.values())
        for name, value in dense_losses.items():
            assert relative_error(forest_losses[name], value) < 1e-5, name
    for name, param in dense_router.named_parameters():
        assert (
            relative_error(dict(forest_router.named_parameters())[name].grad, param.grad) < 1e-5
        ), name
    if forest_router.enable_expert_bias:
        assert forest_router.local_tokens_per_expert.dtype == torch.int64
        assert torch.equal(
            forest_router.local_tokens_per_expert, counting_router.local_tokens_per_expert
        )
        assert int(forest_router.local_tokens_per_expert.sum()) == 2 * sum(
            int(layout.token_multiplicity.sum()) for layout in rows
        )
    assert torch.equal(
        forest_router.global_tokens_per_expert, dense_router.global_tokens_per_expert
    )


def test_seq_aux_loss_of_equal_lengths_matches_unpadded_batch(build_router, metrics):
    """With one length for all sequences, the dense reference is megatron-core's plain [S, n] batch."""
    config = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2)
    forest_router, dense_router = build_router(**config), build_router(**config)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, 64, size=6).tolist()
    sequences = [prompt + rng.integers(1, 64, size=9).tolist() for _ in range(4)]
    sequences += [prompt[:3] + rng.integers(1, 64, size=12).tolist()]
    layout = plan_shared_prefix(sequences, capacity=128).rows[0]
    hidden = torch.randn(layout.num_tokens, 1, HIDDEN)
    _forest_step(forest_router, layout, hidden, torch.zeros(layout.num_tokens, EXPERTS))
    forest_loss = _tracked(metrics)["seq_load_balancing_loss"]

    index, padding = dense_gather_index(layout)
    assert not padding.any()
    x = hidden[index].clone().requires_grad_()
    probs, _ = dense_router(x)
    (probs * 0).sum().backward()
    dense_loss = _tracked(metrics)["seq_load_balancing_loss"]
    assert relative_error(forest_loss, dense_loss) < 1e-5
    assert relative_error(forest_router.weight.grad, dense_router.weight.grad) < 1e-5


@pytest.mark.parametrize("count_padding", [False, True])
def test_forest_router_matches_oracle(build_router, metrics, count_padding):
    """Values and gradients of all losses, and the counts, against the dense-expansion oracle."""
    config = dict(ALL_AUX_LOSSES, **EXPERT_BIAS)
    router = build_router(count_padding=count_padding, **config)
    _, layout = shared_padded_row(4, num_sequences=8, pad_multiple=16)
    hidden = torch.randn(layout.num_tokens, 1, HIDDEN)
    with forest_scope(ForestTensors.from_layout(layout, "cpu")):
        probs, routing_map = router(hidden)
        logits = router.gating(hidden).view(-1, EXPERTS)
    (probs * 0).sum().backward()  # only the attached losses reach the router weight
    tracked = _tracked(metrics)

    weight = router.weight.detach().clone().requires_grad_()
    oracle = dense_router_statistics(
        layout,
        hidden.view(-1, HIDDEN) @ weight.t(),
        routing_map,
        topk=2,
        score_function="sigmoid",
        count_padding=count_padding,
        aux_loss_coeff=1e-2,
        seq_aux_loss_coeff=2e-2,
        global_aux_loss_coeff=3e-2,
        z_loss_coeff=1e-3,
    )
    assert torch.equal(router.local_tokens_per_expert, oracle.tokens_per_expert)
    assert torch.equal(router.global_tokens_per_expert, oracle.global_tokens_per_expert.float())
    coefficients = dict(aux_loss=1e-2, seq_aux_loss=2e-2, global_aux_loss=3e-2, z_loss=1e-3)
    total = 0
    for loss, coeff in coefficients.items():
        value = getattr(oracle, loss)
        assert relative_error(tracked[METRIC_OF_LOSS[loss]] * coeff, value) < 1e-5, loss
        total = total + value
    total.backward()
    assert relative_error(router.weight.grad, weight.grad) < 1e-5
    assert relative_error(logits, hidden.view(-1, HIDDEN) @ weight.t()) < 1e-6


def test_padding_counts_once_when_asked(build_router):
    """count_padding=True adds each padding token's experts once to the multiplicity counts."""
    _, layout = shared_padded_row(2, pad_multiple=16)
    hidden = torch.randn(layout.num_tokens, 1, HIDDEN)
    counts = {}
    for count_padding in (False, True):
        router = build_router(count_padding=count_padding, **EXPERT_BIAS)
        with forest_scope(ForestTensors.from_layout(layout, "cpu")):
            _, routing_map = router(hidden)
        counts[count_padding] = router.local_tokens_per_expert
    padding_routes = routing_map[-layout.num_padding :].sum(0)
    assert torch.equal(counts[True], counts[False] + padding_routes)
    assert int(counts[True].sum()) == 2 * (
        int(layout.token_multiplicity.sum()) + layout.num_padding
    )


def _chain_layout(length):
    return plan_shared_prefix([np.arange(length) % 60 + 1], capacity=length).rows[0]


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float32),
        pytest.param(
            "cuda",
            torch.bfloat16,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_gating_is_packing_invariant(build_router, device, dtype):
    """The same tokens packed at other offsets, in rows of other lengths: bitwise equal routing."""
    # A wide router; on CPU an unblocked GEMM differs for rows of fewer than 8 tokens.
    hidden_size = 1024
    router = build_router(
        add_bias_linear=True, hidden_size=hidden_size, num_moe_experts=16, **EXPERT_BIAS
    ).to(device, dtype)
    tokens = torch.randn(37, 1, hidden_size).to(device, dtype)
    reference = None
    # (row length, offset, tokens placed): alone in tiny rows, inside the first block, across a
    # block boundary (256), and in a later block.
    for length, offset, count in [
        (37, 0, 37),
        (1, 0, 1),
        (5, 2, 3),
        (50, 13, 37),
        (300, 240, 37),
        (700, 511, 37),
    ]:
        hidden = torch.randn(length, 1, hidden_size).to(device, dtype)
        hidden[offset : offset + count] = tokens[:count]
        forest = ForestTensors.from_layout(_chain_layout(length), device)
        with forest_scope(forest), torch.no_grad():
            logits = router.gating(hidden)
            probs, routing_map = router(hidden)
        placed = [
            value[offset : offset + count]
            for value in (logits.view(length, -1), probs, routing_map)
        ]
        if reference is None:
            reference = placed
        for expected, value in zip(reference, placed):
            assert torch.equal(expected[:count], value), (length, offset)


def test_gating_gradients_match_one_gemm(build_router):
    """The blocked gating's backward: the gradients of one unblocked GEMM (with a bias)."""
    router = build_router(add_bias_linear=True)
    _, layout = shared_padded_row(1, num_sequences=8, pad_multiple=16)
    hidden = torch.randn(layout.num_tokens, 1, router.weight.shape[1], requires_grad=True)
    probe = torch.randn(layout.num_tokens, router.weight.shape[0])
    with forest_scope(ForestTensors.from_layout(layout, "cpu")):
        (router.gating(hidden).view(-1, probe.shape[1]) * probe).sum().backward()
    weight = router.weight.detach().clone().requires_grad_()
    bias = router.bias.detach().clone().requires_grad_()
    x = hidden.detach().clone().requires_grad_()
    ((x.view(-1, weight.shape[1]) @ weight.t() + bias) * probe).sum().backward()
    assert relative_error(hidden.grad, x.grad) < 1e-6
    assert relative_error(router.weight.grad, weight.grad) < 1e-6
    assert relative_error(router.bias.grad, bias.grad) < 1e-6


@pytest.mark.parametrize("with_padding_mask", [False, True])
def test_dense_path_is_stock_topk_router(build_router, metrics, with_padding_mask):
    """Without a forest, TreeTopKRouter gives TopKRouter's bits (counts: same integers, in int64).

    megatron-core 0.19.2 cannot count expert-bias tokens under a padding mask (see _dense_step),
    so the padded case runs without expert bias.
    """
    tree = build_router(**ALL_AUX_LOSSES, **({} if with_padding_mask else EXPERT_BIAS))
    stock = TopKRouter(tree.config, get_default_pg_collection())
    stock.load_state_dict(tree.state_dict())
    stock.set_layer_number(1)
    stock.train()
    hidden = torch.randn(9, 3, HIDDEN)
    padding_mask = torch.rand(9, 3) < 0.3 if with_padding_mask else None
    targets = torch.randn(27, EXPERTS)
    outcome = {}
    for name, router in (("tree", tree), ("stock", stock)):
        x = hidden.clone().requires_grad_()
        probs, routing_map = router(x, padding_mask=padding_mask)
        (probs * targets).sum().backward()
        outcome[name] = (probs, routing_map, x.grad, router.weight.grad, _tracked(metrics))
    for reference, value in zip(outcome["stock"][:4], outcome["tree"][:4]):
        assert torch.equal(reference, value)
    assert outcome["tree"][4].keys() == outcome["stock"][4].keys()
    for name, value in outcome["stock"][4].items():
        assert torch.equal(outcome["tree"][4][name], value), name
    if not with_padding_mask:
        assert tree.local_tokens_per_expert.dtype == torch.int64
        assert torch.equal(tree.local_tokens_per_expert, stock.local_tokens_per_expert.long())
    assert torch.equal(tree.global_tokens_per_expert, stock.global_tokens_per_expert)


def test_forest_input_errors(build_router):
    _, rows = random_rows(0)
    layout = rows[0]
    hidden = torch.randn(layout.num_tokens, 1, HIDDEN)
    with forest_scope(ForestTensors.from_layout(layout, "cpu")):
        with pytest.raises(ValueError, match="padding_mask"):
            build_router()(hidden, padding_mask=torch.zeros(layout.num_tokens, 1, dtype=torch.bool))
        with pytest.raises(ValueError, match="router input holds"):
            build_router()(hidden[:-1])
        with pytest.raises(ValueError, match="moe_input_jitter_eps"):
            build_router(moe_input_jitter_eps=0.1)(hidden)
    with pytest.raises(TypeError, match="count_padding"):
        build_router(count_padding=None)


def test_forest_router_replay(build_router):
    """Forward and backward of a forest route, all losses and counts on, twice: identical bits."""
    router = build_router(**ALL_AUX_LOSSES, **EXPERT_BIAS)
    _, layout = shared_padded_row(3, pad_multiple=16)

    def make_inputs():
        hidden = torch.randn(layout.num_tokens, 1, HIDDEN, requires_grad=True)
        return hidden, ForestTensors.from_layout(layout, "cpu")

    def route(hidden, forest):
        router.local_tokens_per_expert.zero_()
        router.reset_global_aux_loss_tracker()
        with forest_scope(forest):
            probs, routing_map = router(hidden)
        return probs, routing_map, router.local_tokens_per_expert.clone()

    assert_bitwise_replay(route, make_inputs, module=router)
