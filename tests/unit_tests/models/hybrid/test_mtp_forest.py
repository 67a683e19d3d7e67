"""Multi-token prediction on forests against megatron-core's dense HybridModel with MTP.

Two dense references:

* each sequence run alone through HybridModel.forward, its per-token MTP losses read where
  ``process_mtp_loss`` computes them (dense_reference.py): every depth's loss of every edge, the
  gradients of a random weighting of main and MTP losses (MTP heads and backbone), and the
  expert-bias counts of MTP MoE layers, on random forests of depth 1 to 4 (single-token segments,
  segments shorter than the MTP depth, sequences that end inside others);
* one unpadded dense batch of equal-length sequences (a GRPO group), where megatron-core's own MTP
  loss (MTPLossAutoScaler, normalized over the micro-batch) and its MoE auxiliary losses are
  defined on the same tokens as a forest row's: the gradients of the combined loss with
  ``mtp_loss_scaling_factor``, the logged MTP losses and acceptance counts, the MoE losses and
  counts of every layer.
"""

import numpy as np
import pytest
import torch
from dense_reference import (
    GRAD_TOLERANCE,
    LOSS_TOLERANCE,
    dense_edge_losses_with_mtp,
    gradients,
    relative_error,
    without_megatron_mtp_gradient,
)
from tiny import tiny_config

from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec, plan_shared_prefix
from megatron.shared_prefix.moe import TreeTopKRouter
from megatron.shared_prefix.tensors import current_forest

# Aux-loss-free expert-bias routing (counts, no loss), and every load-balancing loss.
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
AUX_LOSSES = dict(
    moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
    moe_aux_loss_coeff=[1e-2, 2e-2, 3e-2],
    moe_z_loss_coeff=1e-3,
)


