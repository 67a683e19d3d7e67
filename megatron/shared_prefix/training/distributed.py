"""torch.distributed worlds with megatron-core's parallel state, for code outside megatron.training.

megatron.training initializes its own world (``pretrain``). The single-process trainer, the tests,
the benchmarks and multi-process jobs launched with ``torchrun`` build megatron-core modules without
it; they share these two set-ups:

* :func:`init_single_process`: world size 1 (TP = PP = 1), e.g. inside a pytest process;
* :func:`init_parallel`: the world ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``), gloo on CPU and NCCL on CUDA, with the tensor, pipeline,
  expert and context parallel sizes given; data parallelism takes the remaining factor of the world
  size, as in megatron.training.

:func:`shutdown_parallel` tears a world down again before the process exits. On CUDA both first
pin the ptxas that Triton compiles with (:func:`pin_triton_ptxas`), as ``pretrain_hybrid.py`` does.
"""

import datetime
import os
import socket
from pathlib import Path
from typing import MutableMapping, Optional

import torch

from megatron.shared_prefix.ssm.tree_scan import triton_chunk_scan


def _torch_ptxas() -> Path:
    """The ptxas that PyTorch ships (present in its CUDA builds that bundle one)."""
    return Path(torch.__file__).resolve().parent / "bin" / "ptxas"


def pin_triton_ptxas(environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Make every Triton compile of this process use one ptxas: PyTorch's own, where it ships one.

    Triton's kernel cache is keyed by, among others, the ptxas version. Inductor points Triton at
    PyTorch's ptxas (``TRITON_PTXAS_PATH``) the first time it compiles in a process, but not when
    its kernels all come from its cache. So a process that compiled FlexAttention cached its Mamba
    kernels under one ptxas, and a later process, finding FlexAttention in the Inductor cache, looked
    them up under the other and compiled all of them again (measured on an H200: 41 kernels, 17 s
    of a warm process's first step); within one process, kernels compiled before and after
    Inductor's first compile also came from different ptxas builds. Setting the variable before
    anything compiles makes Inductor keep it and every process agree.

    Returns the ptxas in effect (None: Triton's own). An explicit ``TRITON_PTXAS_PATH`` is kept.
    """
    if environ.get("TRITON_PTXAS_PATH"):
        return environ["TRITON_PTXAS_PATH"]
    ptxas = _torch_ptxas()
    if ptxas.is_file() and os.access(ptxas, os.X_OK):
        environ["TRITON_PTXAS_PATH"] = str(ptxas)
        return str(ptxas)
    return None


def mamba_ssm_kernels() -> str:
    """How this process runs mamba_ssm's kernels, for the start-up log line.

    Its deterministic mode (docs/training.md, Compilation and warm-up) decides both speed and
    bitwise repeatability, and pretrain_hybrid.py turns it on unless ``MAMBA_DETERMINISTIC`` is
    set, so a run says which mode it got.
    """
    if triton_chunk_scan() is None:
        return "pure-torch SSD (mamba_ssm not installed)"
    try:
        from mamba_ssm.utils import determinism
    except ImportError:  # a mamba_ssm without a deterministic mode
        return "mamba_ssm autotuned in each process"
    if not determinism.use_deterministic_mode():
        return "mamba_ssm autotuned in each process, atomic backward sums (MAMBA_DETERMINISTIC=0)"
    cached = os.environ.get("TRITON_CACHE_AUTOTUNING") == "1"
    if cached and determinism.TRITON_HAS_CACHE_RESULTS:
        return "mamba_ssm deterministic, autotuned once into TRITON_CACHE_DIR"
    return "mamba_ssm deterministic, cheapest configurations (MAMBA_DETERMINISTIC=1)"


def _prepare_device(device: torch.device, seed: int) -> None:
    from megatron.core import tensor_parallel

    from megatron.shared_prefix.cpu import enable_cpu

    if device.type == "cpu":
        enable_cpu()
    else:
        pin_triton_ptxas()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_single_process(device: torch.device | str, seed: int = 0) -> None:
    """Initialize torch.distributed (world size 1) and megatron-core's parallel state (TP = PP = 1).

    Idempotent. On a CPU device it first calls :func:`megatron.shared_prefix.cpu.enable_cpu`; on
    CUDA it seeds megatron's CUDA RNG tracker with ``seed``, which Mamba and MoE layers need to be
    built.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    device = torch.device(device)
    if device.type == "cpu":
        _prepare_device(device, seed)
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
        _prepare_device(device, seed)


def init_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    device: Optional[torch.device | str] = None,
    seed: int = 0,
    timeout_minutes: int = 10,
) -> torch.device:
    """Join the ``torchrun`` world and (re)initialize megatron-core's parallel state for a layout.

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size,
            context_parallel_size, expert_tensor_parallel_size: megatron's parallel sizes; their
            product with the data-parallel size is the world size (checked here, naming the
            sizes, before any group is created).
        device: where this rank computes; default ``cuda:LOCAL_RANK`` when CUDA is available,
            else the CPU.
        seed: seeds megatron's CUDA RNG tracker on CUDA (the CPU path uses torch's generator).
        timeout_minutes: collective timeout of the process group.

    Returns:
        The rank's device.

    The process group is created once (gloo on CPU, NCCL on CUDA, from torchrun's environment; a
    plain process outside torchrun becomes a world of one). Calling again with other sizes
    destroys megatron's parallel state and builds the new layout on the same world, so one job
    can run cases at several layouts (the multi-process tests do).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if device is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    model_parallel *= context_parallel_size
    sizes = (
        f"tensor_model_parallel_size={tensor_model_parallel_size} x "
        f"pipeline_model_parallel_size={pipeline_model_parallel_size} x "
        f"context_parallel_size={context_parallel_size}"
    )
    if min(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size) < 1:
        raise ValueError(f"init_parallel: every parallel size must be >= 1, got {sizes}")
    if world_size % model_parallel:
        raise ValueError(f"init_parallel: {sizes} does not divide the world size {world_size}")
    data_parallel = world_size // model_parallel
    expert_tp = expert_tensor_parallel_size or tensor_model_parallel_size
    if expert_model_parallel_size < 1 or (
        (data_parallel * context_parallel_size * tensor_model_parallel_size)
        % (expert_model_parallel_size * expert_tp)
    ):
        raise ValueError(
            f"init_parallel: expert_model_parallel_size={expert_model_parallel_size} x "
            f"expert_tensor_parallel_size={expert_tp} must divide the ranks of one pipeline stage "
            f"({world_size // pipeline_model_parallel_size})"
        )
    if device.type == "cpu":
        _prepare_device(device, seed)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                rank=int(os.environ.get("RANK", "0")),
                world_size=world_size,
                timeout=datetime.timedelta(minutes=timeout_minutes),
            )
        else:
            init_single_process(device, seed)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    if device.type == "cuda":
        _prepare_device(device, seed)
    return device


def shutdown_parallel(*, synchronize: bool = True) -> None:
    """Destroy megatron-core's parallel state and the process group, before the process exits.

    A gloo group left to interpreter finalization can abort a rank that finished its work
    ("terminate called without an active exception", SIGABRT): gloo's worker threads still hold
    work objects whose tensors need the interpreter being torn down. ``synchronize`` first waits
    at a barrier so that no rank tears down while a peer still communicates; pass ``False`` on an
    error path, where a peer may never reach the barrier. A no-op without a process group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    if synchronize:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
