"""SharedPrefixHybridModel: forest forwards against dense per-sequence runs, validation, recompute."""

import numpy as np
import pytest
import torch
from dense_reference import assert_forest_matches_dense, gradients

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import current_forest


def random_loss_masks(sequences, seed):
    """Per-sequence masks with random unsupervised spans (position 0 never supervised)."""
    rng = np.random.default_rng(seed)
    masks = []
    for sequence in sequences:
        mask = rng.random(len(sequence)) < 0.7
        mask[0] = False
        masks.append(mask.tolist())
    return masks


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("pattern", ["*-*-", "**"])
@pytest.mark.parametrize("share_supervised", [True, False])
def test_forest_matches_dense(build_model, forest_sequences, depth, pattern, share_supervised):
    sequences = forest_sequences(seed=10 * depth + len(pattern), depth=depth)
    masks = random_loss_masks(sequences, seed=depth)
    plan = plan_shared_prefix(sequences, masks, capacity=96, share_supervised=share_supervised)
    model = build_model(pattern, seed=depth)
    assert_forest_matches_dense(model, sequences, plan, seed=depth)


@pytest.mark.parametrize(
    "options",
    [
        dict(tied=True),
        dict(add_bias_linear=True),
        dict(num_query_groups=4),
        dict(
            num_query_groups=1, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True
        ),
        dict(softmax_scale=0.2, normalization="LayerNorm"),
    ],
    ids=["tied", "bias", "mha", "mqa-layer-scaling", "softmax-scale-layernorm"],
)
def test_forest_matches_dense_options(build_model, forest_sequences, options):
    sequences = forest_sequences(seed=5, depth=3)
    plan = plan_shared_prefix(sequences, capacity=512, pad_multiple=16)
    assert plan.rows[0].num_padding > 0 or plan.executed_tokens % 16 == 0
    model = build_model("*-*", seed=1, **options)
    assert_forest_matches_dense(model, sequences, plan)


def test_learned_absolute_positions(megatron_world, forest_sequences):
    from tiny import tiny_config

    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    torch.manual_seed(0)
    model = SharedPrefixHybridModel(
        tiny_config(num_layers=2),
        hybrid_stack_spec=hybrid_stack_spec(),
        vocab_size=64,
        max_sequence_length=128,
        hybrid_layer_pattern="*-",
        position_embedding_type="learned_absolute",
    )
    sequences = forest_sequences(seed=2, depth=2)
    assert_forest_matches_dense(model, sequences, plan_shared_prefix(sequences, capacity=512))


def test_dense_forward_is_hybrid_model_forward(megatron_world):
    """Without a layout the subclass runs HybridModel.forward: bitwise equal outputs and gradients."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from tiny import tiny_config

    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    models = []
    for cls in (HybridModel, SharedPrefixHybridModel):
        torch.manual_seed(3)
        models.append(
            cls(
                tiny_config(num_layers=3),
                hybrid_stack_spec=hybrid_stack_spec(),
                vocab_size=64,
                max_sequence_length=64,
                hybrid_layer_pattern="*-*",
                position_embedding_type="rope",
            )
        )
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11).expand(2, 11)
    labels = torch.roll(tokens, -1, dims=1)
    outputs = []
    for model in models:
        logits = model(tokens, positions, None)
        loss = model(tokens, positions, None, labels=labels)
        (logits.square().mean() + loss.mean()).backward()
        outputs.append((logits, loss, gradients(model)))
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = outputs
    assert torch.equal(logits_a, logits_b) and torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ],
    ids=["full-uniform", "full-block", "selective-core_attn"],
)
def test_recompute_sees_the_forest(build_model, forest_sequences, recompute):
    """Recomputed layers run in the backward pass, after the forward's scope closed; results match."""
    sequences = forest_sequences(seed=4, depth=3)
    layout = plan_shared_prefix(sequences, capacity=512).rows[0]
    results = []
    for options in ({}, recompute):
        model = build_model("*-*-", seed=2, **options)
        model.train()
        loss = model(None, None, None, shared_prefix_layout=layout)
        assert current_forest() is None
        (loss * torch.linspace(0.5, 1.5, len(loss))).sum().backward()
        assert current_forest() is None
        results.append((loss.detach(), gradients(model)))
    (loss_plain, grads_plain), (loss_recompute, grads_recompute) = results
    assert torch.equal(loss_plain, loss_recompute)
    for name, grad in grads_plain.items():
        assert torch.equal(grad, grads_recompute[name]), name


def test_scope_closes_when_the_forward_fails(build_model, forest_sequences):
    model = build_model("*-", seed=0)
    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]

    def fail(*_args, **_kwargs):
        assert current_forest() is not None
        raise RuntimeError("boom")

    handle = model.decoder.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(None, None, None, shared_prefix_layout=layout)
    handle.remove()
    assert current_forest() is None


def _layout_tensors(layout):
    return torch.tensor(layout.tokens)[None], torch.tensor(layout.position_ids)[None]


