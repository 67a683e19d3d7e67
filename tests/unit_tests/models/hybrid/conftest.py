"""Builders of tiny models and the dense reference that forest forwards are compared with."""

import numpy as np
import pytest
import torch


def tiny_config(**overrides):
    """A float32 TransformerConfig small enough for CPU tests, with every layer type usable."""
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        mamba_state_dim=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        num_moe_experts=None,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        use_mamba_mem_eff_path=True,
        normalization="RMSNorm",
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


@pytest.fixture
def build_model(megatron_world):
    """``build_model(pattern, seed=0, vocab_size=64, **config)`` -> SharedPrefixHybridModel (float32)."""
    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    def build(pattern, *, seed=0, vocab_size=64, tied=False, mamba_chunk_size=8, **config):
        experts = config.get("num_moe_experts")
        config.setdefault("num_layers", len(pattern))
        torch.manual_seed(seed)
        return SharedPrefixHybridModel(
            tiny_config(**config),
            hybrid_stack_spec=hybrid_stack_spec(experts, mamba_chunk_size=mamba_chunk_size),
            vocab_size=vocab_size,
            max_sequence_length=512,
            hybrid_layer_pattern=pattern,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=tied,
        )

    return build
