"""Shared-prefix HybridModel, its stack and layer specs (upstream: megatron/core/models/hybrid/).

Importing this package first makes mamba_ssm's names importable (the pure-torch fallback of cpu.py,
used only when mamba_ssm itself cannot be imported), because megatron-core's Mamba mixer binds them
when it is first imported.
"""

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

install_mamba_ssm_fallback()
