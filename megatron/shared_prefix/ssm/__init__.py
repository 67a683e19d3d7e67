"""Mamba (SSM) support for shared-prefix training.

``torch_ssd`` is a pure-PyTorch implementation of the mamba_ssm functions that megatron-core's
``MambaMixer`` calls (chunked SSD scan, split-conv scan, gated RMSNorm): the CPU backend when
mamba_ssm is absent and the oracle its Triton kernels are tested against. ``reference`` holds slow,
per-token sequential oracles for tests.
"""
