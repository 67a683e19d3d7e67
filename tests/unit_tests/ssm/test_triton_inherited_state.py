"""Triton kernels of the tree scan's forked states (ssm/triton_inherited_state.py) against the torch
oracle.

tree_scan's ``_ForkedChunkScan`` (the packed scan, then the segmented log-decay, own states of every
internal segment, the chain to the parents' end states and the inherited-state output of every child
token, written into the scan's output; backward adding the fork's gradients into the scan's) must
match ``tree_ssd_scan(backend="torch")`` (the same scan, then ``_torch_correction``: plain torch,
float64 log-decay sums, float32 products) on the same random x, dt, A, B, C, D and z of a depth-3
forest whose parents have more tokens than one kernel block and one state-sum split, with heads
sharing groups: the output and the gradients of every input. Both run torch_ssd's scan (here as a
forward and backward pair with mamba_ssm's signatures), so the difference is the fork's alone.

* CPU: Triton's interpreter (TRITON_INTERPRET=1, which must be set before triton compiles anything,
  hence a subprocess running this file), float32. The interpreter evaluates tl.dot in float32, so
  the bound is float32 rounding of different summation orders.
* GPU (marked ``gpu``): compiled kernels, float32 (tl.dot in TF32, like mamba_ssm's own state
  passing) and bf16 (states and weighted inputs rounded to bf16 before the product, as mamba_ssm
  does).

The state sum alone (``state_sum_error``), and the token product and token gradient alone
(``token_kernels_error``, float32 outputs: no rounding to the input dtype hides their error), are
also checked against float64 einsums over each parent's children, with and without the gate, log
and linear weights, interpreted and compiled.
"""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.ssm import torch_ssd, tree_scan
from megatron.shared_prefix.tensors import ForestTensors

HEADS, GROUPS, HEAD_DIM, STATE = 4, 2, 24, 20  # not powers of two: the kernels mask the tails
CHUNK = 64
TOLERANCE = {"cpu": 1e-5, torch.float32: 5e-3, torch.bfloat16: 3e-2}


