"""Run megatron-core's HybridModel on a machine without CUDA.

This module is the one place where the project adapts its dependency at run time (see
docs/architecture.md). Everything else swaps behaviour in through ModuleSpecs and subclasses.

megatron-core 0.19.2 assumes CUDA in a few places that a CPU run reaches (docs/architecture.md,
CPU enablement):

* ``torch.cuda.current_device()`` is used as an allocation device by the router, the Mamba mixer,
  RoPE and the global memory buffer;
* ``get_default_causal_mask`` allocates the causal mask on ``"cuda"``;
* the CUDA RNG tracker forks CUDA generator state, and activation recompute saves and restores the
  CUDA generator;
* megatron's DDP (``finish_grad_sync``) and the alltoall MoE dispatcher synchronize with
  ``torch.cuda.current_stream()``, and the dispatcher creates a ``torch.cuda.Stream`` when it is
  built and converts its split sizes to host numpy arrays only when they are CUDA tensors
  (``moe_utils.maybe_move_tensor_to_cpu``), so on a CPU they stay tensors;
* the pipeline schedules allocate their token counter with ``device="cuda"``, pipeline
  communication calls ``torch.cuda.synchronize()``, and with pipeline parallelism and tied
  embeddings ``LanguageModule.setup_embeddings_and_output_layer`` moves the last stage's copy of
  the word embedding with ``.cuda()`` before synchronizing it;
* megatron.training's ``validate_args`` asks for the GPU's architecture under tensor parallelism
  (``get_device_arch_version``) and then requires ``CUDA_DEVICE_MAX_CONNECTIONS=1``;
* ``MambaMixer`` binds mamba_ssm's ``RMSNorm``, ``mamba_chunk_scan_combined`` and
  ``mamba_split_conv1d_scan_combined`` when ``megatron.core.ssm.mamba_mixer`` is first imported.

:func:`enable_cpu` handles the first six when CUDA is absent (a host stream object stands in for
every CUDA stream: on a CPU all work is already ordered); :func:`install_mamba_ssm_fallback`
registers our pure-torch SSD implementation under mamba_ssm's module names when mamba_ssm cannot be
imported (on any machine), and is called before this package first imports the Mamba mixer.
"""

import contextlib
import functools
import os
import sys
import types

import torch

_MAMBA_SSM_MODULES = (
    "mamba_ssm",
    "mamba_ssm.ops",
    "mamba_ssm.ops.triton",
    "mamba_ssm.ops.triton.ssd_combined",
    "mamba_ssm.ops.triton.layernorm_gated",
)

_cpu_enabled = False  # pylint: disable=invalid-name


def _mamba_ssm_importable() -> bool:
    try:
        import mamba_ssm.ops.triton.layernorm_gated  # noqa: F401  pylint: disable=unused-import
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401  pylint: disable=unused-import
    except ImportError:
        return False
    return True


def install_mamba_ssm_fallback() -> bool:
    """Make the pure-torch SSD importable under mamba_ssm's names if mamba_ssm itself is not.

    Returns True when the fallback is (now) in use. Idempotent. Raises RuntimeError when
    ``megatron.core.ssm.mamba_mixer`` was already imported without mamba_ssm, because the mixer
    binds the kernels at import time and would keep its placeholders.
    """
    fallback = sys.modules.get("mamba_ssm.ops.triton.ssd_combined")
    if getattr(fallback, "__shared_prefix_fallback__", False):
        return True
    if _mamba_ssm_importable():
        return False
    mixer = sys.modules.get("megatron.core.ssm.mamba_mixer")
    # A call made while the mixer module itself is being imported (before it binds the kernels) is
    # in time; one after it finished without mamba_ssm is not.
    importing = getattr(getattr(mixer, "__spec__", None), "_initializing", False)
    if mixer is not None and not importing and not getattr(mixer, "HAVE_MAMBA_SSM", False):
        raise RuntimeError(
            "megatron.core.ssm.mamba_mixer was imported before mamba_ssm could be provided; "
            "import megatron.shared_prefix (or call enable_cpu()) before importing megatron-core's "
            "Mamba or hybrid modules"
        )
    from megatron.shared_prefix.ssm import torch_ssd

    for name in _MAMBA_SSM_MODULES:
        sys.modules.pop(name, None)
        module = types.ModuleType(name)
        module.__shared_prefix_fallback__ = True
        module.__doc__ = "megatron.shared_prefix pure-torch stand-in for mamba_ssm (cpu.py)."
        sys.modules[name] = module
    for name in _MAMBA_SSM_MODULES[1:]:
        parent, leaf = name.rsplit(".", 1)
        setattr(sys.modules[parent], leaf, sys.modules[name])
    ssd = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
    ssd.mamba_chunk_scan_combined = torch_ssd.mamba_chunk_scan_combined
    ssd.mamba_split_conv1d_scan_combined = torch_ssd.mamba_split_conv1d_scan_combined
    sys.modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm = torch_ssd.RMSNorm
    return True


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _no_cuda_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*_args, **_kwargs) -> None:
    return None


