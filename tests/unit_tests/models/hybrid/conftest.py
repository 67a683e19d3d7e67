"""Builders of tiny models and the dense reference that forest forwards are compared with."""

import pytest
import torch
from tiny import tiny_config  # noqa: F401  (re-exported for tests that build configs)


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