def forest(device, row="depth-3"):
    """Depth 3; the root has 190 tokens and 180 child tokens (> TOKENS_PER_BLOCK, > one split).
    ``row="stars"``: the same without the middle segment, so no internal segment has a parent
    (the chain only copies the states, and no segment's log-decay gets a gradient from it)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50, 190).tolist()
    middle = rng.integers(1, 50, 30).tolist() if row == "depth-3" else []
    sequences = [prompt + rng.integers(1, 50, n).tolist() for n in (1, 60, 89)]
    sequences += [prompt + middle + rng.integers(1, 50, n).tolist() for n in (5, 70)]
    sequences += [[7, 8, 9], [7, 8, 10]]
    layout = plan_shared_prefix(sequences, capacity=4096, pad_multiple=8).rows[0]
    return ForestTensors.from_layout(layout, device)


def torch_scan_functions():
    """torch_ssd's scan as the (forward, backward) pair that ``_ForkedChunkScan`` calls, with
    mamba_ssm's signatures: forward returns (output, ungated output or None); backward recomputes
    the scan under autograd and returns (dx, ddt, dA, dB, dC, dD, dz)."""

    def run(x, dt, A, B, C, chunk_size, D=None, z=None, seq_idx=None):
        return torch_ssd.mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=z, seq_idx=seq_idx
        )

    def forward(x, dt, A, B, C, chunk_size, D=None, z=None, seq_idx=None):
        ungated = None if z is None else run(x, dt, A, B, C, chunk_size, D=D, seq_idx=seq_idx)
        return run(x, dt, A, B, C, chunk_size, D=D, z=z, seq_idx=seq_idx), ungated

    # pylint: disable-next=unused-argument
    def backward(dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, seq_idx=None):
        inputs = [
            None if t is None else t.detach().requires_grad_() for t in (x, dt, A, B, C, D, z)
        ]
        with torch.enable_grad():
            y = run(*inputs[:5], chunk_size, D=inputs[5], z=inputs[6], seq_idx=seq_idx)
        present = [t for t in inputs if t is not None]
        grads = iter(torch.autograd.grad(y, present, dout))
        return tuple(None if t is None else next(grads) for t in inputs)

    return forward, backward


def compare(device: str, dtype: torch.dtype, tolerance: float, small_blocks: bool = False,
            row_kind: str = "depth-3"):  # fmt: skip
    """Run both implementations on ``forest(device, row_kind)``; return the largest relative error
    over output and gradients."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state,
    )

    if small_blocks:  # several blocks and splits per parent, splits of one block, head blocks
        triton_inherited_state.TOKENS_PER_BLOCK = 16
        triton_inherited_state.SPLIT_BLOCKS = 3
        triton_inherited_state.DECAY_BLOCK_T = 16
        triton_inherited_state.DECAY_BLOCK_H = 2
        triton_inherited_state.DECAY_SUM_T = 128  # pieces of 64 tokens start inside a sum block
        triton_inherited_state.DECAY_PIECES = 3
    row = forest(device, row_kind)
    chained = tree_scan.TreeScanPlan.of(row).segment_chain_slot >= 0
    assert bool(chained.any()) == (row_kind == "depth-3")
    torch.manual_seed(0)
    length = row.num_tokens

    def leaf(*shape, dtype=dtype, scale=1.0, shift=0.0):
        values = torch.randn(*shape, device=device) * scale + shift
        return values.to(dtype).requires_grad_()

    inputs = {
        "x": leaf(1, length, HEADS, HEAD_DIM),
        "dt": (torch.rand(1, length, HEADS, device=device) * 0.2 + 0.01).requires_grad_(),
        "A": (-torch.rand(HEADS, device=device) - 0.2).requires_grad_(),
        "B": leaf(1, length, GROUPS, STATE),
        "C": leaf(1, length, GROUPS, STATE),
        "D": leaf(HEADS, dtype=torch.float32),
        "z": leaf(1, length, HEADS, HEAD_DIM),
    }
    weight = torch.randn(1, length, HEADS, HEAD_DIM, device=device)
    worst = 0.0
    for gate in (True, False):
        args = dict(inputs, z=inputs["z"] if gate else None)
        differentiable = [v for v in args.values() if v is not None]
        results = []
        for fused in (False, True):
            if fused:  # dt is processed already: positive, no bias, no softplus
                out = tree_scan._ForkedChunkScan.apply(
                    *args.values(), row, CHUNK, torch_scan_functions(), {}
                )
                # The fork's [T, H] log-decays and input weights are recomputed in backward; of
                # its end states it keeps every slot's in the input dtype and the float32 ones of
                # the slots that are another's parent in the chain.
                kept = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None]
                assert (length, HEADS) not in kept, kept
                plan = tree_scan.TreeScanPlan.of(row)
                assert plan.num_chain_parents == (1 if row_kind == "depth-3" else 0)
                assert [shape for shape in kept if shape[1:] == (HEADS, HEAD_DIM, STATE)] == [
                    (len(plan.internal), HEADS, HEAD_DIM, STATE),
                    (plan.num_chain_parents, HEADS, HEAD_DIM, STATE),
                ], kept
            else:
                out = tree_scan.tree_ssd_scan(chunk_size=CHUNK, forest=row, backend="torch", **args)
            grads = torch.autograd.grad((out.float() * weight).sum(), differentiable)
            results.append((out, *grads))
        for expected, actual in zip(*results):
            scale = expected.detach().double().abs().max().clamp_min(1e-30)
            error = (actual.detach().double() - expected.detach().double()).abs().max() / scale
            worst = max(worst, float(error))
    assert worst <= tolerance, f"relative error {worst} > {tolerance}"
    return worst


def test_interpreted_kernels_match_torch_oracle():
    pytest.importorskip("triton")
    for small_blocks, row_kind in (("0", "depth-3"), ("1", "depth-3"), ("0", "stars")):
        assert "relative error" in run_interpreted(__file__, small_blocks, row_kind)


def slot_splits(partials) -> list:
    """[(first split, end split)] of every slot of a ``StatePartials``."""
    return list(zip(*partials.slot_splits.tolist()))


