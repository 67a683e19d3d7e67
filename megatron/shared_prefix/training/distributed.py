"""A one-process torch.distributed world with megatron-core's parallel state, for one device.

The single-process trainer, the tests and the benchmarks build megatron-core modules outside
``megatron.training`` (which initializes its own world); they share this set-up.
"""

import socket

import torch


def init_single_process(device: torch.device | str, seed: int = 0) -> None:
    """Initialize torch.distributed (world size 1) and megatron-core's parallel state (TP = PP = 1).

    Idempotent. On a CPU device it first calls :func:`megatron.shared_prefix.cpu.enable_cpu`; on
    CUDA it seeds megatron's CUDA RNG tracker with ``seed``, which Mamba and MoE layers need to be
    built.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron.shared_prefix.cpu import enable_cpu

    device = torch.device(device)
    if device.type == "cpu":
        enable_cpu()
    if not dist.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
