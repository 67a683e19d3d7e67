"""Tiny float32 configurations for CPU model tests, a small bf16 one for GPU tests, and the
seeding of a model's initialization."""

import torch

# A small bf16 model as Megatron builds one (MambaLayer casts its input to config.params_dtype),
# for GPU tests: ``tiny_config`` overrides plus the Mamba chunk size of the stack spec; dimensions
# the Triton kernels take (tl.dot needs at least 16 along each side).
GPU_BF16_MODEL = dict(
    mamba_chunk_size=64,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=512,
    mamba_head_dim=32,
    mamba_state_dim=32,
    params_dtype=torch.bfloat16,
    bf16=True,
)


def seed_initialization(seed):
    """Seed a model's parameter initialization: ``torch.manual_seed``, and megatron's CUDA RNG
    tracker where CUDA exists. megatron-core's MambaMixer initializes its conv and dt parameters
    on the CUDA device inside the tracker's fork, whose state ``torch.manual_seed`` does not reset:
    without it two builds of one seed differ on a GPU."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


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
