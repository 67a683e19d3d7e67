"""tools/bench_planner.py --workers: the training process's wait per step, in process and with
DataLoader workers."""

import argparse


def test_first_micro_batch_waits(load_tool):
    tool = load_tool("bench_planner")
    sequences, masks = tool.make_batch(4, 64, 4, 32)
    args = argparse.Namespace(workers=1, repeats=2, step_seconds=0, capacity=1024, pad_multiple=16)
    results = tool.time_first_micro_batches(sequences, masks, args)
    assert [(setting, per_step) for setting, _, _, per_step in results] == [
        ("--micro-batch-size 8, --num-workers 0", 2),
        ("--micro-batch-size 8, --num-workers 1", 2),
        ("--micro-batch-size 1, --num-workers 0", 16),
        ("--micro-batch-size 1, --num-workers 1", 16),
    ]
    assert all(0 < median <= worst for _, median, worst, _ in results)
