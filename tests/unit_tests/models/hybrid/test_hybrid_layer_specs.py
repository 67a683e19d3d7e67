"""hybrid_stack_spec builds a HybridModel of every supported layer type that trains on CPU."""

import pytest
import torch

PATTERN = "M*-ME"


@pytest.fixture
def moe_model(build_model):
    return build_model(PATTERN, seed=0, num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)


def test_builds_every_layer_type_from_local_modules(moe_model):
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention
    from megatron.shared_prefix.ssm.mamba_mixer import TreeMambaMixer

    layers = moe_model.decoder.layers
    assert isinstance(layers[0], MambaLayer) and isinstance(layers[0].mixer, TreeMambaMixer)
    assert isinstance(layers[1].self_attention.core_attention, TreeDotProductAttention)
    assert isinstance(layers[4].mlp, MoELayer)
    assert "decoder.final_norm.weight" in dict(moe_model.named_parameters())
    assert not any("transformer_engine" in type(m).__module__ for m in moe_model.modules())


def test_forward_backward_gives_every_parameter_a_finite_gradient(moe_model):
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(13).expand(2, 13)
    loss = moe_model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    assert loss.shape == (2, 13)
    loss.mean().backward()
    for name, param in moe_model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name


def test_outputs_are_causal(moe_model):
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16)[None]
    with torch.no_grad():
        logits = moe_model(tokens, positions, None)
        changed = tokens.clone()
        changed[0, 9] = (changed[0, 9] + 1) % 64
        perturbed = moe_model(changed, positions, None)
    assert torch.equal(logits[:, :9], perturbed[:, :9])
    assert not torch.equal(logits[:, 9:], perturbed[:, 9:])


def test_expert_counts_add_up_to_topk_times_tokens(build_model):
    moe_model = build_model(
        PATTERN,
        num_moe_experts=4,
        moe_router_topk=2,
        add_bias_linear=False,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
    )
    router = moe_model.decoder.layers[4].mlp.router
    router.local_tokens_per_expert.zero_()
    tokens = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    moe_model(tokens, torch.arange(7).expand(3, 7), None)
    assert int(router.local_tokens_per_expert.sum()) == 2 * tokens.numel()


def test_rejects_bad_spec_arguments():
    from megatron.shared_prefix import hybrid_stack_spec

    with pytest.raises(ValueError, match="num_experts"):
        hybrid_stack_spec(0)
    with pytest.raises(ValueError, match="mamba_chunk_size"):
        hybrid_stack_spec(mamba_chunk_size=0)
    with pytest.raises(ValueError, match="tree_backend|attention_backend"):
        from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention

        TreeDotProductAttention.__init__(
            object.__new__(TreeDotProductAttention), tree_backend="fast"
        )