CONFIG_REJECTIONS = {
    "attention_dropout": 0.1,
    "hidden_dropout": 0.1,
    "window_size": (8, 0),
    "softmax_type": "off-by-one",
    "multi_latent_attention": True,
    "experimental_attention_variant": "dsa",
    "pipeline_model_parallel_size": 2,
    "context_parallel_size": 3,
    "cuda_graph_impl": "local",
    "fp8": "e4m3",
    "fp4": "e2m1",
}


@pytest.mark.parametrize("setting", sorted(CONFIG_REJECTIONS))
def test_rejects_unsupported_settings_before_compute(build_model, forest_sequences, setting):
    model = build_model("*-", seed=0)
    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]
    calls = []
    model.embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    setattr(model.config, setting, CONFIG_REJECTIONS[setting])
    with pytest.raises(ValueError, match=setting):
        model(None, None, None, shared_prefix_layout=layout)
    assert not calls and all(p.grad is None for p in model.parameters())


def test_rejects_parallel_settings_that_cannot_be_exact(build_model, forest_sequences):
    """What parallelism cannot run exactly is named before compute (multi-process runs of what
    can are in tests/unit_tests/distributed)."""
    model = build_model("*-", seed=0)
    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]
    assert layout.num_tokens % 2, "the row must not split into two equal chunks"
    calls = []
    model.embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    model.config.tensor_model_parallel_size, model.config.sequence_parallel = 2, True
    with pytest.raises(ValueError, match="pad_multiple a multiple of 2"):
        model(None, None, None, shared_prefix_layout=layout)
    model.config.num_moe_experts, model.config.sequence_parallel = 4, False
    with pytest.raises(ValueError, match="MoE layers and sequence_parallel=False"):
        model(None, None, None, shared_prefix_layout=layout)
    model.config.tensor_model_parallel_size, model.config.num_moe_experts = 1, None
    model.pre_process = False
    with pytest.raises(ValueError, match="set_input_tensor"):
        model(None, None, None, shared_prefix_layout=layout)
    assert not calls


@pytest.mark.parametrize(
    "argument",
    [
        "attention_mask",
        "decoder_input",
        "labels",
        "loss_mask",
        "packed_seq_params",
        "padding_mask",
        "inference_context",
    ],
)
def test_rejects_arguments_the_layout_defines(build_model, forest_sequences, argument):
    model = build_model("*-", seed=0)
    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]
    kwargs = {argument: torch.zeros(1)}
    positional = {name: kwargs.pop(name) for name in ("attention_mask",) if name in kwargs}
    with pytest.raises(ValueError, match=argument):
        model(None, None, positional.get("attention_mask"), shared_prefix_layout=layout, **kwargs)


def test_rejects_ids_that_do_not_match_the_layout(build_model, forest_sequences):
    model = build_model("*-", seed=0)
    layout = plan_shared_prefix(forest_sequences(seed=0, depth=2), capacity=512).rows[0]
    tokens, positions = _layout_tensors(layout)
    assert model(tokens, positions, None, shared_prefix_layout=layout).numel() == len(
        layout.edge_source
    )
    with pytest.raises(ValueError, match="input_ids"):
        model(tokens + 1, positions, None, shared_prefix_layout=layout)
    with pytest.raises(ValueError, match="position_ids"):
        model(tokens, torch.arange(layout.num_tokens)[None], None, shared_prefix_layout=layout)


def test_rejects_layers_and_tokens_it_cannot_run(megatron_world, build_model):
    from tiny import tiny_config

    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    with pytest.raises(ValueError, match="num_experts"):
        SharedPrefixHybridModel(
            tiny_config(num_layers=2, num_moe_experts=4, add_bias_linear=False),
            hybrid_stack_spec=hybrid_stack_spec(),
            vocab_size=64,
            max_sequence_length=64,
            hybrid_layer_pattern="*E",
        )
    model = build_model("*-", seed=0, vocab_size=8)
    layout = plan_shared_prefix([[1, 2, 9, 3]], capacity=64).rows[0]
    with pytest.raises(ValueError, match="vocab_size"):
        model(None, None, None, shared_prefix_layout=layout)
    with pytest.raises(ValueError, match="ForestLayout"):
        model(None, None, None, shared_prefix_layout=[[1, 2, 3]])


def test_row_without_supervised_targets(build_model):
    """A row whose sequences have no targets runs, returns [0] losses and leaves no gradient."""
    plan = plan_shared_prefix([[1, 2, 3, 4], [1, 2, 5]], [[False] * 4, [False] * 3], capacity=64)
    assert plan.loss_tokens == 0
    model = build_model("*-", seed=0)
    loss = model(None, None, None, shared_prefix_layout=plan.rows[0])
    assert loss.shape == (0,) and loss.dtype == torch.float32
    loss.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert all(torch.isnan(values).all() for values in plan.unpack_edges([loss.detach()]))
