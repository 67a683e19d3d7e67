"""Forward+backward time of tree attention against dense SDPA on the same sequences (CUDA).

For each forest it times, in one process on one GPU:

* dense: ``scaled_dot_product_attention(is_causal=True)`` over the batch of expanded sequences
  (every leaf sequence, all of the same length, as [G, H, L, D]); on an H200 with torch 2.11 it
  runs cuDNN attention, whose backward is not bitwise reproducible;
* dense deterministic: the same under ``torch.use_deterministic_algorithms(True)``, where SDPA
  leaves cuDNN for flash attention with its deterministic backward: dense attention that meets
  the replay contract every tree backend keeps (docs/determinism.md);
* packed dense flex: flex_backend on the same sequences packed as one row with nothing shared
  (every sequence its own root): the tree kernel on the dense problem, so that the tree's gain is
  seen apart from the kernel's speed against cuDNN;
* tree: our FlexAttention path (flex_backend): the block mask built from the forest, the row run on
  the static-shape kernel of its length if that is a bucket, else on the one dynamic-shape kernel
  (the "kernel" column);
* tree flash: flash_backend (flash attention passes, one per segment and one per ancestor depth,
  merged by log-sum-exp: what ``tree_backend="flash"`` runs);
* stock FlexAttention, what a user would write: the same mask_mod with the block mask from
  ``create_block_mask``, called on permuted views of the same [T, 1, H, D] layout as megatron-core's
  core attention (so every row includes the layout conversion a Megatron layer needs), compiled two
  ways: "flex static", specialized on this row's exact length (``torch.compile(flex_attention)``
  on its first shape: the fastest stock kernel, but one compile per distinct row length), and "flex
  dynamic" (``dynamic=True``: what ``torch.compile`` falls back to once a training loop has seen a
  second row length). Dynamo's caches are reset before each forest, so each forest compiles afresh
  and no cache fills up;
* with ``--query-groups G`` (fewer key/value heads than query heads): every method runs grouped
  queries (SDPA with ``enable_gqa``); where tree_attention repeats the keys and values to the
  query heads before the kernel (``flex_backend.repeats_groups``), the tree and the packed dense
  row also run on FlexAttention's grouped-query kernel ("grouped-query kernel" columns), and tree
  / ideal vs packed flex is taken against the faster of the two packed dense runs;
* ideal: the attention-pair ratio (query-key pairs of the dense batch / of the tree) and the token
  ratio (dense tokens / tree tokens), the speedups an exact implementation could reach; tree / ideal
  is taken against each dense baseline in turn.

Times are GPU milliseconds of one forward+backward with runs queued back to back, as in training
(``benchmark_report.cuda_time_ms``): the median of ``--repeats`` runs in each of ``--rounds`` rounds
that interleave the methods, then the median over rounds.

Usage (writes the table into docs/benchmarks.md when --write is given):
    python tools/bench_attention.py [--heads 32] [--query-groups 32] [--head-dim 128]
    [--repeats 10] [--rounds 3] [--write docs/benchmarks.md]
"""

import argparse
import math
import shlex
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F
from benchmark_report import (  # tools/ is on sys.path as a script
    agent_tree,
    cuda_time_ms,
    markdown_table,
    star,
    write_section,
)
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron.shared_prefix.attention import flash_backend, flex_backend
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

SECTION = "Tree attention (tools/bench_attention.py)"
GROUPED_SECTION = "Tree attention with grouped queries (tools/bench_attention.py --query-groups)"

STOCK_COMPILES = {
    "flex static": lambda: torch.compile(flex_attention, dynamic=False),
    "flex dynamic": lambda: torch.compile(flex_attention, dynamic=True),
}


def forward_backward(attend, *inputs):
    """A closure running ``attend(*inputs)`` forward and backward."""

    def run():
        out = attend(*inputs)
        out.backward(torch.ones_like(out))

    return run


def deterministic(run):
    """``run()`` (forward and backward) under ``torch.use_deterministic_algorithms(True)``, the
    caller's setting restored after."""

    def deterministic_run():
        enabled = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            run()
        finally:
            torch.use_deterministic_algorithms(enabled)

    return deterministic_run


