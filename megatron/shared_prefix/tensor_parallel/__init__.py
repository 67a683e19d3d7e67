"""Tensor-parallel and recompute helpers (upstream: megatron/core/tensor_parallel/)."""