def per_slot(states):
    """The ``StatePartials`` of one split per slot: states [S, H, P, N] float32."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state as kernels,
    )

    bounds = torch.arange(states.shape[0] + 1, dtype=torch.int32, device=states.device)
    return kernels.StatePartials(states, torch.stack([bounds[:-1], bounds[1:]]))


def in_order(partials):
    """The ``StatePartials`` of one split per slot, each the float32 sum of the slot's splits in
    index order, added from zero one split at a time (as the chain adds them)."""
    sums = []
    for first, end in slot_splits(partials):
        total = torch.zeros_like(partials.partial[0])
        for split in range(first, end):
            total += partials.partial[split]
        sums.append(total)
    return per_slot(torch.stack(sums))


def state_sum_error(device: str, dtype: torch.dtype) -> float:
    """Largest relative error of ``state_sum`` against an einsum over each parent's children, with
    and without the gate, log and linear weights."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state as kernels,
    )

    row = forest(device)
    plan = tree_scan.TreeScanPlan.of(row)
    tables = kernels.ForkedStates.of(row, plan).children
    torch.manual_seed(1)
    length = row.num_tokens
    v, z = (torch.randn(length, HEADS, HEAD_DIM, device=device).to(dtype) for _ in range(2))
    C = torch.randn(length, GROUPS, STATE, device=device).to(dtype)
    w = -torch.rand(length, HEADS, device=device)
    per_head = C.double().repeat_interleave(HEADS // GROUPS, dim=1)
    worst = 0.0
    for gate, exp_weight in itertools.product((None, z), (True, False)):
        partials = kernels.state_sum(v, gate, C, w, tables, exp_weight=exp_weight)
        actual = torch.stack([partials.partial[a:b].sum(0) for a, b in slot_splits(partials)])
        gated = v.double() * (1 if gate is None else F.silu(gate.double()))
        weighted = gated * (w.double().exp() if exp_weight else w.double())[..., None]
        for slot, children in enumerate(plan.child_tokens):
            expected = torch.einsum("thp,thn->hpn", weighted[children], per_head[children])
            error = (actual[slot].double() - expected).abs().max() / expected.abs().max()
            worst = max(worst, float(error))
    return worst


def test_interpreted_state_sum_matches_einsum():
    pytest.importorskip("triton")
    output = run_interpreted(__file__, "state-sum", "")
    assert "state sum error" in output


def token_kernels_error(device: str, dtype: torch.dtype) -> dict:
    """Largest relative error of ``token_product`` and ``token_grad`` (every output: the product,
    dC, dz, dw, the fused pass's product) against float64 einsums over each parent's children,
    log and linear weights, without and with the gate (keys "ungated", "gated"). Inputs in
    ``dtype``, outputs float32 and zero before the call, so the error is the kernels' own: their
    float32 sums (the products in TF32 for float32 inputs) and, with the gate, the gated
    gradient's rounding to ``dtype`` before its product with the states (dC, dw)."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state as kernels,
    )

    row = forest(device)
    plan = tree_scan.TreeScanPlan.of(row)
    tables = kernels.ForkedStates.of(row, plan).children
    torch.manual_seed(2)
    length, per_group = row.num_tokens, HEADS // GROUPS
    v, z = (torch.randn(length, HEADS, HEAD_DIM, device=device).to(dtype) for _ in range(2))
    C = torch.randn(length, GROUPS, STATE, device=device).to(dtype)
    w = -torch.rand(length, HEADS, device=device)
    states = torch.randn(len(plan.internal), HEADS, HEAD_DIM, STATE, device=device).to(dtype)
    slot = torch.full((length,), -1, dtype=torch.long)
    for index, children in enumerate(plan.child_tokens):
        slot[children.cpu()] = index
    tokens = torch.nonzero(slot >= 0).squeeze(1)
    S = states.double()[slot[tokens]]  # [K, H, P, N]
    tokens = tokens.to(device)
    C_h = C.double()[tokens].repeat_interleave(per_group, dim=1)  # [K, H, N]
    q = torch.einsum("khn,khpn->khp", C_h, S)  # the product before weight and gate

    def zeros(*shape):
        return torch.zeros(*shape, device=device)

    def error(actual, expected):
        return float((actual.double()[tokens] - expected).abs().max() / expected.abs().max())

    worst = {"ungated": 0.0, "gated": 0.0}
    for gate, exp_weight in itertools.product((None, z), (True, False)):
        key = "ungated" if gate is None else "gated"
        f = w.double()[tokens]
        f, df = (f.exp(), f.exp()) if exp_weight else (f, torch.ones_like(f))
        z_k = None if gate is None else z.double()[tokens]
        silu = 1 if gate is None else F.silu(z_k)
        out = kernels.token_product(
            gate, C, w, states, tables, exp_weight=exp_weight, out=zeros(length, HEADS, HEAD_DIM)
        )
        worst[key] = max(worst[key], error(out, f[..., None] * silu * q))
        grad_C, grad_z, product = zeros(length, GROUPS, STATE), zeros(*v.shape), zeros(*v.shape)
        grad_w = kernels.token_grad(
            v, gate, C, w, states, tables, exp_weight=exp_weight, grad_C=grad_C,
            grad_z=None if gate is None else grad_z, product_out=product if gate is None else None,
        )  # fmt: skip
        v_k = v.double()[tokens] * silu
        weighted = (v_k * f[..., None]).unflatten(1, (GROUPS, per_group))
        expected_C = torch.einsum("kgrp,kgrpn->kgn", weighted, S.unflatten(1, (GROUPS, -1)))
        errors = [error(grad_C, expected_C), error(grad_w, df * (v_k * q).sum(-1))]
        if gate is None:
            errors.append(error(product, f[..., None] * q))
        else:
            sigmoid = torch.sigmoid(z_k)
            d_silu = sigmoid * (1 + z_k * (1 - sigmoid))
            errors.append(error(grad_z, v.double()[tokens] * f[..., None] * q * d_silu))
        worst[key] = max(worst[key], *errors)
    return worst


def test_interpreted_token_kernels_match_einsum():
    pytest.importorskip("triton")
    assert "token kernels error" in run_interpreted(__file__, "token-kernels", "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_token_kernels_match_einsum(dtype):
    """fp32 inputs multiply in TF32. bf16 inputs with float32 outputs: without the gate the only
    rounding left is the kernels' float32 sums; with it, the gated gradient's rounding to bf16
    (relative 2**-9) before its product."""
    pytest.importorskip("triton")
    errors = token_kernels_error("cuda", dtype)
    if dtype == torch.float32:
        bounds = {"ungated": TOLERANCE[dtype], "gated": TOLERANCE[dtype]}
    else:
        bounds = {"ungated": 1e-4, "gated": 1e-2}
    assert all(errors[key] <= bounds[key] for key in bounds), errors


def strided_layouts_check(device: str) -> int:
    """The token kernels address a tensor's rows by one token stride, the rest contiguous: inputs
    laid out so (rows of a wider tensor, as the mixer's channel views) are read in place, other
    inputs (head-major z, v and C) are copied first, with the bits of contiguous inputs either
    way; an output laid out otherwise is refused before anything is written. Returns the number
    of results compared."""
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state as kernels,
    )

    row = forest(device)
    plan = tree_scan.TreeScanPlan.of(row)
    tables = kernels.ForkedStates.of(row, plan).children
    torch.manual_seed(4)
    length = row.num_tokens

    def wide(*shape):  # rows of a wider tensor: read in place
        flat = torch.randn(length, int(np.prod(shape)) + 7, device=device)
        view = flat[:, 3 : 3 + int(np.prod(shape))].view(length, *shape)
        assert kernels._rows(view)[0] is view  # pylint: disable=protected-access
        return view

    def head_major(tensor):  # [T, X, Y] stored as [X, T, Y]: copied
        moved = tensor.transpose(0, 1).contiguous().transpose(0, 1)
        assert kernels._rows(moved)[0] is not moved  # pylint: disable=protected-access
        return moved

    v, z = wide(HEADS, HEAD_DIM), wide(HEADS, HEAD_DIM)
    C = wide(GROUPS, STATE)
    w = -torch.rand(length, HEADS, device=device)
    states = torch.randn(len(plan.internal), HEADS, HEAD_DIM, STATE, device=device)
    compared = 0
    for layout in ("contiguous", "head-major"):
        inputs = [t.contiguous() if layout == "contiguous" else head_major(t) for t in (v, z, C)]
        results = [
            kernels.token_product(
                inputs[1], inputs[2], w, states, tables, exp_weight=True,
                out=torch.zeros(length, HEADS, HEAD_DIM, device=device),
            ),
            kernels.state_sum(*inputs, w, tables, exp_weight=True).partial,
        ]  # fmt: skip
        grad_C, grad_z = torch.zeros_like(C), torch.zeros_like(v)
        results.append(
            kernels.token_grad(*inputs, w, states, tables, exp_weight=True, grad_C=grad_C,
                               grad_z=grad_z)  # fmt: skip
        )
        results += [grad_C, grad_z]
        if layout == "contiguous":
            expected = results
        else:
            for actual, reference in zip(results, expected):
                assert torch.equal(actual, reference)
                compared += 1
    out = head_major(torch.zeros(length, HEADS, HEAD_DIM, device=device))
    with pytest.raises(ValueError, match="out in place"):
        kernels.token_product(z, C, w, states, tables, exp_weight=True, out=out)
    grad_C = head_major(torch.zeros(length, GROUPS, STATE, device=device))
    with pytest.raises(ValueError, match="grad_C in place"):
        kernels.token_grad(v, None, C, w, states, tables, exp_weight=True, grad_C=grad_C)
    assert not out.any() and not grad_C.any()
    return compared


def test_interpreted_kernels_take_strided_inputs_and_refuse_strided_outputs():
    pytest.importorskip("triton")
    assert "strided layouts compared 5" in run_interpreted(__file__, "layouts", "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_take_strided_inputs_and_refuse_strided_outputs():
    assert strided_layouts_check("cuda") == 5


def test_host_integer_helpers_match_triton():
    """The wrappers' plain-Python cdiv and powers of two (Triton's own are constexpr functions,
    microseconds of host time per call) give Triton's values; the conv's grids use the same cdiv
    (triton_causal_conv.py)."""
    # pylint: disable=protected-access
    triton = pytest.importorskip("triton")
    from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
        triton_inherited_state as kernels,
    )

    for n in range(0, 1100):
        assert kernels._pow2_at_least_1(n) == triton.next_power_of_2(max(n, 1))
        if n:
            assert kernels._pow2(n) == max(16, triton.next_power_of_2(n))
        for d in (1, 3, 4, 16, 32, 64, 128, 1024):
            assert kernels._cdiv(n, d) == triton.cdiv(n, d)


def test_token_blocks_cover_every_token_once_in_order():
    from megatron.shared_prefix.ssm.triton_inherited_state import TOKENS_PER_BLOCK, TokenBlocks

    row = forest("cpu")
    child_tokens = tree_scan.TreeScanPlan.of(row).child_tokens
    tables = TokenBlocks.of(row, "child tokens", lambda: child_tokens)
    offsets, counts, slots = tables.blocks.numpy()
    assert counts.max() <= TOKENS_PER_BLOCK and counts.min() >= 1
    covered = np.concatenate([np.arange(o, o + c) for o, c in zip(offsets, counts)])
    np.testing.assert_array_equal(covered, np.arange(len(tables.tokens)))
    split_first, split_end = tables.splits.numpy()
    for slot, children in enumerate(child_tokens):
        blocks = np.flatnonzero(slots == slot)
        listed = torch.cat([tables.tokens[offsets[b] : offsets[b] + counts[b]] for b in blocks])
        np.testing.assert_array_equal(listed.numpy(), children.numpy())
        first, end = tables.slot_splits[:, slot].tolist()
        assert split_first[first] == blocks[0] and split_end[end - 1] == blocks[-1] + 1
        np.testing.assert_array_equal(split_first[first + 1 : end], split_end[first : end - 1])


def test_segment_pieces_cover_every_token_once_in_order():
    """The segment walk's pieces: every token of a segment in exactly one piece, in order; one
    piece length for the row, a multiple of DECAY_BLOCK_T, that cuts the longest segment into at
    most DECAY_PIECES (each but its last that long); one empty piece for an empty segment."""
    from megatron.shared_prefix.ssm import triton_inherited_state as kernels

    block = kernels.DECAY_BLOCK_T
    for lengths in ([0, 1, 127, 128, 129, 1000, 1024, 1025, 4096, 5], [3], [32768, 64, 2048]):
        segment, first, end = kernels.piece_table(lengths)
        assert np.all(np.diff(segment) >= 0)
        not_last = np.append(segment[1:] == segment[:-1], False)
        sizes = set((end - first)[not_last].tolist())
        assert len(sizes) <= 1, sizes  # one length for the row
        piece = sizes.pop() if sizes else None
        longest = max(lengths)
        if piece is None:
            assert len(segment) == len(lengths) and longest <= block * kernels.DECAY_PIECES
        else:
            assert piece % block == 0
            assert -(-longest // piece) <= kernels.DECAY_PIECES
            assert piece == block or -(-longest // (piece - block)) > kernels.DECAY_PIECES
        for index, length in enumerate(lengths):
            mine = segment == index
            starts, ends = first[mine], end[mine]
            assert starts[0] == 0 and ends[-1] == length
            np.testing.assert_array_equal(starts[1:], ends[:-1])
            assert length == 0 or (ends > starts).all()
            assert len(starts) == 1 or length > ends[0]
    row = forest("cpu")
    pieces = kernels.SegmentPieces.of(row)
    assert pieces is kernels.SegmentPieces.of(row)  # cached on the forest
    segment, first, end = kernels.piece_table(row.layout.segment_lengths)
    np.testing.assert_array_equal(pieces.pieces.numpy(), np.stack([segment, first, end]))
    # What the walk's backward reads to find a piece's segment's pieces: the piece's index in its
    # segment, first // piece_length, counts its segment's earlier pieces, and no segment has
    # more than max_segment_pieces.
    assert len(set(segment.tolist())) < len(segment)  # some segment has several pieces
    index = first // pieces.piece_length
    since_start = np.arange(len(segment)) - np.searchsorted(segment, segment)
    np.testing.assert_array_equal(index, since_start)
    assert np.bincount(segment).max() <= pieces.max_segment_pieces == kernels.DECAY_PIECES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_torch_oracle(dtype):
    pytest.importorskip("triton")
    compare("cuda", dtype, TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_state_sum_matches_einsum(dtype):
    pytest.importorskip("triton")
    error = state_sum_error("cuda", dtype)
    assert error <= TOLERANCE[dtype], error


def _bits(tensor):
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_states_rounded_by_their_producers_and_fused_pass_give_the_separate_bits():
    """The states reach the products in bf16 from the parent chain, forward and backward, and
    the own states' backward runs its token product and token gradient as one pass: the chain's
    copies are the bits of its float32 results rounded by torch, the float32 states it keeps of
    the parents are those results, and the one pass gives the bits of the two kernels run one
    after the other."""
    from megatron.shared_prefix.ssm import triton_inherited_state as kernels

    row = forest("cuda")
    plan = tree_scan.TreeScanPlan.of(row)
    fork = kernels.ForkedStates.of(row, plan)
    torch.manual_seed(0)
    length, dtype = row.num_tokens, torch.bfloat16
    x = torch.randn(length, HEADS, HEAD_DIM, device="cuda").to(dtype)
    B = torch.randn(length, GROUPS, STATE, device="cuda").to(dtype)
    dt = torch.rand(length, HEADS, device="cuda") * 0.2 + 0.01
    A = -torch.rand(HEADS, device="cuda") - 0.2
    _, weight, cum_end = kernels.segment_decay(dt, A, fork.segments)

    own = kernels.state_sum(x, None, B, weight, fork.own, exp_weight=False)
    tables = fork.slot_segment, fork.slot_parent, fork.chain_parent_row
    # float32 copies: every slot's end state; bf16: rounded by the chain.
    ends, parent_ends = kernels.chain_states(
        own, cum_end, *tables, fork.num_chain_parents, copy_dtype=torch.float32
    )
    ends_copy, parent_ends_again = kernels.chain_states(
        own, cum_end, *tables, fork.num_chain_parents, copy_dtype=dtype
    )
    assert torch.equal(_bits(ends_copy), _bits(ends.to(dtype)))
    parents = sorted({parent for *_, parent in plan.internal if parent >= 0})
    assert len(parents) == fork.num_chain_parents == 1
    assert torch.equal(parent_ends, ends[parents]) and torch.equal(parent_ends_again, parent_ends)
    grad_ends = per_slot(torch.randn_like(ends))
    grad_own, _ = kernels.chain_states_backward(
        grad_ends, parent_ends, cum_end, *tables, copy_dtype=torch.float32
    )
    grad_own_copy, _ = kernels.chain_states_backward(
        grad_ends, parent_ends, cum_end, *tables, copy_dtype=dtype
    )
    assert grad_own.dtype == torch.float32 and torch.equal(
        _bits(grad_own_copy), _bits(grad_own.to(dtype))
    )

    grad_x = torch.randn(length, HEADS, HEAD_DIM, device="cuda").to(dtype)
    grad_B = torch.randn(length, GROUPS, STATE, device="cuda").to(dtype)
    separate = [grad_x.clone(), grad_B.clone()]
    kernels.token_product(
        None, B, weight, grad_own_copy, fork.own, exp_weight=False, out=separate[0]
    )
    separate_w = kernels.token_grad(
        x, None, B, weight, grad_own_copy, fork.own, exp_weight=False, grad_C=separate[1]
    )
    fused = [grad_x.clone(), grad_B.clone()]
    fused_w = kernels.token_grad(
        x, None, B, weight, grad_own_copy, fork.own, exp_weight=False, grad_C=fused[1],
        product_out=fused[0],
    )  # fmt: skip
    assert not torch.equal(fused[0], grad_x)  # the product was added
    for expected, actual in zip((*separate, separate_w), (*fused, fused_w)):
        assert torch.equal(_bits(actual), _bits(expected))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chain_adds_the_splits_in_index_order():
    """The parent chain reads each slot's state as the partial sums of its splits (forward: the
    own states, backward: the end states' gradients) and adds them in index order as it goes:
    the bits of the same chain on those sums added one split at a time in torch, for slots of
    one to four splits."""
    from megatron.shared_prefix.ssm import triton_inherited_state as kernels

    row = forest("cuda")
    fork = kernels.ForkedStates.of(row, tree_scan.TreeScanPlan.of(row))
    slots = fork.slot_parent.shape[0]
    counts = [1 + 3 * slot % 4 for slot in range(slots)]  # 1, 4, 3, 2, ...
    ends = np.cumsum(counts)
    splits = torch.tensor(np.stack([ends - counts, ends]), dtype=torch.int32, device="cuda")
    torch.manual_seed(3)
    partial = torch.randn(int(ends[-1]), 64, 64, 128, device="cuda")
    partials = kernels.StatePartials(partial, splits)
    cum_end = -torch.rand(len(row.layout.segment_starts), 64, device="cuda")
    tables = fork.slot_segment, fork.slot_parent, fork.chain_parent_row
    assert slots >= 2 and max(counts) == 4 and fork.num_chain_parents >= 1
    folded = kernels.chain_states(
        partials, cum_end, *tables, fork.num_chain_parents, copy_dtype=torch.bfloat16
    )
    summed = kernels.chain_states(
        in_order(partials), cum_end, *tables, fork.num_chain_parents, copy_dtype=torch.bfloat16
    )
    for actual, expected in zip(folded, summed):
        assert torch.equal(_bits(actual), _bits(expected))
    folded_grads = kernels.chain_states_backward(
        partials, folded[1], cum_end, *tables, copy_dtype=torch.bfloat16
    )
    summed_grads = kernels.chain_states_backward(
        in_order(partials), folded[1], cum_end, *tables, copy_dtype=torch.bfloat16
    )
    for actual, expected in zip(folded_grads, summed_grads):
        assert torch.equal(_bits(actual), _bits(expected))


if __name__ == "__main__":  # run by the interpreted tests above
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "token-kernels":
        errors = token_kernels_error("cpu", torch.float32)
        assert max(errors.values()) <= TOLERANCE["cpu"], errors
        print("token kernels error", errors)
    elif sys.argv[1] == "layouts":
        print("strided layouts compared", strided_layouts_check("cpu"))
    elif sys.argv[1] == "state-sum":
        error = state_sum_error("cpu", torch.float32)
        assert error <= TOLERANCE["cpu"], error
        print("state sum error", error)
    else:
        worst = compare("cpu", torch.float32, TOLERANCE["cpu"], sys.argv[1] == "1", sys.argv[2])
        print("relative error", worst)
