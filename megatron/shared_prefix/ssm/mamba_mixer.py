"""Mamba mixer that runs on a prefix forest (upstream: megatron/core/ssm/mamba_mixer.py).

Swapped in through the ``mixer`` submodule of ``hybrid_stack_spec()``; with no forest in scope it is
exactly megatron-core's MambaMixer.
"""

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

install_mamba_ssm_fallback()

# pylint: disable=wrong-import-position
from megatron.core.ssm.mamba_mixer import MambaMixer  # noqa: E402

from megatron.shared_prefix.tensors import current_forest  # noqa: E402


class TreeMambaMixer(MambaMixer):
    """MambaMixer whose conv window and SSM state follow each token's root path in a forest."""

    def forward(self, hidden_states, inference_context=None, *, inference_params=None, packed_seq_params=None):
        if current_forest() is not None:
            raise NotImplementedError("Mamba layers on prefix forests are not implemented yet")
        return super().forward(
            hidden_states,
            inference_context,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
        )
