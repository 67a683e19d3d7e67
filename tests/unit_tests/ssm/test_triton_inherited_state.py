"""Triton inherited-state correction (ssm/triton_inherited_state.py) against its torch oracle.

The oracle is tree_scan's ``_InheritedStateOutput`` without tables (plain torch, float32). Both run
on the same random y, z, C, cum and parent end states of a depth-3 forest with more child tokens per
parent than one kernel block and one state-gradient split, and heads sharing groups; the output and
the gradients of y, z, C, cum and every state must agree.

* CPU: Triton's interpreter (TRITON_INTERPRET=1, which must be set before triton compiles anything,
  hence a subprocess running this file), float32. The interpreter evaluates tl.dot in float32, so
  the bound is float32 rounding of different summation orders.
* GPU (marked ``gpu``): compiled kernels, float32 (tl.dot in TF32, like mamba_ssm's own state
  passing) and bf16 (states rounded to bf16 before the product, as mamba_ssm does).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan, _InheritedStateOutput
from megatron.shared_prefix.tensors import ForestTensors

HEADS, GROUPS, HEAD_DIM, STATE = 4, 2, 24, 20  # not powers of two: the kernels mask the tails
TOLERANCE = {"cpu": 1e-5, torch.float32: 5e-3, torch.bfloat16: 3e-2}


def forest(device):
    """Depth 3; the first parent has 180 child tokens (> TOKENS_PER_BLOCK, > one split of 16 blocks)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50, 40).tolist()
    middle = rng.integers(1, 50, 30).tolist()
    sequences = [prompt + rng.integers(1, 50, n).tolist() for n in (1, 60, 119)]
    sequences += [prompt + middle + rng.integers(1, 50, n).tolist() for n in (5, 70)]
    sequences += [[7, 8, 9], [7, 8, 10]]
    layout = plan_shared_prefix(sequences, capacity=4096, pad_multiple=8).rows[0]
    return ForestTensors.from_layout(layout, device)


def compare(device: str, dtype: torch.dtype, tolerance: float, split_blocks: int = 0):
    """Run both implementations; return the largest relative error over output and gradients."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state,
    )

    if split_blocks:  # smaller splits: several partial sums per parent on a small forest
        triton_inherited_state.SPLIT_BLOCKS = split_blocks
        triton_inherited_state.TOKENS_PER_BLOCK = 16
    row = forest(device)
    plan = TreeScanPlan.of(row)
    torch.manual_seed(0)
    length = row.num_tokens

    def leaf(*shape, dtype=dtype, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    y, z = leaf(length, HEADS, HEAD_DIM), leaf(length, HEADS, HEAD_DIM)
    C = leaf(length, GROUPS, STATE)
    cum = (-torch.rand(length, HEADS, device=device) * 3).requires_grad_()
    states = [
        leaf(GROUPS, HEADS // GROUPS, HEAD_DIM, STATE, dtype=torch.float32)
        for _ in plan.child_tokens
    ]
    weight = torch.randn(length, HEADS, HEAD_DIM, device=device)
    results = []
    for tables in (None, triton_inherited_state.ChildBlocks.of(row, plan.child_tokens)):
        for gate in (z, None):
            out = _InheritedStateOutput.apply(y, gate, C, cum, plan.child_tokens, tables, *states)
            inputs = [y, C, cum, *states] + ([z] if gate is not None else [])
            grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
            results.append((out, *grads))
    worst = 0.0
    for expected, actual in ((results[0], results[2]), (results[1], results[3])):
        for e, a in zip(expected, actual):
            scale = e.detach().double().abs().max().clamp_min(1e-30)
            worst = max(
                worst, float((a.detach().double() - e.detach().double()).abs().max() / scale)
            )
    assert worst <= tolerance, f"relative error {worst} > {tolerance}"
    return worst


def test_interpreted_kernels_match_torch_oracle():
    pytest.importorskip("triton")
    for split_blocks in (0, 2):
        result = subprocess.run(
            [sys.executable, __file__, str(split_blocks)],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "relative error" in result.stdout


def test_child_blocks_cover_every_child_token_once():
    from megatron.shared_prefix.ssm.triton_inherited_state import TOKENS_PER_BLOCK, ChildBlocks

    row = forest("cpu")
    plan = TreeScanPlan.of(row)
    tables = ChildBlocks.of(row, plan.child_tokens)
    offsets, counts, slots = tables.blocks.numpy()
    assert counts.max() <= TOKENS_PER_BLOCK and counts.min() >= 1
    covered = np.concatenate([np.arange(o, o + c) for o, c in zip(offsets, counts)])
    np.testing.assert_array_equal(covered, np.arange(len(tables.tokens)))
    for slot, children in enumerate(plan.child_tokens):
        block_tokens = [
            tables.tokens[o : o + c] for o, c, s in zip(offsets, counts, slots) if s == slot
        ]
        np.testing.assert_array_equal(torch.cat(block_tokens).numpy(), children.numpy())
        first, end = tables.slot_splits[slot]
        split_blocks = tables.splits.numpy()[:, first:end]
        assert split_blocks[0, 0] == np.flatnonzero(slots == slot)[0]
        assert split_blocks[1, -1] == np.flatnonzero(slots == slot)[-1] + 1
        np.testing.assert_array_equal(split_blocks[0, 1:], split_blocks[1, :-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_torch_oracle(dtype):
    pytest.importorskip("triton")
    compare("cuda", dtype, TOLERANCE[dtype])


if __name__ == "__main__":  # run by test_interpreted_kernels_match_torch_oracle
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print("relative error", compare("cpu", torch.float32, TOLERANCE["cpu"], int(sys.argv[1])))
