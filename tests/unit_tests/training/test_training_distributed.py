"""shutdown_parallel, in a fresh interpreter (the pytest process's own world stays up),
pin_triton_ptxas and mamba_ssm_kernels."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron.shared_prefix.training.distributed import mamba_ssm_kernels

ROOT = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)

SCRIPT = """
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.shared_prefix.training.distributed import init_single_process, shutdown_parallel

shutdown_parallel()
init_single_process("cpu")
assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()
shutdown_parallel()
assert not dist.is_initialized()
assert not parallel_state.model_parallel_is_initialized()
shutdown_parallel(synchronize=False)
init_single_process("cpu")
dist.all_reduce(__import__("torch").ones(1))
shutdown_parallel()
print("shut down")
"""


def test_shutdown_destroys_the_world_and_a_new_one_can_start():
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_COMPILE_DISABLE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("shut down")


def test_pin_triton_ptxas_uses_torchs_ptxas_and_keeps_an_explicit_one(tmp_path, monkeypatch):
    """pin_triton_ptxas points TRITON_PTXAS_PATH at PyTorch's bundled ptxas when it is an
    executable file, keeps a path already set, and leaves the variable unset (Triton's own) when
    PyTorch ships none or a non-executable one."""
    from megatron.shared_prefix.training.distributed import pin_triton_ptxas

    ptxas = tmp_path / "bin" / "ptxas"
    # The module by its own name: the exported PR stack moves it.
    monkeypatch.setattr(sys.modules[pin_triton_ptxas.__module__], "_torch_ptxas", lambda: ptxas)
    environ = {}
    assert pin_triton_ptxas(environ) is None and environ == {}  # none shipped
    ptxas.parent.mkdir()
    ptxas.write_text("")
    ptxas.chmod(0o644)
    assert pin_triton_ptxas(environ) is None and environ == {}  # not executable
    ptxas.chmod(0o755)
    assert pin_triton_ptxas(environ) == str(ptxas)
    assert environ == {"TRITON_PTXAS_PATH": str(ptxas)}
    explicit = {"TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas"}
    assert pin_triton_ptxas(explicit) == "/opt/cuda/bin/ptxas"
    assert explicit == {"TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas"}


def _mamba_ssm_with(monkeypatch, deterministic, cache_results):
    """Stand-ins for mamba_ssm's kernel module and determinism switches."""
    ssd_combined = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd_combined.mamba_chunk_scan_combined = lambda *args, **kwargs: None
    triton = types.ModuleType("mamba_ssm.ops.triton")
    triton.ssd_combined = ssd_combined
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton", triton)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", ssd_combined)
    determinism = types.ModuleType("mamba_ssm.utils.determinism")
    determinism.use_deterministic_mode = lambda: deterministic
    determinism.TRITON_HAS_CACHE_RESULTS = cache_results
    utils = types.ModuleType("mamba_ssm.utils")
    utils.determinism = determinism
    monkeypatch.setitem(sys.modules, "mamba_ssm", types.ModuleType("mamba_ssm"))
    monkeypatch.setitem(sys.modules, "mamba_ssm.utils", utils)
    monkeypatch.setitem(sys.modules, "mamba_ssm.utils.determinism", determinism)


@pytest.mark.parametrize(
    "deterministic, cache_results, cache_env, expected",
    [
        (False, True, "1", "autotuned in each process"),
        (True, True, None, "deterministic, cheapest configurations"),
        (True, True, "1", "deterministic, autotuned once into TRITON_CACHE_DIR"),
        (True, False, "1", "deterministic, cheapest configurations"),
    ],
)
def test_mamba_ssm_kernels_names_the_mode_the_run_got(
    monkeypatch, deterministic, cache_results, cache_env, expected
):
    _mamba_ssm_with(monkeypatch, deterministic, cache_results)
    if cache_env is None:
        monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", cache_env)
    assert expected in mamba_ssm_kernels()


def test_mamba_ssm_kernels_names_the_fallback(monkeypatch):
    fallback = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    fallback.__shared_prefix_fallback__ = True
    triton = types.ModuleType("mamba_ssm.ops.triton")
    triton.ssd_combined = fallback
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton", triton)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", fallback)
    assert mamba_ssm_kernels() == "pure-torch SSD (mamba_ssm not installed)"