@pytest.fixture(autouse=True)
def fresh_mtp_tracker():
    """An empty MTPLossLoggingHelper tracker per test: megatron-core sizes its arrays by the
    depth count of the first model that logs (one per process in training)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _main_pattern(pattern):
    return pattern.split("/")[0]


def build(pattern, *, seed=0, tied=False, position="rope", **config):
    """SharedPrefixHybridModel (float32) of ``pattern`` with its MTP depths."""
    depths = pattern.count("/")
    experts = 4 if "E" in pattern else None
    settings = dict(num_layers=len(_main_pattern(pattern)), mtp_num_layers=depths)
    if experts:
        settings.update(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    settings.update(config)
    torch.manual_seed(seed)
    model = SharedPrefixHybridModel(
        tiny_config(**settings),
        hybrid_stack_spec=hybrid_stack_spec(experts, mamba_chunk_size=8),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern=pattern,
        position_embedding_type=position,
        share_embeddings_and_output_weights=tied,
    )
    with torch.no_grad():
        for router in routers(model):
            # Routing far from ties: forest and dense pick the same experts.
            router.weight.normal_()
    return model


def routers(model):
    return [module for module in model.modules() if isinstance(module, TreeTopKRouter)]


def mtp_routers(model):
    return [
        m for name, m in model.named_modules() if name.startswith("mtp.") and m in routers(model)
    ]


def expert_counts(model):
    return [router.local_tokens_per_expert.clone() for router in routers(model)]


def zero_counts(model):
    for router in routers(model):
        if router.enable_expert_bias:
            router.local_tokens_per_expert.zero_()


def random_masks(sequences, rng):
    masks = []
    for sequence in sequences:
        mask = rng.random(len(sequence)) < 0.7
        mask[0] = False
        masks.append(mask.tolist())
    return masks


def weighted(main, mtp, main_weight, mtp_weight):
    """sum(w * main) + sum over the defined MTP losses of w * loss."""
    valid = ~torch.isnan(mtp)
    return (main * main_weight).sum() + torch.where(valid, mtp * mtp_weight, 0.0).sum()


def assert_matches_dense(model, sequences, plan, seed=0, counts=False):
    """Per-edge main and MTP losses, gradients of a random weighting of them and (``counts``)
    the MoE expert counts of a forest step equal those of the dense per-sequence runs."""
    generator = torch.Generator().manual_seed(seed)
    depths = model.config.mtp_num_layers
    weights = [
        (
            torch.rand(len(row.edge_source), generator=generator) + 0.5,
            torch.rand(depths, len(row.edge_source), generator=generator) + 0.5,
        )
        for row in plan.rows
    ]
    model.zero_grad(set_to_none=True)
    zero_counts(model)
    tree = []
    for row, (main_weight, mtp_weight) in zip(plan.rows, weights):
        losses = model(None, None, None, shared_prefix_layout=row, shared_prefix_mtp_losses=True)
        assert losses.edge_loss.shape == (len(row.edge_source),)
        assert (
            losses.mtp_edge_loss.shape
            == losses.mtp_edge_correct.shape
            == (depths, len(row.edge_source))
        )
        assert current_forest() is None
        weighted(losses.edge_loss, losses.mtp_edge_loss, main_weight, mtp_weight).backward()
        tree.append((losses.edge_loss.detach(), losses.mtp_edge_loss.detach()))
    tree_grads, tree_counts = gradients(model), expert_counts(model)

    model.zero_grad(set_to_none=True)
    zero_counts(model)
    dense = []
    with without_megatron_mtp_gradient():
        for row, (main_weight, mtp_weight) in zip(plan.rows, weights):
            main, mtp = dense_edge_losses_with_mtp(model, sequences, row)
            weighted(main, mtp, main_weight, mtp_weight).backward()
            dense.append((main.detach(), mtp.detach()))
    dense_grads, dense_counts = gradients(model), expert_counts(model)

    for row, (tree_main, tree_mtp), (dense_main, dense_mtp) in zip(plan.rows, tree, dense):
        assert torch.equal(torch.isnan(tree_mtp), torch.isnan(dense_mtp))
        for depth in range(depths):
            # An edge (s, j) has a depth-(d + 1) target iff j >= d + 2.
            assert torch.equal(
                ~torch.isnan(tree_mtp[depth]), torch.as_tensor(row.edge_position >= depth + 2)
            )
    tree_main = torch.cat([t[0] for t in tree])
    dense_main = torch.cat([d[0] for d in dense])
    assert relative_error(tree_main, dense_main) <= LOSS_TOLERANCE
    for depth in range(depths):
        tree_depth = torch.cat([t[1][depth] for t in tree])
        dense_depth = torch.cat([d[1][depth] for d in dense])
        valid = ~torch.isnan(dense_depth)
        assert valid.any(), f"no target at MTP depth {depth + 1}"
        assert relative_error(tree_depth[valid], dense_depth[valid]) <= LOSS_TOLERANCE, depth
    assert tree_grads.keys() == dense_grads.keys()
    mtp_names = [name for name in dense_grads if name.startswith("mtp.")]
    assert mtp_names and all(dense_grads[name] is not None for name in mtp_names)
    for name, expected in dense_grads.items():
        assert (tree_grads[name] is None) == (expected is None), name
        if expected is not None and expected.abs().max() > 0:
            assert relative_error(tree_grads[name], expected) <= GRAD_TOLERANCE, name
    if counts:
        assert mtp_routers(model)
        assert all(torch.equal(a, b) for a, b in zip(tree_counts, dense_counts))
        assert all(count.sum() > 0 for count in tree_counts)


@pytest.mark.parametrize(
    "depth,pattern,share_supervised",
    [
        (1, "M*/*M", True),
        (2, "*-M/M*/M*", False),
        (3, "M*-/-M*/-M*/-M*", True),
        (4, "*M/M-/M-", True),
    ],
)
def test_mtp_forest_matches_dense(
    megatron_world, forest_sequences, depth, pattern, share_supervised
):
    sequences = forest_sequences(seed=20 + depth, depth=depth)
    masks = random_masks(sequences, np.random.default_rng(depth))
    plan = plan_shared_prefix(sequences, masks, capacity=128, share_supervised=share_supervised)
    assert_matches_dense(build(pattern, seed=depth), sequences, plan, seed=depth)


def test_mtp_moe_forest_matches_dense(megatron_world, forest_sequences):
    """MoE layers in the main stack and in every MTP depth: expert counts include each depth's
    sequence-end positions, once per sequence through them."""
    sequences = forest_sequences(seed=7, depth=3)
    plan = plan_shared_prefix(sequences, capacity=512, pad_multiple=8)
    model = build("M*E/E*/E*", seed=3, **EXPERT_BIAS)
    assert_matches_dense(model.train(), sequences, plan, seed=3, counts=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(mtp_use_repeated_layer=True),
        dict(mtp_detach_heads=True),
        dict(tied=True),
        dict(position="learned_absolute"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ],
    ids=["repeated-layer", "detach-heads", "tied", "learned-absolute", "recompute"],
)
def test_mtp_forest_options_match_dense(megatron_world, forest_sequences, options):
    sequences = forest_sequences(seed=5, depth=3)
    plan = plan_shared_prefix(sequences, capacity=512, pad_multiple=16)
    model = build("*M-/M*/M*", seed=1, **options)
    assert_matches_dense(model.train(), sequences, plan, seed=2)


def test_segments_shorter_than_the_depth(megatron_world):
    """Single-token segments below a branch, sequences shorter than the MTP depth and sequences
    ending inside others: a position may need one copy per distinct continuation path."""
    sequences = [
        [3, 4, 5, 6, 7, 8],
        [3, 4, 9, 6, 7, 8],
        [3, 4, 9, 10],
        [3, 4, 9, 10, 11, 12, 13],
        [3, 4],
        [3, 11],
        [3, 4, 5],
        [3, 4, 5, 6, 7, 8],
    ]
    plan = plan_shared_prefix(sequences, capacity=64)
    assert_matches_dense(build("*M/M*/M*/M*", seed=4), sequences, plan, seed=4)


def _grpo_batch(seed, group=4, prompt=9, completion=7):
    """A prompt with ``group`` equal-length completions (some sharing a first part) and
    completion-only loss masks."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, 64, prompt).tolist()
    completions = []
    for index in range(group):
        if completions and index % 2:
            shared = completions[-1][: int(rng.integers(1, completion))]
        else:
            shared = []
        completions.append(shared + rng.integers(1, 64, completion - len(shared)).tolist())
    sequences = [head + c for c in completions]
    masks = [[False] * prompt + [True] * completion for _ in completions]
    return sequences, masks


