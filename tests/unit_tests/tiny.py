"""Tiny float32 configurations for CPU model tests."""

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