def packed_dense_forest(sequences):
    """The forest of ``sequences`` with nothing shared: each gets a first token of its own (ids
    above every drawn token), so each is a root of the one packed row."""
    distinct = [np.concatenate([[40000 + i], s[1:]]) for i, s in enumerate(sequences)]
    plan = plan_shared_prefix(distinct, capacity=sum(len(s) for s in distinct), pad_multiple=128)
    return ForestTensors.from_layout(plan.rows[0], "cuda")


def bench_forest(name, sequences, heads, groups, head_dim, repeats, num_rounds):
    """One table row: times (ms) and ratios for the forest of ``sequences``, ``heads`` query heads
    over ``groups`` key/value heads."""
    repeated = flex_backend.repeats_groups(heads, groups)
    lengths = {len(s) for s in sequences}
    assert len(lengths) == 1, "dense baseline batches equal-length sequences"
    length = lengths.pop()
    plan = plan_shared_prefix(sequences, capacity=sum(len(s) for s in sequences), pad_multiple=128)
    layout = plan.rows[0]
    forest = ForestTensors.from_layout(layout, "cuda")
    real = layout.num_tokens - layout.num_padding
    dense_pairs = len(sequences) * length * (length + 1) / 2
    tree_pairs = float((layout.position_ids[:real] + 1).sum())
    scale = head_dim**-0.5
    make = lambda *shape: torch.randn(  # noqa: E731
        *shape, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )

    dense_qkv = [make(len(sequences), h, length, head_dim) for h in (heads, groups, groups)]
    tree_qkv = [make(layout.num_tokens, 1, h, head_dim) for h in (heads, groups, groups)]
    packed = packed_dense_forest(sequences)
    packed_qkv = [make(packed.num_tokens, 1, h, head_dim) for h in (heads, groups, groups)]
    torch._dynamo.reset()  # pylint: disable=protected-access
    stock_mask = create_block_mask(
        flex_backend.tree_mask_mod(forest.token_subtree_end),
        None,
        None,
        layout.num_tokens,
        layout.num_tokens,
        device="cuda",
    )

    def stock_attention(compiled):
        def attend(q, k, v):
            out = compiled(
                *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                block_mask=stock_mask,
                scale=scale,
                enable_gqa=groups != heads,
            )
            return out.permute(2, 0, 1, 3).reshape(layout.num_tokens, 1, heads * head_dim)

        return attend

    def dense_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)

    def tree_attention(forest, repeat_groups=None):
        return lambda q, k, v: flex_backend.tree_attention(
            q, k, v, forest, softmax_scale=scale, repeat_groups=repeat_groups
        )

    runs = {
        "dense SDPA": forward_backward(dense_sdpa, *dense_qkv),
        "dense SDPA deterministic": deterministic(forward_backward(dense_sdpa, *dense_qkv)),
        "packed dense flex": forward_backward(tree_attention(packed), *packed_qkv),
        "tree": forward_backward(tree_attention(forest), *tree_qkv),
        **{
            key: forward_backward(stock_attention(compile_()), *tree_qkv)
            for key, compile_ in STOCK_COMPILES.items()
        },
    }
    if repeated:
        runs["tree grouped-query kernel"] = forward_backward(
            tree_attention(forest, repeat_groups=False), *tree_qkv
        )
        runs["packed dense flex grouped-query kernel"] = forward_backward(
            tree_attention(packed, repeat_groups=False), *packed_qkv
        )
    runs["tree flash"] = forward_backward(
        lambda q, k, v: flash_backend.tree_attention(q, k, v, forest, softmax_scale=scale),
        *tree_qkv,
    )
    # Rounds interleave the methods, so that a slow phase of the GPU (clocks, other tenants) does
    # not fall on one method only; each time is the median of its rounds.
    rounds = {key: [] for key in runs}
    for _ in range(num_rounds):
        for key, run in runs.items():
            rounds[key].append(cuda_time_ms(run, repeats))
    times = {key: statistics.median(values) for key, values in rounds.items()}
    dense, tree = times["dense SDPA"], times["tree"]
    stock = {key: times[key] for key in STOCK_COMPILES}
    ideal = dense_pairs / tree_pairs
    packed_flex = min(
        times["packed dense flex"], times.get("packed dense flex grouped-query kernel", math.inf)
    )
    grouped = {}
    if repeated:
        grouped = {
            "tree grouped-query kernel ms": times["tree grouped-query kernel"],
            "tree / ideal, grouped-query kernel": (dense / times["tree grouped-query kernel"])
            / ideal,
            "packed dense flex grouped-query kernel ms": times[
                "packed dense flex grouped-query kernel"
            ],
        }
    return {
        "forest": name,
        "tokens dense/tree (row)": f"{len(sequences) * length}/{real} ({layout.num_tokens})",
        "kernel": "static" if flex_backend.run_length(layout.num_tokens)[1] else "dynamic",
        "dense SDPA ms": dense,
        "tree ms": tree,
        **{f"{key} ms": value for key, value in stock.items()},
        "tree speedup": dense / tree,
        **{f"tree / {key}": tree / value for key, value in stock.items()},
        "ideal (pairs)": ideal,
        "token ratio": len(sequences) * length / real,
        "tree / ideal": (dense / tree) / ideal,
        **grouped,
        "tree flash ms": times["tree flash"],
        "tree flash / ideal": (dense / times["tree flash"]) / ideal,
        "dense SDPA deterministic ms": times["dense SDPA deterministic"],
        "tree / ideal vs deterministic": (times["dense SDPA deterministic"] / tree) / ideal,
        "packed dense flex ms": times["packed dense flex"],
        "tree / ideal vs packed flex": (packed_flex / tree) / ideal,
    }


