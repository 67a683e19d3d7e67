"""shutdown_parallel, in a fresh interpreter: the pytest process's own world stays up."""

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
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("shut down")
