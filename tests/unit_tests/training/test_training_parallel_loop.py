"""pretrain_hybrid.py under torchrun with Megatron's parallel flags on CPU (gloo), against the
single-process run of the same flags.

Every layout starts from the shards of the same TP = 1 network (``build_parallel_model``), keeps
the batch semantics of docs/training.md (each data-parallel rank plans its share into the fixed
number of rows per step) and reduces gradients as megatron.training does, so each step's loss and
gradient norm follow the single-process trajectory: equal within reduction-order noise on the
first step (rel 1e-5), and close after (rel 1e-3). Logical and supervised token counts are
those of the single-process run exactly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The checkout root (the directory holding tests/unit_tests), wherever this file is moved to.
ROOT = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)
FLAGS = (
    "--train-iters",
    "3",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--lr-warmup-iters",
    "0",
    # One padded vocabulary at every tensor-parallel size (64 = 32 x TP 2).
    "--make-vocab-size-divisible-by",
    "32",
    "--moe-token-dispatcher-type",
    "alltoall",
)
LAYOUTS = {
    "tp2_sp_ep2": (
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
    ),
    "pp2": ("--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|-E"),
    "dp2": (),
    "cp2": ("--context-parallel-size", "2"),
}
# With two MTP depths; layouts that keep the single-process run's rows (one data-parallel rank),
# so that megatron's per-micro-batch MTP normalization sees the same micro-batches.
MTP = ("--mtp-num-layers", "2")
MTP_LAYOUTS = {"tp2_sp_ep2": LAYOUTS["tp2_sp_ep2"], "cp2": LAYOUTS["cp2"]}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU loop's gloo runs")


def records(path):
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def torchrun(tmp_path, name, flags):
    metrics = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "pretrain_hybrid.py"),
        *FLAGS,
        *flags,
        "--shared-prefix-metrics-jsonl",
        str(metrics),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return records(metrics), done.stdout


def single_process_run(directory, flags=()):
    """The single-process run's metrics (a subprocess too, so its world is its own)."""
    path = directory / "metrics.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        os.path.join(ROOT, "pretrain_hybrid.py"),
        *FLAGS,
        *flags,
        "--shared-prefix-metrics-jsonl",
        str(path),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return records(path)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return single_process_run(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def single_process_mtp(tmp_path_factory):
    return single_process_run(tmp_path_factory.mktemp("single_mtp"), MTP)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_loop_follows_the_single_process_run(tmp_path, single_process, name):
    parallel, stdout = torchrun(tmp_path, name, LAYOUTS[name])
    assert "loop of 2 processes" in stdout
    assert [r["iteration"] for r in parallel] == [1, 2, 3]
    for step, (mine, reference) in enumerate(zip(parallel, single_process)):
        tolerance = 1e-5 if step == 0 else 1e-3
        assert abs(mine["loss"] - reference["loss"]) <= tolerance * reference["loss"], step
        assert (
            abs(mine["grad_norm"] - reference["grad_norm"])
            <= 10 * tolerance * reference["grad_norm"]
        ), step
        for field in ("logical_tokens", "loss_tokens", "consumed_samples"):
            assert mine[field] == reference[field], (step, field)


@pytest.mark.parametrize("name", sorted(MTP_LAYOUTS))
def test_parallel_loop_with_mtp_follows_the_single_process_run(tmp_path, single_process_mtp, name):
    """The MTP loss trains and is logged (``mtp_k loss``, reduced over the context-parallel
    ranks' shares) as in the single-process run."""
    parallel, _ = torchrun(tmp_path, f"mtp_{name}", (*MTP_LAYOUTS[name], *MTP))
    assert [r["iteration"] for r in parallel] == [1, 2, 3]
    for step, (mine, reference) in enumerate(zip(parallel, single_process_mtp)):
        tolerance = 1e-5 if step == 0 else 1e-3
        assert len(mine["mtp_losses"]) == len(reference["mtp_losses"]) == 2
        pairs = [(mine["loss"], reference["loss"])]
        pairs += list(zip(mine["mtp_losses"], reference["mtp_losses"]))
        for value, expected in pairs:
            assert abs(value - expected) <= tolerance * expected, step
        assert (
            abs(mine["grad_norm"] - reference["grad_norm"])
            <= 10 * tolerance * reference["grad_norm"]
        ), step