class _HostStream:
    """Stands in for a CUDA stream on a CPU, where every operation already runs in order."""

    def wait_stream(self, _other) -> None:
        """Nothing to wait for."""

    def wait_event(self, _event) -> None:
        """Nothing to wait for."""

    def record_event(self, _event=None) -> "_HostStream":
        """An event that is complete when recorded (this stream itself)."""
        return self

    def synchronize(self) -> None:
        """Nothing is pending."""

    def query(self) -> bool:
        """All work is complete."""
        return True


_HOST_STREAM = _HostStream()


class _HostTorch:
    """``torch`` as megatron's pipeline schedules see it on a CPU: a tensor they place on "cuda"
    is placed on the host; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        """torch.zeros, with ``device="cuda"`` meaning the host."""
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _no_device_work(*_args, **_kwargs) -> None:
    return None


def _no_device_architecture() -> int:
    """No CUDA architecture: megatron.training's pre-Blackwell rules apply."""
    return 0


def _on_host(method):
    """``method`` with ``Tensor.cuda()`` returning the tensor itself while it runs."""

    @functools.wraps(method)
    def run_on_host(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *_a, **_k: tensor
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return run_on_host


def _host_stream(*_args, **_kwargs) -> _HostStream:
    return _HOST_STREAM


def _host_stream_context(_stream) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` that also turns host tensors into numpy arrays."""
    del record_stream
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def enable_cpu() -> bool:
    """Let megatron-core's HybridModel (M, *, -, E layers) build and train on CPU.

    Idempotent. Where CUDA is available it changes nothing and returns False; otherwise it
    applies the adaptations listed in the module docstring and returns True. Call it before
    building a model; the caller still initializes ``torch.distributed`` and
    ``megatron.core.parallel_state`` as for any megatron-core model (a single gloo process works).
    """
    global _cpu_enabled  # pylint: disable=global-statement
    if torch.cuda.is_available():
        return False
    install_mamba_ssm_fallback()
    if _cpu_enabled:
        return True

    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.training import arguments as training_arguments

    torch.cuda.current_device = _cpu_current_device
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # The inference tracker forks no CUDA generator: parameters are initialized from torch's CPU
    # generator, which megatron's model_parallel_cuda_manual_seed does not touch.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Recompute saves/restores the CPU generator itself; there is no CUDA generator to keep.
    tp_random._get_cuda_rng_state = _no_cuda_rng_state  # pylint: disable=protected-access
    tp_random._set_cuda_rng_state = _ignore_cuda_rng_state  # pylint: disable=protected-access
    torch.cuda.current_stream = _host_stream
    torch.cuda.synchronize = _no_device_work
    schedules.torch = _HostTorch()
    LanguageModule.setup_embeddings_and_output_layer = _on_host(
        LanguageModule.setup_embeddings_and_output_layer
    )
    torch.cuda.stream = _host_stream_context
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HOST_STREAM
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    training_arguments.get_device_arch_version = _no_device_architecture
    # Megatron requires it with tensor parallelism before Blackwell; without CUDA it means nothing.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _cpu_enabled = True
    return True