def _mtp_tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = {
        key: tracker[key].clone() for key in ("loss_values", "correct_values", "total_values")
    }
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return values


def _moe_metrics():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    values = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    for entry in tracker.metrics.values():
        entry.values.zero_()
    return values


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token-loss", "mean-loss"])
def test_mtp_loss_enters_training_as_in_hybrid_model(megatron_world, per_token):
    """The forward with a layout trains MTP as HybridModel does on the dense batch of the row's
    sequences: same gradients of the combined loss, same logged MTP losses and acceptance, same
    MoE losses and counts in every layer, MTP layers included."""
    from megatron.core.transformer.moe.moe_logging import (
        MoEMetricsTracker,
        destroy_moe_metrics_tracker,
        set_moe_metrics_tracker,
    )
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )

    sequences, masks = _grpo_batch(seed=int(per_token))
    layout = plan_shared_prefix(sequences, masks, capacity=128).rows[0]
    assert layout.num_tokens < sum(len(s) for s in sequences)
    model = build(
        "M*E/*E/*E",
        seed=5,
        mtp_loss_scaling_factor=0.4,
        calculate_per_token_loss=per_token,
        **EXPERT_BIAS,
        **AUX_LOSSES,
    ).train()
    generator = torch.Generator().manual_seed(0)
    edge_weight = torch.rand(len(layout.edge_source), generator=generator) + 0.5

    tokens = torch.tensor(sequences)
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.zeros_like(tokens, dtype=torch.float32)
    dense_weight = torch.zeros_like(loss_mask)
    row_of = {int(s): k for k, s in enumerate(layout.sequence_ids)}
    for e, (s, j) in enumerate(zip(layout.edge_sequence.tolist(), layout.edge_position.tolist())):
        loss_mask[s, j - 1] = 1.0
        dense_weight[s, j - 1] = edge_weight[e]
    assert len(row_of) == len(sequences)

    set_moe_metrics_tracker(MoEMetricsTracker())
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    # A scale left by an earlier test (a 0-d one from a backward without a schedule) would take
    # this one by copy_ and fail on the shape: start from none.
    MTPLossAutoScaler.main_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    try:
        results = []
        for run in ("tree", "dense"):
            model.zero_grad(set_to_none=True)
            zero_counts(model)
            for router in routers(model):
                router.reset_global_aux_loss_tracker()
            if run == "tree":
                edge_loss = model(None, None, None, shared_prefix_layout=layout)
                (edge_loss * edge_weight).sum().backward()
            else:
                positions = torch.arange(tokens.shape[1]).expand_as(tokens)
                loss = model(tokens, positions, None, labels=labels, loss_mask=loss_mask)
                (loss * dense_weight).sum().backward()
            results.append((gradients(model), _mtp_tracker(), _moe_metrics(), expert_counts(model)))
    finally:
        destroy_moe_metrics_tracker()
    (tree_grads, tree_mtp, tree_moe, tree_counts), (
        dense_grads,
        dense_mtp,
        dense_moe,
        dense_counts,
    ) = results
    for name, expected in dense_grads.items():
        assert (tree_grads[name] is None) == (expected is None), name
        if expected is not None and expected.abs().max() > 0:
            assert relative_error(tree_grads[name], expected) <= GRAD_TOLERANCE, name
    assert torch.equal(tree_mtp["total_values"], dense_mtp["total_values"])
    assert tree_mtp["total_values"].min() > 0
    assert torch.equal(tree_mtp["correct_values"], dense_mtp["correct_values"])
    assert relative_error(tree_mtp["loss_values"], dense_mtp["loss_values"]) <= LOSS_TOLERANCE
    assert tree_moe.keys() == dense_moe.keys() and len(tree_moe) == 4
    for name, values in dense_moe.items():
        assert values.abs().max() > 0, name
        assert relative_error(tree_moe[name], values) <= LOSS_TOLERANCE, name
    assert len(mtp_routers(model)) == 2
    assert all(torch.equal(a, b) for a, b in zip(tree_counts, dense_counts))
    assert all(count.sum() > 0 for count in tree_counts)


