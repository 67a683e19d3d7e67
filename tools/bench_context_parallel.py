"""Work balance and communication of a context-parallel forest row, per design and split.

Two designs for tree attention under context parallelism (CP):

* **head all-to-all** (what the project uses): every rank gets the whole row for ``H / cp`` heads,
  runs the tree kernels on it and sends the output back. Attention work per rank is the row's
  attention pairs / cp whatever the split; token-wise layers get equal token counts with
  megatron's chunk split (rank ``r``: chunks ``r`` and ``2 cp - 1 - r``).
* **K/V all-gather, local queries**: every rank keeps its queries and gathers keys and values of
  the whole row. Its attention work is the pairs of its own queries (each query attends its root
  path, ``position + 1`` keys), so it depends on the split: ``contiguous`` (equal token chunks),
  ``zigzag`` (megatron's split, which balances one causal sequence) and ``tree-balanced``
  (contiguous chunks cut at equal prefix sums of pairs: attention balanced, token counts not).

Per forest and CP size the table gives the imbalance ``max rank work / mean rank work`` of
attention pairs and of tokens, and the per-layer forward communication of one rank in MiB
(bf16, ``--heads`` query heads and ``--groups`` key/value groups of ``--head-dim``). With
``--measure`` (CUDA) it also times tree attention forward+backward on the whole row with ``H`` and
with ``H / cp`` heads on one GPU: the per-rank attention cost of the all-to-all design.

Usage:
    PYTHONPATH=. python tools/bench_context_parallel.py [--cp 2 4 8] [--measure]
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=wrong-import-position
from benchmark_report import (  # noqa: E402
    agent_tree,
    cuda_time_ms,
    markdown_table,
    star,
    write_section,
)

from megatron.shared_prefix.context_parallel import token_context_parallel_rank  # noqa: E402
from megatron.shared_prefix.planning import plan_shared_prefix  # noqa: E402

MIB = 2**20


def forests():
    """(name, sequences) of the benchmark forests."""
    rng = np.random.default_rng(0)
    skewed = [int(n) for n in np.geomspace(64, 2048, 16).round()]
    rng.shuffle(skewed)
    return [
        ("star P=4096 C=1024 G=16", star(4096, [1024] * 16)),
        ("skewed star P=4096 C=64..2048 G=16", star(4096, skewed, seed=1)),
        ("agent depth 3: P=2048, 4 x 512, 4 x 512", agent_tree(2048, 512, 4, 4, seed=2)),
    ]


def split_owners(layout, cp: int, split: str) -> np.ndarray:
    """[T] rank of each token under ``split``."""
    num_tokens = layout.num_tokens
    if split == "zigzag":
        return token_context_parallel_rank(num_tokens, cp)
    if split == "contiguous":
        return np.arange(num_tokens) // (num_tokens // cp)
    pairs = np.cumsum(layout.position_ids + 1)
    cuts = np.searchsorted(pairs, pairs[-1] * np.arange(1, cp) / cp)
    return np.searchsorted(cuts, np.arange(num_tokens), side="right")


def imbalance(values: np.ndarray, owners: np.ndarray, cp: int) -> float:
    per_rank = np.bincount(owners, weights=values, minlength=cp)
    return float(per_rank.max() / per_rank.mean())


def communication_mib(num_tokens: int, cp: int, heads: int, groups: int, head_dim: int) -> dict:
    """Forward elements one rank sends per attention layer, in MiB of bf16."""
    share = (cp - 1) / cp
    local = num_tokens / cp
    kv_heads = groups if groups % cp == 0 else heads
    all_to_all = local * head_dim * (heads + 2 * kv_heads + heads) * share
    gather = local * head_dim * 2 * groups * (cp - 1)
    return {"all-to-all": all_to_all * 2 / MIB, "K/V gather": gather * 2 / MIB}


def measure(layout, cp: int, heads: int, head_dim: int, repeats: int) -> tuple[float, float]:
    """(ms of tree attention fwd+bwd with ``heads`` heads, with ``heads / cp``) on the GPU."""
    import torch

    from megatron.shared_prefix.attention import flex_backend
    from megatron.shared_prefix.tensors import ForestTensors

    forest = ForestTensors.from_layout(layout, "cuda")
    times = []
    for count in (heads, heads // cp):
        q, k, v = (
            torch.randn(
                layout.num_tokens, 1, count, head_dim, device="cuda", dtype=torch.bfloat16
            ).requires_grad_()
            for _ in range(3)
        )

        def step(q=q, k=k, v=v):
            out = flex_backend.tree_attention(q, k, v, forest, softmax_scale=head_dim**-0.5)
            out.backward(torch.ones_like(out))

        times.append(cuda_time_ms(step, repeats))
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--measure", action="store_true", help="time tree attention on CUDA")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--write", help="markdown file whose section to replace with the results")
    args = parser.parse_args()

    rows = []
    for name, sequences in forests():
        multiple = 2 * max(args.cp) * 128
        layout = plan_shared_prefix(sequences, capacity=1 << 20, pad_multiple=multiple).rows[0]
        pairs = (layout.position_ids + 1).astype(np.float64)
        tokens = np.ones(layout.num_tokens)
        for cp in args.cp:
            row = {"forest": name, "tokens": layout.num_tokens, "cp": cp}
            for split in ("contiguous", "zigzag", "tree-balanced"):
                owners = split_owners(layout, cp, split)
                row[f"K/V gather, {split}: pairs"] = imbalance(pairs, owners, cp)
                row[f"K/V gather, {split}: tokens"] = imbalance(tokens, owners, cp)
            row["all-to-all (zigzag): pairs"] = 1.0
            row["all-to-all (zigzag): tokens"] = imbalance(
                tokens, split_owners(layout, cp, "zigzag"), cp
            )
            volume = communication_mib(
                layout.num_tokens, cp, args.heads, args.groups, args.head_dim
            )
            row["MiB/layer all-to-all"] = volume["all-to-all"]
            row["MiB/layer K/V gather"] = volume["K/V gather"]
            if args.measure:
                full, share = measure(layout, cp, args.heads, args.head_dim, args.repeats)
                row["attention ms, H heads"] = full
                row["attention ms, H/cp heads (per rank)"] = share
                row["per-rank / (H-head / cp)"] = share / (full / cp)
            rows.append(row)

    command = "python tools/bench_context_parallel.py " + shlex.join(sys.argv[1:])
    section = "\n".join(
        [
            "## Context-parallel split (tools/bench_context_parallel.py)",
            "",
            f"Command: `{command.strip()}`",
            "",
            "Imbalance = max rank work / mean rank work (1.00 is perfect) of attention pairs (a "
            "query attends its root path: position + 1 keys) and of tokens (token-wise layers), "
            "for the two CP attention designs; communication: forward elements one rank sends per "
            f"attention layer, bf16, {args.heads} query heads, {args.groups} key/value groups of "
            f"{args.head_dim}. Rows padded to a multiple of 2 x {max(args.cp)} x 128 tokens.",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    print(section)
    if args.write:
        write_section(args.write, section)


if __name__ == "__main__":
    main()
