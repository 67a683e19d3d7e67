"""shutdown_parallel, in a fresh interpreter (the pytest process's own world stays up), and
pin_triton_ptxas."""

import os
import subprocess
import sys
from pathlib import Path

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