def test_dense_forward_with_mtp_is_hybrid_model_forward(megatron_world):
    """Without a layout the subclass with MTP layers runs HybridModel.forward: bitwise equal
    losses and gradients, the MTP gradient included."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    outputs = []
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    for cls in (HybridModel, SharedPrefixHybridModel):
        torch.manual_seed(3)
        model = cls(
            tiny_config(num_layers=3, mtp_num_layers=2),
            hybrid_stack_spec=hybrid_stack_spec(),
            vocab_size=64,
            max_sequence_length=64,
            hybrid_layer_pattern="*-M/M*/M*",
            position_embedding_type="rope",
        )
        tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(11).expand(2, 11)
        loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
        loss.mean().backward()
        outputs.append((loss, gradients(model)))
    (loss_a, grads_a), (loss_b, grads_b) = outputs
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and any(name.startswith("mtp.") for name in grads_a)
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)


def test_rejects_mtp_it_cannot_run(megatron_world, forest_sequences):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]

    def rejected(model, match, **kwargs):
        calls = []
        model.embedding.register_forward_pre_hook(lambda *_: calls.append(1))
        with pytest.raises(ValueError, match=match):
            model(None, None, None, shared_prefix_layout=layout, **kwargs)
        assert not calls

    model = build("*-/M*/M*")
    model.config.mtp_num_layers = 3
    rejected(model, "mtp_num_layers=3 with 2 MTP depths")
    model.config.mtp_num_layers = 2
    model.post_process = False
    rejected(model, "MTP layers on a pipeline stage without the output layer")

    spec = hybrid_stack_spec()
    stock_layer = spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    spec.submodules.mtp_block_spec = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(module=MultiTokenPredictionLayer, submodules=stock_layer.submodules)
            ]
        ),
    )
    torch.manual_seed(0)
    stock = SharedPrefixHybridModel(
        tiny_config(num_layers=2, mtp_num_layers=1),
        hybrid_stack_spec=spec,
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern="*-/M*",
        position_embedding_type="rope",
    )
    rejected(stock, "TreeMultiTokenPredictionLayer")
    moe = build("*-/E*", **EXPERT_BIAS)
    moe.config.expert_model_parallel_size = 2
    rejected(moe, "allgather' with expert_model_parallel_size=2 and MoE layers in the MTP depths")
    with pytest.raises(
        ValueError, match="shared_prefix_mtp_losses=True without shared_prefix_layout"
    ):
        build("*-/M*")(
            torch.zeros(1, 4, dtype=torch.long), None, None, shared_prefix_mtp_losses=True
        )
    with pytest.raises(ValueError, match="MTP depth 1 0 \\(E\\)"):
        SharedPrefixHybridModel(
            tiny_config(num_layers=2, mtp_num_layers=1, num_moe_experts=4, add_bias_linear=False),
            hybrid_stack_spec=hybrid_stack_spec(),
            vocab_size=64,
            max_sequence_length=512,
            hybrid_layer_pattern="*-/E*",
        )
    del HybridModel


def test_mtp_losses_of_a_model_without_mtp(megatron_world, forest_sequences):
    """A model without MTP depths returns [0, E] MTP losses; a config's mtp_num_layers without
    MTP depths in the pattern runs no MTP, as HybridModel runs none."""
    layout = plan_shared_prefix(forest_sequences(seed=1, depth=2), capacity=512).rows[0]
    torch.manual_seed(0)
    model = SharedPrefixHybridModel(
        tiny_config(num_layers=2, mtp_num_layers=1),
        hybrid_stack_spec=hybrid_stack_spec(),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern="*-",
        position_embedding_type="rope",
    )
    losses = model(None, None, None, shared_prefix_layout=layout, shared_prefix_mtp_losses=True)
    assert losses.mtp_edge_loss.shape == (0, len(layout.edge_source))
    assert torch.equal(losses.edge_loss, model(None, None, None, shared_prefix_layout=layout))
