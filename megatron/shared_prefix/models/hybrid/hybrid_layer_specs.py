"""Layer specs for shared-prefix hybrid models (upstream:
megatron/core/models/hybrid/hybrid_layer_specs.py).

``hybrid_stack_spec()`` covers every layer type a HybridModel pattern can hold that a forest
supports (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE), and MTP depths of them. It is built
from megatron-core's local (non-Transformer-Engine) modules unless the caller asks for Transformer
Engine, so it builds and runs on a machine without CUDA (after
:func:`megatron.shared_prefix.enable_cpu`). The tree-aware pieces are swapped in as submodules: the
core attention, the Mamba mixer, the MoE router and the MTP layer; the rest is stock megatron-core.
"""

from functools import partial
from typing import Optional

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

# megatron-core's Mamba mixer binds mamba_ssm's kernels when it is first imported (below): provide
# the pure-torch fallback first where mamba_ssm is missing. The package __init__ does it too, but
# this module must not depend on which package imported it first.
install_mamba_ssm_fallback()

# pylint: disable=wrong-import-position
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention
from megatron.shared_prefix.models.hybrid.hybrid_block import SharedPrefixHybridStack
from megatron.shared_prefix.moe import tree_moe_module_spec
from megatron.shared_prefix.ssm.mamba_mixer import TreeMambaMixer
from megatron.shared_prefix.transformer.multi_token_prediction import tree_mtp_block_spec
from megatron.shared_prefix.transformer.torch_norm import TorchNorm


def _transformer_engine_modules():
    try:
        from megatron.core.extensions.transformer_engine import (
            HAVE_TE,
            TEColumnParallelLinear,
            TELayerNormColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )
    except ImportError:
        HAVE_TE = False
    if not HAVE_TE:
        raise ValueError(
            "hybrid_stack_spec(use_te=True) needs Transformer Engine, which cannot be imported "
            "here; "
            "use use_te=False for megatron-core's local modules"
        )
    return TELayerNormColumnParallelLinear, TERowParallelLinear, TENorm, TEColumnParallelLinear


def hybrid_stack_spec(
    num_experts: Optional[int] = None,
    *,
    use_te: bool = False,
    mamba_chunk_size: int = 128,
    attention_backend: str = "auto",
) -> ModuleSpec:
    """ModuleSpec of a HybridStack whose layers run on packed prefix forests.

    Args:
        num_experts: number of routed experts, as megatron-core's ``get_moe_module_spec`` takes it;
            required only when the layer pattern has ``E`` layers (the config's ``num_moe_experts``
            must match).
        use_te: use Transformer Engine linear layers and norms (fused layer-norm + linear, as
            megatron-core's own hybrid spec does). Requires Transformer Engine; the core attention
            and
            the Mamba scan stay the tree-aware local implementations.
        mamba_chunk_size: chunk size of the Mamba SSD scan.
        attention_backend: tree attention backend, "auto" (FlexAttention on CUDA, torch elsewhere),
            "flex", "torch" or "flash" (flash attention passes; see TreeDotProductAttention).

    Returns:
        ModuleSpec of :class:`SharedPrefixHybridStack` for ``HybridModel(hybrid_stack_spec=...)``.
    """
    if num_experts is not None and num_experts < 1:
        raise ValueError(f"hybrid_stack_spec: num_experts must be >= 1 or None, got {num_experts}")
    if mamba_chunk_size < 1:
        raise ValueError(
            f"hybrid_stack_spec: mamba_chunk_size must be >= 1, got {mamba_chunk_size}"
        )

    if use_te:
        norm_linear, row_linear, final_norm, mtp_linear = _transformer_engine_modules()
        input_norm, column_linear = IdentityOp, norm_linear
    else:
        input_norm, column_linear, row_linear = (
            TorchNorm,
            ColumnParallelLinear,
            RowParallelLinear,
        )
        final_norm, mtp_linear = TorchNorm, ColumnParallelLinear

    mamba_layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=input_norm,
            mixer=ModuleSpec(
                module=TreeMambaMixer,
                params={"chunk_size": mamba_chunk_size},
                submodules=MambaMixerSubmodules(in_proj=column_linear, out_proj=row_linear),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column_linear,
                    core_attention=ModuleSpec(
                        module=TreeDotProductAttention, params={"tree_backend": attention_backend}
                    ),
                    linear_proj=row_linear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=input_norm,
            mlp=partial(
                MLP.as_mlp_submodule,
                submodules=MLPSubmodules(linear_fc1=column_linear, linear_fc2=row_linear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    submodules = HybridStackSubmodules(
        mamba_layer=mamba_layer,
        attention_layer=attention_layer,
        mlp_layer=mlp_layer,
        # Used when hybrid_layer_pattern has MTP depths ("<main>/<mtp>/<mtp>"); each depth's
        # layers are built from the layer specs above.
        mtp_block_spec=tree_mtp_block_spec(final_norm, mtp_linear),
    )
    if num_experts is not None:
        submodules.moe_layer = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=final_norm,
                # Row padding stays out of the expert-bias counts (TreeTopKRouter's count_padding);
                # replace this mlp with tree_moe_module_spec(..., count_padding=True) to count it.
                mlp=tree_moe_module_spec(
                    use_te=use_te, num_experts=num_experts, count_padding=False
                ),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    return ModuleSpec(
        module=SharedPrefixHybridStack, params={"final_norm": final_norm}, submodules=submodules
    )
