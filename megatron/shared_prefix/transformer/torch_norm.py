"""A torch LayerNorm / RMSNorm that supports sequence parallelism (upstream:
megatron/core/transformer/torch_norm.py, where WrappedTorchNorm would accept it).

megatron-core's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. A norm is token-wise,
so under sequence parallelism it runs unchanged on each rank's ``T / tp`` tokens; only its
gradient is partial: each tensor-parallel rank sees its own tokens. megatron's gradient
finalization sums the gradients of every parameter marked ``sequence_parallel`` over the
tensor-parallel group (as it does for Transformer Engine's norms), so this builder marks them.
"""

import torch
from megatron.core.transformer import TransformerConfig

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``, with
    every parameter marked ``sequence_parallel`` as ``config.sequence_parallel`` says.

    A class (constructed through ``__new__``, like WrappedTorchNorm) so that ModuleSpecs and
    ``build_module`` instantiate it. Takes the builder arguments of megatron-core norms
    (``config=, hidden_size=, eps=``) and raises ValueError, naming the setting, for options a
    torch norm does not have.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused
    ) -> torch.nn.Module:
        errors = [
            f"{name}=True"
            for name in (
                "layernorm_zero_centered_gamma",
                "persist_layer_norm",
                "memory_efficient_layer_norm",
            )
            if getattr(config, name)
        ]
        if config.normalization not in _NORMS:
            errors.append(f"normalization={config.normalization!r} (LayerNorm or RMSNorm)")
        if errors:
            raise ValueError(f"the local torch norm does not support {', '.join(errors)}")
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
