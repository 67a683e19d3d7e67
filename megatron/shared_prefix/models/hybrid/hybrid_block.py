"""HybridStack with a final norm that does not require Transformer Engine.

megatron-core's HybridStack builds its final norm as ``TENorm``. Passing ``post_layer_norm=False``
to
the parent and adding the norm here keeps the parameter name (``final_norm.weight``) and the
parent's
forward, which applies ``final_norm`` whenever ``post_layer_norm`` is set.
"""

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


class SharedPrefixHybridStack(HybridStack):
    """HybridStack whose final norm is given by a spec parameter (a local torch norm by default).

    Args:
        final_norm: norm builder called as ``final_norm(config=, hidden_size=, eps=)``, e.g.
            ``TorchNorm`` (a local norm that supports sequence parallelism) or ``TENorm``.
        Everything else is HybridStack's.
    """

    def __init__(
        self, *args, final_norm: ModuleSpec | type, post_layer_norm: bool = True, **kwargs
    ):
        super().__init__(*args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm,
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
