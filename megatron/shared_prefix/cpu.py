"""Run megatron-core's HybridModel on a machine without CUDA.

This module is the one place where the project adapts its dependency at run time (see
docs/architecture.md). Everything else swaps behaviour in through ModuleSpecs and subclasses.

megatron-core 0.19.2 assumes CUDA in a few places that a CPU run reaches (docs/architecture.md, CPU enablement):

* ``torch.cuda.current_device()`` is used as an allocation device by the router, the Mamba mixer,
  RoPE and the global memory buffer;
* ``get_default_causal_mask`` allocates the causal mask on ``"cuda"``;
* the CUDA RNG tracker forks CUDA generator state, and activation recompute saves and restores the
  CUDA generator;
* ``MambaMixer`` binds mamba_ssm's ``RMSNorm``, ``mamba_chunk_scan_combined`` and
  ``mamba_split_conv1d_scan_combined`` when ``megatron.core.ssm.mamba_mixer`` is first imported.

:func:`enable_cpu` handles the first three when CUDA is absent; :func:`install_mamba_ssm_fallback`
registers our pure-torch SSD implementation under mamba_ssm's module names when mamba_ssm cannot be
imported (on any machine), and is called before this package first imports the Mamba mixer.
"""

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
    if mixer is not None and not getattr(mixer, "HAVE_MAMBA_SSM", False):
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
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils

    torch.cuda.current_device = _cpu_current_device
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # The inference tracker forks no CUDA generator: parameters are initialized from torch's CPU
    # generator, which megatron's model_parallel_cuda_manual_seed does not touch.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Recompute saves/restores the CPU generator itself; there is no CUDA generator to keep.
    tp_random._get_cuda_rng_state = _no_cuda_rng_state  # pylint: disable=protected-access
    tp_random._set_cuda_rng_state = _ignore_cuda_rng_state  # pylint: disable=protected-access
    _cpu_enabled = True
    return True
