"""Tensor-parallel and recompute helpers of megatron.shared_prefix (upstream: megatron/core/tensor_parallel/)."""
