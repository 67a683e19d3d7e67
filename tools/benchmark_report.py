"""Helpers shared by the benchmarks in tools/: CUDA timing, synthetic forests, and their sections of
docs/benchmarks.md.

Each benchmark writes one ``## <title>`` section (its command, device and table) and replaces only
that section when it runs again, so benchmarks never overwrite each other's results.
"""

import os
import statistics
import time

import numpy as np
import torch
import triton


def use_deterministic_mamba_ssm():
    """Put mamba_ssm in its deterministic mode (``MAMBA_DETERMINISTIC=1``) unless the environment
    says otherwise, for this process and those it starts: every kernel runs its cheapest
    configuration, as in the GPU tests, instead of being autotuned afresh in each process (on an
    H200 the Mamba warm-up of a fresh ``bench_model.py --first-step`` process took 129 s with
    autotuning and 33 s without, docs/training.md). Call it before mamba_ssm is imported: it reads
    the variable when its kernel modules load.
    """
    os.environ.setdefault("MAMBA_DETERMINISTIC", "1")


# Cycles of the sleep kernel that holds the GPU while the timed runs are queued (``host_ahead``):
# 0.5-0.7 s at a 1.5-2 GHz clock, longer than the host takes to queue ten forward+backward runs of
# one layer (10-15 ms each for a Mamba layer on the benchmark's rows).
HOST_AHEAD_CYCLES = 10**9


def cuda_time_ms(fn, repeats: int, warmup: int = 3, *, host_ahead: bool = False) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA events).

    The runs are queued back to back with one synchronization at the end, as in a training loop, so
    each pair of events times the GPU work of one run, not the host's time to launch it (which
    overlaps the previous run's GPU work when the host is ahead). Where queuing a run takes the
    host longer than the GPU takes to run it, the GPU waits between kernels and the events time
    the host instead; ``host_ahead`` queues a sleep kernel first (``HOST_AHEAD_CYCLES``), so that
    the runs are all queued before the GPU reaches them and the events time the GPU's work alone.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if host_ahead:
        torch.cuda._sleep(HOST_AHEAD_CYCLES)  # pylint: disable=protected-access
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


# Does nothing: its launch is the host's work alone (eight tensors and eight integers).
@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, i, j, k, m, n, o, p, q):
    pass


def host_launch_us(launches: int = 200, rounds: int = 3) -> dict:
    """Host microseconds per launch on this machine, with the GPU busy (the launches are queued
    behind a sleep kernel, so the host never waits): ``triton``, an empty Triton kernel with eight
    tensor and eight integer arguments, about what each Triton kernel of the tree Mamba layer
    takes; ``torch``, an in-place add of two 16-element tensors. Median of ``rounds`` rounds of
    ``launches`` launches each. CUDA only.

    Why: a synchronized tree step of a short row can be held to the host (a Mamba layer's
    forward+backward launches about 36 Triton kernels and 140 PyTorch ones), and the same step
    took up to 38% longer on one machine than on another of the same kind (docs/benchmarks.md,
    *Whole model: what the table shows*), so a table records the host's costs beside its device.
    """
    tensors = [torch.zeros(16, device="cuda") for _ in range(8)]
    integers = [16] * 8
    launch = {
        "triton": lambda: _empty_kernel[(1,)](*tensors, *integers),
        "torch": lambda: tensors[0].add_(tensors[1]),
    }
    result = {}
    for name, fn in launch.items():
        fn()  # compiles the kernel
        per_round = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_AHEAD_CYCLES)  # pylint: disable=protected-access
            start = time.perf_counter()
            for _ in range(launches):
                fn()
            per_round.append(1e6 * (time.perf_counter() - start) / launches)
        torch.cuda.synchronize()
        result[name] = statistics.median(per_round)
    return result


def device_description(name: str, host_us=None) -> str:
    """``name``, with the host's launch costs of :func:`host_launch_us` when given."""
    if host_us is None:
        return name
    return (
        f"{name} (host, with the GPU busy: {host_us['triton']:.1f} us per launch of an empty "
        f"Triton kernel of 16 arguments, {host_us['torch']:.1f} us per small PyTorch op)"
    )


def kernel_time_differences(averages, reference, *, attribute="self_device_time_total"):
    """Rows (name, microseconds in ``averages``, in ``reference``, difference, calls in each) of
    every event name of two ``torch.profiler`` ``key_averages()`` tables, largest difference
    first: where one run spends the time the other does not (``attribute`` is the per-name total
    compared; self CUDA time by default).
    """
    times = [{event.key: event for event in table} for table in (averages, reference)]
    rows = []
    for name in set(times[0]) | set(times[1]):
        events = [table.get(name) for table in times]
        spent = [0.0 if event is None else float(getattr(event, attribute)) for event in events]
        calls = [0 if event is None else event.count for event in events]
        rows.append((name, spent[0], spent[1], spent[0] - spent[1], calls[0], calls[1]))
    return sorted(rows, key=lambda row: (-row[3], row[0]))


def markdown_table(rows) -> list:
    """Lines of a markdown table with one row per dict of ``rows`` (floats with 2 decimals)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_section(path, section_markdown):
    """Replace (or append) the section of ``path`` whose header is the first line of
    ``section_markdown``.

    ``section_markdown`` starts with its ``## title`` line; every other section of the file is kept.
    """
    header = section_markdown.split("\n", 1)[0]
    if not header.startswith("## "):
        raise ValueError(f"a benchmark section must start with a '## ' header, got {header!r}")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        text = "# Benchmarks\n"
    lines = text.split("\n")
    if header in lines:
        start = sum(len(line) + 1 for line in lines[: lines.index(header)])
        following = text.find("\n## ", start + len(header))
        rest = text[following + 1 :] if following >= 0 else ""
        text = text[:start] + section_markdown.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section_markdown.rstrip("\n") + "\n"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def star(prompt, completions, seed=0):
    """GRPO group: one prompt, one completion per entry of ``completions`` (their lengths)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 30000, prompt)
    return [np.concatenate([shared, rng.integers(1, 30000, n)]) for n in completions]


def agent_tree(prompt, turn, calls, branches, seed=0):
    """Depth-3 agent trace: a system prompt, ``calls`` first turns, each with ``branches`` second turns."""
    rng = np.random.default_rng(seed)
    root = rng.integers(1, 30000, prompt)
    sequences = []
    for _ in range(calls):
        first = np.concatenate([root, rng.integers(1, 30000, turn)])
        sequences += [
            np.concatenate([first, rng.integers(1, 30000, turn)]) for _ in range(branches)
        ]
    return sequences
