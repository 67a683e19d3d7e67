"""Session setup shared by every test: CPU enablement and a single-process megatron-core world."""

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests where CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed with one process and megatron-core's parallel state (TP = PP = 1)."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.shared_prefix import enable_cpu

    enable_cpu()
    if not dist.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group(
            backend="nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield
