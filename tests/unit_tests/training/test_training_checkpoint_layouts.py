"""Checkpoints across parallel layouts: a run saved at one (TP, SP, PP, EP, CP, DP) layout resumes
at another and continues the uninterrupted run's trajectory (multi-process gloo on CPU).

The uninterrupted run is a single process at TP = 1, saving at iterations 4 and 8. From its
iteration 4, runs at TP2 + SP, PP2, EP2 and CP2 (two processes each) resume; from the TP2 + SP
run's own iteration 8, a TP = 1 run (two data-parallel processes) resumes. Each resumed step's
loss equals the uninterrupted run's: rel 1e-5 on the first resumed step (the restored weights,
optimizer moments and data position; only reduction order differs) and 1e-3 on the next four.
All runs share --train-iters (the schedule's length) and stop early with --exit-interval. Also:
Megatron's fine-tuning flags, --no-load-optim, the seed checkpoint of iteration 0, and a model
with MTP depths saved at TP = 1 and resumed at TP2 + SP.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.shared_prefix.training.checkpointing import read_header
from megatron.shared_prefix.training.integrity import intact_iterations

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)
FLAGS = [
    "--train-iters",
    "13",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--lr-warmup-iters",
    "0",
    "--make-vocab-size-divisible-by",
    "32",
    "--moe-token-dispatcher-type",
    "alltoall",
]
LAYOUTS = {
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|-E"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
}
FIRST_STEP, LATER_STEPS = 1e-5, 1e-3

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU loop's gloo runs")


def records(path):
    with open(path, encoding="utf-8") as lines:
        return {r["iteration"]: r for r in map(json.loads, lines)}


def environment():
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    )


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(the uninterrupted run's metrics by iteration, {name: resumed metrics}, directories)."""
    tmp = tmp_path_factory.mktemp("layouts")
    reference_dir = str(tmp / "tp1")
    command = [
        sys.executable,
        os.path.join(ROOT, "pretrain_hybrid.py"),
        *FLAGS,
        "--save",
        reference_dir,
        "--save-interval",
        "4",
        "--exit-interval",
        "13",
        "--shared-prefix-metrics-jsonl",
        str(tmp / "tp1.jsonl"),
    ]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # A model with two MTP depths: saved at TP1, resumed at TP2 + SP.
    mtp_dir = str(tmp / "mtp_tp1")
    mtp_flags = [*FLAGS, "--mtp-num-layers", "2", "--exit-interval", "6"]
    command = [sys.executable, os.path.join(ROOT, "pretrain_hybrid.py"), *mtp_flags]
    command += ["--save", mtp_dir, "--save-interval", "3"]
    command += ["--shared-prefix-metrics-jsonl", str(tmp / "mtp_tp1.jsonl")]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs, directories = [], {"tp1": reference_dir, "mtp_tp1": mtp_dir}
    runs.append([*mtp_flags, *LAYOUTS["tp2_sp"], "--load", mtp_dir, "--ckpt-step", "3"])
    runs[-1] += ["--shared-prefix-metrics-jsonl", str(tmp / "mtp_tp2_sp.jsonl")]
    for name, layout in LAYOUTS.items():
        directories[name] = str(tmp / name)
        runs.append(
            [
                *FLAGS,
                *layout,
                "--load",
                reference_dir,
                "--ckpt-step",
                "4",
                "--save",
                directories[name],
                "--save-interval",
                "4",
                "--exit-interval",
                "8" if name == "tp2_sp" else "9",
                "--shared-prefix-metrics-jsonl",
                str(tmp / f"{name}.jsonl"),
            ]
        )
    # Megatron's fine-tuning flags: the weights of iteration 8, a fresh optimizer and schedule.
    runs.append([*FLAGS, "--load", reference_dir, "--ckpt-step", "8", "--finetune"])
    runs[-1] += ["--exit-interval", "3", "--shared-prefix-metrics-jsonl", str(tmp / "ft.jsonl")]
    runs.append([*FLAGS, *LAYOUTS["tp2_sp"], "--pretrained-checkpoint", reference_dir])
    runs[-1] += ["--ckpt-step", "8", "--exit-interval", "3"]
    runs[-1] += ["--shared-prefix-metrics-jsonl", str(tmp / "pretrained.jsonl")]
    # The same position with a fresh optimizer and schedule (and the negative control of the
    # comparisons: later steps must then leave the uninterrupted trajectory).
    runs.append([*FLAGS, "--load", reference_dir, "--ckpt-step", "4", "--no-load-optim"])
    runs[-1] += ["--exit-interval", "6", "--shared-prefix-metrics-jsonl", str(tmp / "noopt.jsonl")]
    # The seed checkpoint: iteration 0 written at PP2, started from at TP1.
    directories["seed"] = str(tmp / "seed")
    runs.append([*FLAGS, *LAYOUTS["pp2"], "--train-iters", "0", "--save", directories["seed"]])
    runs[-1] += ["--save-interval", "1"]
    runs.append([*FLAGS, "--pretrained-checkpoint", directories["seed"], "--exit-interval", "3"])
    runs[-1] += ["--shared-prefix-metrics-jsonl", str(tmp / "seed.jsonl")]
    runs.append(
        [
            *FLAGS,
            "--load",
            directories["tp2_sp"],
            "--ckpt-step",
            "8",
            "--shared-prefix-metrics-jsonl",
            str(tmp / "tp2_sp_to_tp1.jsonl"),
        ]
    )
    (tmp / "runs.json").write_text(json.dumps(runs))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(HERE, "checkpoint_layout_runs.py"),
        str(tmp / "runs.json"),
    ]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = [
        *LAYOUTS,
        "tp2_sp_to_tp1",
        "ft",
        "pretrained",
        "noopt",
        "seed",
        "mtp_tp1",
        "mtp_tp2_sp",
    ]
    metrics = {name: records(tmp / f"{name}.jsonl") for name in names}
    return records(tmp / "tp1.jsonl"), metrics, directories


def assert_follows(mine, reference, first_iteration, steps):
    assert sorted(mine) == list(range(first_iteration, first_iteration + steps))
    for offset, iteration in enumerate(sorted(mine)):
        tolerance = FIRST_STEP if offset == 0 else LATER_STEPS
        expected = reference[iteration]
        assert abs(mine[iteration]["loss"] - expected["loss"]) <= tolerance * expected["loss"], (
            iteration,
            mine[iteration]["loss"],
            expected["loss"],
        )
        for field in ("consumed_samples", "logical_tokens", "loss_tokens"):
            assert mine[iteration][field] == expected[field], (iteration, field)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tp1_checkpoint_resumes_at_another_layout(resumed, name):
    reference, metrics, _ = resumed
    assert_follows(metrics[name], reference, 5, 4 if name == "tp2_sp" else 5)


def test_tp2_sp_checkpoint_resumes_at_tp1(resumed):
    reference, metrics, directories = resumed
    assert_follows(metrics["tp2_sp_to_tp1"], reference, 9, 5)
    header = read_header(directories["tp2_sp"], 8)
    assert header.layout["tensor"] == 2 and header.layout["sequence_parallel"]
    # What megatron.training reads from a checkpoint's common state (weights_only unpickling).
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(header.root)
    assert common["args"].hybrid_layer_pattern == "M*-E"
    assert common["args"].tensor_model_parallel_size == 2
    assert common["args"].consumed_train_samples == 64 and common["iteration"] == 8
    assert intact_iterations(directories["tp2_sp"]) == [8]


def test_the_reference_run_was_not_trivially_flat(resumed):
    """The comparisons above could pass on a run that does not learn; this one learns."""
    reference, _, directories = resumed
    assert reference[13]["loss"] < 0.95 * reference[1]["loss"]
    assert intact_iterations(directories["tp1"]) == [4, 8, 12, 13]


def test_finetune_and_pretrained_checkpoint_start_from_the_weights_at_iteration_0(resumed):
    """--load --finetune (TP1) and --pretrained-checkpoint (TP2 + SP) start from the weights of
    iteration 8 with a fresh optimizer, schedule and data position: the same trajectory, whose
    first step sees the first batch through trained weights."""
    reference, metrics, _ = resumed
    finetune, pretrained = metrics["ft"], metrics["pretrained"]
    assert sorted(finetune) == sorted(pretrained) == [1, 2, 3]
    for offset, iteration in enumerate(sorted(finetune)):
        tolerance = FIRST_STEP if offset == 0 else LATER_STEPS
        mine, expected = pretrained[iteration], finetune[iteration]
        assert abs(mine["loss"] - expected["loss"]) <= tolerance * expected["loss"], iteration
        assert mine["consumed_samples"] == reference[iteration]["consumed_samples"]
        assert mine["learning_rate"] == pytest.approx(reference[iteration]["learning_rate"])
    assert finetune[1]["loss"] < 0.97 * reference[1]["loss"]


def test_no_load_optim_keeps_the_position_and_restarts_the_optimizer(resumed):
    reference, metrics, _ = resumed
    fresh = metrics["noopt"]
    assert sorted(fresh) == [5, 6]
    assert abs(fresh[5]["loss"] - reference[5]["loss"]) <= FIRST_STEP * reference[5]["loss"]
    assert fresh[5]["learning_rate"] == pytest.approx(reference[1]["learning_rate"])
    assert abs(fresh[6]["loss"] - reference[6]["loss"]) > LATER_STEPS * reference[6]["loss"]


def test_seed_checkpoint_saved_at_pp2_starts_a_tp1_run(resumed):
    reference, metrics, directories = resumed
    assert intact_iterations(directories["seed"]) == [0]
    assert read_header(directories["seed"], 0).layout["pipeline"] == 2
    assert_follows(metrics["seed"], reference, 1, 3)


def test_checkpoint_with_mtp_depths_resumes_at_another_layout(resumed):
    """The MTP layers' weights and moments reshard too: lm and mtp_k losses continue."""
    _, metrics, _ = resumed
    reference, mine = metrics["mtp_tp1"], metrics["mtp_tp2_sp"]
    assert_follows(mine, reference, 4, 3)
    for offset, iteration in enumerate(sorted(mine)):
        tolerance = FIRST_STEP if offset == 0 else LATER_STEPS
        expected = reference[iteration]["mtp_losses"]
        assert len(expected) == 2
        assert mine[iteration]["mtp_losses"] == pytest.approx(expected, rel=tolerance)
