"""Forests under TP, SP, EP, DP, PP and CP, with and without MTP: multi-process gloo jobs on CPU
against the TP = 1 dense reference (parallel_cases.py runs the cases; one launched job per world
size).

Tolerances are the exactness contract's (docs/architecture.md): per-edge losses rel 1e-5, every
gradient rel 1e-4 after megatron's reductions; MoE expert counts equal. Two cases also replay the
parallel step and compare losses and gradients bit for bit (kernel-determinism manifest).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4

JOBS = {
    2: [
        "tp2",
        "tp2_tied_learned",
        "tp2_sp",
        "tp2_sp_moe_allgather",
        "tp2_sp_moe_alltoall",
        "ep2_dp2_allgather",
        "ep2_dp2_alltoall",
        "pp2",
        "pp2_moe_tied",
        "dp2",
        "cp2",
        "cp2_moe_tied",
        "cp2_branch_points",
        "tp2_sp_mtp",
        "cp2_mtp",
        "cp2_mtp_megatron",
        "pp2_mtp",
        "pp2_mtp_tied",
        "ep2_mtp_alltoall",
        "tp2_sp_output_chunks",
        "cp2_mtp_output_chunks",
        "reject_ep2_allgather_unequal_rows",
        "vocab_parallel_edge_loss_tp2",
    ],
    4: [
        "tp4",
        "tp4_sp_moe",
        "tp2_sp_ep2_alltoall",
        "tp2_sp_ep2_allgather",
        "pp2_tp2_sp",
        "cp4",
        "cp4_branch_points",
        "cp2_tp2_sp",
        "cp2_ep2_alltoall",
        "cp2_tp2_sp_mtp",
        "cp2_tp2_sp_output_chunks",
        "vocab_parallel_edge_loss_tp4",
    ],
}
CASES = [(world, name) for world, names in JOBS.items() for name in names]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the gloo CPU jobs; on GPUs the NCCL runs cover this"
)


def launch(world_size: int, names: list[str], out_path: str, timeout: int = 600) -> dict:
    """Run ``names`` in one torchrun job of ``world_size`` processes; rank 0's results."""
    # TRITON_INTERPRET: the edge loss's Triton kernels run interpreted on CPU tensors (nothing else
    # launches Triton on CPU).
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        PYTHONWARNINGS="ignore",
        TRITON_INTERPRET="1",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        os.path.join(HERE, "parallel_cases.py"),
        out_path,
        *names,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not os.path.exists(out_path):
        raise AssertionError(f"torchrun job failed ({done.returncode}):\n{done.stderr[-4000:]}")
    with open(out_path, encoding="utf-8") as results:
        return json.load(results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world size -> case -> result, each job launched once, on first use (a failed job fails
    every case of it, with its report, rather than being launched again)."""
    cache = {}

    def get(world_size: int) -> dict:
        if world_size not in cache:
            out = tmp_path_factory.mktemp(f"world{world_size}") / "results.json"
            try:
                cache[world_size] = launch(world_size, JOBS[world_size], str(out))
            except (AssertionError, subprocess.TimeoutExpired) as failure:
                cache[world_size] = failure
        if isinstance(cache[world_size], Exception):
            raise cache[world_size]
        return cache[world_size]

    return get


@pytest.mark.parametrize("world_size,name", CASES, ids=[name for _, name in CASES])
def test_parallel_forest_matches_dense(results, world_size, name):
    result = results(world_size)[name]
    assert "error" not in result, result.get("error")
    if name.startswith("reject_"):
        assert result["rejected"], result
        return
    if name.startswith("vocab_parallel_edge_loss"):
        # float32 math on float32 logits against float64, on both paths.
        for path in ("torch", "kernels"):
            assert result[f"{path}_loss_error"] <= 1e-6, result
            assert result[f"{path}_grad_error"] <= 1e-6, result
        assert result["overwrite_bitwise"], result
        return
    assert result["loss_error"] <= LOSS_TOLERANCE, result
    assert result["grad_error"] <= GRAD_TOLERANCE, result
    assert not result["missing_grads"], result
    assert result["grads_compared"] > 10, result
    assert result["tp_ranks_agree"], result
    assert result["every_edge_once"], result
    assert result["mtp_agree"], result
    if "counts_equal" in result:
        assert result["counts_equal"], result
    if "replay_bitwise" in result:
        assert result["replay_bitwise"], result
