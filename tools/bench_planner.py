"""Time plan_shared_prefix on synthetic GRPO-style batches (host side, one core).

Each batch has P prompts with G completions each; a sequence is prompt + completion. About half of
the completions copy a random-length first part (1/8 .. 1/2 of the completion) from a sibling, so
the tries branch below the prompt too. Loss masks supervise the completion tokens only (the RL
case); ``--sft`` uses ``loss_masks=None`` (every position >= 1 supervised) instead.

Inputs are numpy int64 arrays (and numpy bool masks): converting 1M Python ints to numpy alone costs
~30 ms, which would measure the caller's data format rather than the planner. The ``lists`` line
times the same large batch given as Python lists, for reference.

``--workers N`` times the training side instead: how long megatron.training's data iterator
(``RowIterator``) holds the training process at the first micro-batch of each step, where the GPU
waits (the optimizer step before it synchronizes), with every step planned in that process
(``--num-workers 0``) and in N DataLoader workers. The steps are the 1M batch as global batches of
an SFT-style dataset (the same examples, repeating), a sleep of ``--step-seconds`` standing for each
step's GPU work.

Usage:
    PYTHONPATH=. python tools/bench_planner.py [--repeats 11] [--capacity 16384] \
        [--pad-multiple 128] [--sft]
    PYTHONPATH=. python tools/bench_planner.py --workers 2 [--repeats 11] [--step-seconds 0.3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from megatron.shared_prefix.planning import plan_shared_prefix  # noqa: E402

VOCAB = 32000


def make_batch(prompts: int, prompt_len: int, completions: int, completion_len: int, seed: int = 0):
    """Return (sequences, loss_masks) as lists of numpy arrays."""
    rng = np.random.default_rng(seed)
    sequences, masks = [], []
    for _ in range(prompts):
        prompt = rng.integers(0, VOCAB, prompt_len)
        group: list[np.ndarray] = []
        for _ in range(completions):
            completion = rng.integers(0, VOCAB, completion_len)
            if group and rng.random() < 0.5:
                shared = int(rng.integers(completion_len // 8, completion_len // 2 + 1))
                completion[:shared] = group[int(rng.integers(len(group)))][:shared]
            group.append(completion)
            sequences.append(np.concatenate((prompt, completion)))
            mask = np.zeros(prompt_len + completion_len, dtype=bool)
            mask[prompt_len:] = True
            masks.append(mask)
    return sequences, masks


def time_plan(sequences, masks, capacity: int, pad_multiple: int, repeats: int):
    """Median and min wall time (ms) of plan_shared_prefix after one warm-up call, plus the plan."""
    plan_shared_prefix(sequences, masks, capacity=capacity, pad_multiple=pad_multiple)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_shared_prefix(sequences, masks, capacity=capacity, pad_multiple=pad_multiple)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), plan


def time_first_micro_batches(sequences, masks, args) -> list[tuple[str, float, float, int]]:
    """[(setting, median ms, max ms, micro-batches per step)] of the training process's wait at
    the first micro-batch of each step (after the first step, which starts the workers)."""
    # pylint: disable=import-outside-toplevel
    from megatron.shared_prefix.training.config import BatchConfig
    from megatron.shared_prefix.training.data import Dataset, Example, ExampleStream
    from megatron.shared_prefix.training.loss import LossNormalization
    from megatron.shared_prefix.training.megatron_integration import RowIterator

    examples = [
        Example(tokens, mask, mask.astype(np.float32), f"sequence {index}")
        for index, (tokens, mask) in enumerate(zip(sequences, masks))
    ]
    dataset = Dataset(examples, "bench_planner", len(examples))

    class Meter:  # the StepMeter's part the iterator calls
        def begin_step(self, step):
            pass

    results = []
    for micro_batch_size in (8, 1):
        for workers in (0, args.workers):
            batch = BatchConfig(
                global_batch_size=len(examples),
                micro_batch_size=micro_batch_size,
                packing=True,
                capacity=args.capacity,
                normalization=LossNormalization.TOKEN,
                pad_multiple=args.pad_multiple,
                num_workers=workers,
            )
            rows = RowIterator(
                ExampleStream(dataset, len(examples)),
                batch,
                rank=0,
                consumed_samples=0,
                meter=Meter(),
            )
            waits = []
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                next(rows)
                waits.append((time.perf_counter() - start) * 1e3)
                for _ in range(len(rows._pending)):  # pylint: disable=protected-access
                    next(rows)
                time.sleep(args.step_seconds)
            setting = f"--micro-batch-size {micro_batch_size}, --num-workers {workers}"
            waits = waits[1:]
            results.append(
                (setting, statistics.median(waits), max(waits), batch.micro_batches_per_step)
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--pad-multiple", type=int, default=128)
    parser.add_argument(
        "--sft", action="store_true", help="loss_masks=None instead of completion masks"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="time megatron.training's data iterator with this many DataLoader workers instead",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.3,
        help="with --workers: the sleep standing for each step's GPU work",
    )
    args = parser.parse_args()
    if args.workers:
        sequences, masks = make_batch(32, 4096, 8, 512)
        print(
            f"capacity={args.capacity} pad_multiple={args.pad_multiple}; {len(sequences)} "
            f"sequences, {sum(len(s) for s in sequences)} tokens per step; step "
            f"{args.step_seconds} s; {args.repeats} steps after the first"
        )
        header = "| setting | micro-batches per step | median ms | max ms |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for setting, median, worst, micro_batches in time_first_micro_batches(
            sequences, masks, args
        ):
            print(f"| {setting} | {micro_batches} | {median:.2f} | {worst:.2f} |")
        return

    cases = [  # name, prompts, prompt_len, completions, completion_len
        ("64K", 4, 1536, 8, 512),
        ("1M", 32, 4096, 8, 512),
    ]
    header = "| batch | input | logical | executed | rows | loss tokens | median ms | min ms |"
    print(
        f"capacity={args.capacity} pad_multiple={args.pad_multiple} "
        f"masks={'none' if args.sft else 'completion'}"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, prompts, prompt_len, completions, completion_len in cases:
        sequences, masks = make_batch(prompts, prompt_len, completions, completion_len)
        masks = None if args.sft else masks
        inputs = [("numpy", sequences)]
        if name == "1M":
            inputs.append(("lists", [s.tolist() for s in sequences]))
        for kind, seqs in inputs:
            median, best, plan = time_plan(
                seqs, masks, args.capacity, args.pad_multiple, args.repeats
            )
            shape = f"{name}: {prompts}x{prompt_len} + {completions}x{completion_len}"
            print(
                f"| {shape} | {kind} | {plan.logical_tokens} | {plan.executed_tokens} | "
                f"{len(plan.rows)} | "
                f"{plan.loss_tokens} | {median:.2f} | {best:.2f} |"
            )


if __name__ == "__main__":
    main()
