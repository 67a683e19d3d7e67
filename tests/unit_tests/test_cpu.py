"""enable_cpu and the pure-torch mamba_ssm fallback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The checkout root (the directory holding tests/unit_tests), wherever this file is moved to.
REPO = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)


def run_python(code):
    env = dict(os.environ, PYTHONPATH=REPO, TORCH_COMPILE_DISABLE="1")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU adaptations")
def test_enable_cpu_is_idempotent(megatron_world):
    from megatron.core.fusions import fused_softmax

    from megatron.shared_prefix import enable_cpu

    assert enable_cpu() is True
    patched = (torch.cuda.current_device, fused_softmax.get_default_causal_mask)
    assert enable_cpu() is True
    assert (torch.cuda.current_device, fused_softmax.get_default_causal_mask) == patched
    assert torch.cuda.current_device() == "cpu"
    assert torch.equal(
        fused_softmax.get_default_causal_mask(3), torch.ones(3, 3, dtype=torch.bool).triu(1)
    )


@pytest.mark.gpu
def test_enable_cpu_changes_nothing_with_cuda():
    result = run_python(
        "import torch; before = torch.cuda.current_device\n"
        "from megatron.shared_prefix import enable_cpu\n"
        "assert enable_cpu() is False and torch.cuda.current_device is before\n"
    )
    assert result.returncode == 0, result.stderr


def test_mixer_binds_the_torch_fallback_when_mamba_ssm_is_missing():
    result = run_python(
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('mamba_ssm') is not None: sys.exit(0)\n"
        "import megatron.shared_prefix.models.hybrid.hybrid_layer_specs\n"
        "from megatron.core.ssm import mamba_mixer\n"
        "from megatron.shared_prefix.ssm import torch_ssd\n"
        "assert mamba_mixer.HAVE_MAMBA_SSM\n"
        "assert mamba_mixer.mamba_split_conv1d_scan_combined is torch_ssd.mamba_split_conv1d_scan_combined\n"
        "assert mamba_mixer.mamba_chunk_scan_combined is torch_ssd.mamba_chunk_scan_combined\n"
        "assert issubclass(mamba_mixer.ExtendedRMSNorm, torch_ssd.RMSNorm)\n"
    )
    assert result.returncode == 0, result.stderr


def test_fallback_refuses_a_mixer_imported_without_it():
    """A mixer that bound placeholders cannot be helped afterwards: the fallback says so. A mixer
    that binds the fallback itself (megatron-core's, in the upstream stack, without CUDA) uses it.
    """
    result = run_python(
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('mamba_ssm') is not None: sys.exit(0)\n"
        "import megatron.core.ssm.mamba_mixer as mixer\n"
        "from megatron.shared_prefix.cpu import install_mamba_ssm_fallback\n"
        "if mixer.HAVE_MAMBA_SSM:\n"
        "    from megatron.shared_prefix.ssm import torch_ssd\n"
        "    assert install_mamba_ssm_fallback() is True\n"
        "    assert mixer.mamba_chunk_scan_combined is torch_ssd.mamba_chunk_scan_combined\n"
        "    sys.exit(0)\n"
        "try:\n"
        "    install_mamba_ssm_fallback()\n"
        "except RuntimeError as error:\n"
        "    assert 'before importing' in str(error)\n"
        "else:\n"
        "    sys.exit('no error')\n"
    )
    assert result.returncode == 0, result.stderr + result.stdout


def test_planner_import_needs_no_torch():
    """The planner and the layout import no torch. Where the API package's parents already import
    torch (upstream, megatron.core's own __init__ does), there is nothing to check."""
    result = run_python(
        "import sys\n"
        "import megatron.shared_prefix\n"
        "if 'torch' in sys.modules: sys.exit(3)\n"
        "from megatron.shared_prefix import plan_shared_prefix, ForestLayout\n"
        "assert 'torch' not in sys.modules, 'planner imported torch'\n"
    )
    if result.returncode == 3:
        pytest.skip("the package holding the planner imports torch itself")
    assert result.returncode == 0, result.stderr