def markdown(rows, command, heads=None, groups=None):
    """The benchmark section: command, then one table row per forest."""
    grouped = groups is not None and groups != heads
    lines = [
        f"## {GROUPED_SECTION if grouped else SECTION}",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {torch.cuda.get_device_name()}, bf16, forward+backward, GPU time of runs "
        "queued back to back (median of interleaved rounds). tree: flex_backend (kernel: static "
        "shapes for a row whose length is a bucket, else the one dynamic-shape kernel told that "
        "lengths are multiples of 128, which every row here is: no copies); flex static: stock "
        "FlexAttention compiled for this exact length (one compile per distinct row length); flex "
        "dynamic: stock with a dynamic length, what torch.compile uses once a loop has seen a "
        "second row length; tree / ideal = (dense / tree) / ideal pair ratio; tree flash: "
        "flash_backend (flash attention passes: the segments, then one per ancestor depth); dense "
        "SDPA deterministic: SDPA under torch.use_deterministic_algorithms(True) (flash "
        "attention's deterministic backward instead of cuDNN); packed dense flex: flex_backend on "
        "the sequences packed with nothing shared; tree / ideal vs X = (X / tree) / ideal pair "
        "ratio."
        + (
            f" {heads} query heads over {groups} key/value heads; tree and packed dense flex "
            "repeat the keys and values to the query heads before the kernel; grouped-query "
            "kernel: the same on FlexAttention's enable_gqa kernel; tree / ideal vs packed flex "
            "against the faster packed dense run."
            if grouped
            else ""
        ),
        "",
    ]
    return "\n".join(lines + markdown_table(rows)) + "\n"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument(
        "--query-groups",
        type=int,
        help="key/value heads (grouped-query attention; default: --heads, no grouping)",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per method")
    parser.add_argument("--write", help="markdown file whose section to replace with the results")
    args = parser.parse_args()
    groups = args.query_groups or args.heads
    if args.heads % groups:
        parser.error(f"--heads {args.heads} is not a multiple of --query-groups {groups}")
    forests = [
        ("star P=4096 C=1024 G=16", star(4096, [1024] * 16)),
        ("star P=1024 C=512 G=16", star(1024, [512] * 16)),
        ("star P=8192 C=512 G=8", star(8192, [512] * 8)),
        ("star P=2048 C=2048 G=8", star(2048, [2048] * 8)),
        ("agent depth 3: P=2048, 4 x 512, 4 x 512", agent_tree(2048, 512, 4, 4)),
    ]
    rows = []
    for name, sequences in forests:
        rows.append(
            bench_forest(
                name, sequences, args.heads, groups, args.head_dim, args.repeats, args.rounds
            )
        )
        print(rows[-1], flush=True)
    section = markdown(rows, "python " + shlex.join(sys.argv), args.heads, groups)
    print(section)
    if args.write:
        write_section(args.write, section)


if __name__ == "__main__":
    main()
