"""Triton kernels for the tree scan's forked states (upstream: megatron/core/ssm/ops).

:func:`tree_scan.tree_ssd_scan` needs, besides the packed scan, two products between per-token
tensors and per-parent [P, N] states, for every head h (group g(h)):

* the end state of every internal segment s, from its own tokens, (2) in tree_scan.py:
  ``own[s, h] = sum_{t in s} w[t, h] * x[t, h]^T B[t, g]`` with ``w = exp(cum_end - cum) * dt``;
* the inherited-state output at every child token t of parent s, (1) in tree_scan.py:
  ``out[t, h] = y[t, h] + gate[t, h] * exp(cum[t, h]) * (C[t, g] . state[s, h])``.

In plain torch (tree_scan.py, the oracle) these are per-parent loops of gathers, float32
temporaries as large as the layer output and batched GEMMs. Here three kernels cover both
products and their gradients, for every parent at once, reading the activations once:

* :func:`_token_product_kernel` ``out[t, h] += f(w[t, h]) * gate * (C[t, g] . S[s, h])``;
* :func:`_token_grad_kernel`, for ``u[t, h] = (gate * v[t, h]) . S[s, h]`` ([N]):
  ``dC[t, g] += sum_h f(w) * u``, the gate's gradient likewise, and ``dw[t, h] = f'(w) * sum_n
  u * C``;
* :func:`_state_sum_kernel` ``S'[s, h] = sum_t f(w[t, h]) * gate * v[t, h]^T C[t, g]``,

with ``f = exp`` (log weights, the correction) or the identity (linear weights, the own states).
The forward of the correction is a token product, its backward a token gradient and a state sum;
the own states are a state sum, their backward a token product (dx) and a token gradient (dB, dw),
run as one pass (the token gradient kernel with ``ADD_PRODUCT``).
The products add into their output, and the gradients into the packed scan's own: the correction
is written into the scan's output, and its gradients into the scan's gradients of x, dt, B, C and z
(:class:`ForkedStates`, run with the scan in one autograd function by tree_scan.py), so no
activation-sized buffer is zero-filled, copied or summed for the fork.

Two small kernels feed them: :func:`segment_decay` (cum, cum_end and the input weights w from dt
and A, float64 sums within each segment, one program per piece of a segment and head block,
:class:`SegmentPieces`) and :func:`chain_states` (``end[s] = own[s] + exp(cum_end[s]) *
end[parent(s)]`` for all internal segments in one launch, parents first). Every step is thus a
fixed number of launches per layer, however many segments the row has. Kept for backward: the end
states in the input dtype (what the products read) and, in float32, only those of the segments
that are another internal segment's parent (what the chain's backward reads): on a star, no
float32 state at all.

Precision follows mamba_ssm's chunk scan, which passes states between chunks the same way: the
float32 state (or weighted input) is rounded to the input dtype and multiplied on tensor cores with
float32 accumulation (``tl.dot``; TF32 for float32 inputs); weights, gates and sums are float32.
The states are rounded once, by the kernel that finishes them (the parent chain, forward and
backward, writes a copy in the input dtype), not by a conversion per product.

Work is split into blocks of :data:`TOKENS_PER_BLOCK` tokens of one parent (tables built once per
forest). Every output element is written by exactly one program and every reduction runs in a
fixed order (a state sum: fixed splits of each parent's tokens, then the splits added in index
order), so results are bitwise reproducible; there are no atomics.

The counts that change with every forest (blocks, splits, slots) are ``do_not_specialize``:
Triton otherwise compiles a variant of a kernel per class of an integer argument (1, a multiple
of 16, anything else), which on an H200 made the first row of a new shape compile again in the
middle of training (tools/bench_model.py ``--first-step``). They only bound loops and masks.
The layer's sizes (heads per group, head and state dims) are constexprs instead, and the token
kernels take one stride per tensor, its token stride (the other dimensions contiguous: the
mixer's channel views qualify; other inputs are copied first, other outputs refused): a launch
costs host time per argument, and on a slow host the tree layer's host time exceeded its GPU time
(docs/benchmarks.md, *Tree Mamba mixer: where the fork's time goes*, the leaner launches).

Shapes: T packed tokens, H heads in G groups (R = H / G heads per group), head dim P, state dim N,
S internal (parent) segments.
"""

import dataclasses
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from megatron.shared_prefix.tensors import ForestTensors, host_to_device, hosts_to_device

# Mamba's notation (A, B, C, D) is kept for the SSM's tensors.
# pylint: disable=invalid-name

TOKENS_PER_BLOCK = 64  # tokens per program
SPLIT_BLOCKS = 16  # token blocks summed by one program of the state sum
SUM_BLOCK = 1024  # state elements per program of the parent chain
# Pipeline stages of the token product: one stage was 6-12% faster than Triton's default of three
# in a sweep on an H200 (docs/benchmarks.md, the tree Mamba mixer's launch options).
TOKEN_PRODUCT_STAGES = 1
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class TokenBlocks:
    """Work tables over one token list per parent slot (built once per forest, cached on it).

    Attributes:
        tokens: [K] int64 the lists concatenated, slot by slot.
        blocks: [3, NB] int32 per block: offset into ``tokens``, token count (at most
            TOKENS_PER_BLOCK), parent slot.
        splits: [2, NS] int32 per split: first block, end block (exclusive); one slot per split.
        slot_splits: [2, S] int32 per slot: first split, end split (exclusive).
    """

    tokens: torch.Tensor
    blocks: torch.Tensor
    splits: torch.Tensor
    slot_splits: torch.Tensor

    @classmethod
    def of(cls, forest: ForestTensors, name: str, token_lists) -> "TokenBlocks":
        """Tables of ``forest`` where slot ``i`` owns ``token_lists()[i]`` (built on first use,
        cached on the forest as ``name``)."""
        return forest.derive(
            ("token_blocks", name, TOKENS_PER_BLOCK, SPLIT_BLOCKS),
            lambda: cls._build(forest.device, token_lists()),
        )

    @classmethod
    def _build(cls, device, token_lists) -> "TokenBlocks":
        """``token_lists``: per slot, a host int64 array of its packed token indices."""
        counts = np.array([len(tokens) for tokens in token_lists], dtype=np.int64)
        run_starts = np.cumsum(counts) - counts
        blocks, splits, slot_splits = [], [], []
        for slot, (start, count) in enumerate(zip(run_starts, counts)):
            first_block = len(blocks)
            blocks += [
                (start + offset, min(TOKENS_PER_BLOCK, count - offset), slot)
                for offset in range(0, count, TOKENS_PER_BLOCK)
            ]
            first_split = len(splits)
            splits += [
                (block, min(block + SPLIT_BLOCKS, len(blocks)))
                for block in range(first_block, len(blocks), SPLIT_BLOCKS)
            ]
            slot_splits.append((first_split, len(splits)))

        def table(rows, width):
            return np.array(rows, dtype=np.int32).reshape(-1, width).T

        tokens = np.concatenate([np.zeros(0, dtype=np.int64), *token_lists])  # none: empty
        # One transfer from the host: a copy from pageable memory would drain the GPU's queue.
        return cls(
            *hosts_to_device(
                [tokens, table(blocks, 3), table(splits, 2), table(slot_splits, 2)], device
            )
        )


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels handle these tensors' dtypes."""
    return all(t.dtype in SUPPORTED_DTYPES for t in tensors)


# Host integer helpers in plain Python: Triton's cdiv and next_power_of_2 are constexpr
# functions, a few microseconds of host time per call.
def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _pow2_at_least_1(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _pow2(n: int) -> int:
    return max(16, _pow2_at_least_1(n))  # tl.dot needs every dimension >= 16


@triton.jit
def _block(blocks_ptr, tokens_ptr, block, num_blocks, BLOCK_T: tl.constexpr):
    """Token indices [BLOCK_T] (0 where masked), their mask and the parent slot of a block."""
    offset = tl.load(blocks_ptr + block)
    count = tl.load(blocks_ptr + num_blocks + block)
    slot = tl.load(blocks_ptr + 2 * num_blocks + block)
    rows = tl.arange(0, BLOCK_T)
    mask = rows < count
    tokens = tl.load(tokens_ptr + offset + rows, mask=mask, other=0)
    return tokens, mask, slot


@triton.jit
def _tp_at(ptr, tokens, head, stride_t, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    """[BLOCK_T, BLOCK_P] pointers ``ptr[tokens, head, :]`` of a [T, H, P] tensor whose rows are
    ``stride_t`` apart (heads and head dims contiguous)."""
    p = tl.arange(0, BLOCK_P)
    return ptr + tokens[:, None] * stride_t + head * HEAD_DIM + p[None, :]


@triton.jit
def _load_tp(ptr, tokens, head, stride_t, mask, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    """[BLOCK_T, BLOCK_P] float32 rows ``ptr[tokens, head, :]`` (0 where masked)."""
    at = _tp_at(ptr, tokens, head, stride_t, HEAD_DIM, BLOCK_P)
    return tl.load(at, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_to_tp(ptr, tokens, head, stride_t, mask, values, HEAD_DIM: tl.constexpr,
               BLOCK_P: tl.constexpr):  # fmt: skip
    """``ptr[tokens, head, :] += values`` ([BLOCK_T, BLOCK_P] float32, added to the loaded rows
    in float32 and rounded once to ptr's dtype) where ``mask``."""
    values += _load_tp(ptr, tokens, head, stride_t, mask, HEAD_DIM, BLOCK_P)
    at = _tp_at(ptr, tokens, head, stride_t, HEAD_DIM, BLOCK_P)
    tl.store(at, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_C(C_ptr, tokens, group, stride_t, mask, STATE_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr):  # fmt: skip
    """[BLOCK_T, BLOCK_N] rows ``C[tokens, group, :]`` of a [T, G, N] tensor whose rows are
    ``stride_t`` apart (0 where masked), in C's dtype; their mask."""
    n = tl.arange(0, BLOCK_N)
    mask_tn = mask[:, None] & (n[None, :] < STATE_DIM)
    at = C_ptr + tokens[:, None] * stride_t + group * STATE_DIM + n[None, :]
    return tl.load(at, mask=mask_tn, other=0.0), at, mask_tn


@triton.jit
def _load_state(ptr, slot, head, num_heads, HEAD_DIM: tl.constexpr, STATE_DIM: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """[BLOCK_P, BLOCK_N] state ``ptr[slot, head]`` of contiguous [S, H, P, N] states, in their
    dtype (0 outside [P, N])."""
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    return tl.load(
        ptr + ((slot * num_heads + head) * HEAD_DIM + p[:, None]) * STATE_DIM + n[None, :],
        mask=(p[:, None] < HEAD_DIM) & (n[None, :] < STATE_DIM),
        other=0.0,
    )


@triton.jit(do_not_specialize=("num_blocks",))
def _token_product_kernel(
    out_ptr, z_ptr, C_ptr, w_ptr, states_ptr, blocks_ptr, tokens_ptr,
    num_blocks, stride_out_t, stride_z_t, stride_C_t,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, STATE_DIM: tl.constexpr,
    HAS_Z: tl.constexpr, EXP_WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (block, group): out += f(w) * gate * C . state, for the group's heads (the sum in
    float32, rounded once to out's dtype). w: contiguous [T, H]."""
    tokens, mask, slot = _block(blocks_ptr, tokens_ptr, tl.program_id(0), num_blocks, BLOCK_T)
    group = tl.program_id(1)
    num_heads = tl.num_programs(1) * HEADS_PER_GROUP
    p = tl.arange(0, BLOCK_P)
    mask_tp = mask[:, None] & (p[None, :] < HEAD_DIM)
    C, _, _ = _load_C(C_ptr, tokens, group, stride_C_t, mask, STATE_DIM, BLOCK_N)
    for r in range(HEADS_PER_GROUP):
        head = group * HEADS_PER_GROUP + r
        state = _load_state(states_ptr, slot, head, num_heads, HEAD_DIM, STATE_DIM, BLOCK_P,
                            BLOCK_N)  # fmt: skip
        weight = tl.load(w_ptr + tokens * num_heads + head, mask=mask, other=0.0)
        if EXP_WEIGHT:
            weight = tl.exp(weight)
        result = tl.dot(C, tl.trans(state.to(C.dtype))) * weight[:, None]  # [T, P] float32
        if HAS_Z:
            z = _load_tp(z_ptr, tokens, head, stride_z_t, mask_tp, HEAD_DIM, BLOCK_P)
            result = result * z * tl.sigmoid(z)
        _add_to_tp(out_ptr, tokens, head, stride_out_t, mask_tp, result, HEAD_DIM, BLOCK_P)


@triton.jit(do_not_specialize=("num_blocks",))
def _token_grad_kernel(
    grad_C_ptr, grad_w_ptr, grad_z_ptr, out_ptr, v_ptr, z_ptr, C_ptr, w_ptr, states_ptr,
    blocks_ptr, tokens_ptr,
    num_blocks, stride_gC_t, stride_gz_t, stride_out_t, stride_v_t, stride_z_t, stride_C_t,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, STATE_DIM: tl.constexpr,
    HAS_Z: tl.constexpr, EXP_WEIGHT: tl.constexpr, ADD_PRODUCT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (block, group), with u = (gate * v) . state ([T, N] per head):
    dC += sum_heads f(w) * u, dz += v * f(w) * (C . state) * silu'(z) (each sum in float32, rounded
    once to the gradient's dtype), and dw = f'(w) * sum_n u * C written to grad_w, contiguous
    [T, H] float32 (as w). With ADD_PRODUCT (no gate), also :func:`_token_product_kernel`'s
    out += f(w) * C . state on the same pass: the own states' backward needs both for the same
    tokens, states and weights (dx and dB, dw), and one pass reads C, the states and w once.
    """
    tokens, mask, slot = _block(blocks_ptr, tokens_ptr, tl.program_id(0), num_blocks, BLOCK_T)
    group = tl.program_id(1)
    num_heads = tl.num_programs(1) * HEADS_PER_GROUP
    p = tl.arange(0, BLOCK_P)
    mask_tp = mask[:, None] & (p[None, :] < HEAD_DIM)
    C, _, mask_tn = _load_C(C_ptr, tokens, group, stride_C_t, mask, STATE_DIM, BLOCK_N)
    grad_C, grad_C_at, _ = _load_C(grad_C_ptr, tokens, group, stride_gC_t, mask, STATE_DIM,
                                   BLOCK_N)  # fmt: skip
    grad_C = grad_C.to(tl.float32)
    for r in range(HEADS_PER_GROUP):
        head = group * HEADS_PER_GROUP + r
        state = _load_state(states_ptr, slot, head, num_heads, HEAD_DIM, STATE_DIM, BLOCK_P,
                            BLOCK_N)  # fmt: skip
        state = state.to(C.dtype)
        weight = tl.load(w_ptr + tokens * num_heads + head, mask=mask, other=0.0)
        if EXP_WEIGHT:
            weight = tl.exp(weight)
        v = _load_tp(v_ptr, tokens, head, stride_v_t, mask_tp, HEAD_DIM, BLOCK_P)
        if HAS_Z or ADD_PRODUCT:
            product = tl.dot(C, tl.trans(state))  # [T, P] float32
        if ADD_PRODUCT:
            _add_to_tp(out_ptr, tokens, head, stride_out_t, mask_tp, product * weight[:, None],
                       HEAD_DIM, BLOCK_P)  # fmt: skip
        if HAS_Z:
            z = _load_tp(z_ptr, tokens, head, stride_z_t, mask_tp, HEAD_DIM, BLOCK_P)
            sigmoid = tl.sigmoid(z)
            grad_z = v * product * weight[:, None] * (sigmoid * (1 + z * (1 - sigmoid)))
            _add_to_tp(grad_z_ptr, tokens, head, stride_gz_t, mask_tp, grad_z, HEAD_DIM, BLOCK_P)
            v = v * z * sigmoid
        u = tl.dot(v.to(C.dtype), state)  # [T, N] float32
        grad_w = tl.sum(u * C.to(tl.float32), axis=1)
        if EXP_WEIGHT:
            grad_w = grad_w * weight
        tl.store(grad_w_ptr + tokens * num_heads + head, grad_w, mask=mask)
        grad_C += u * weight[:, None]
    tl.store(grad_C_at, grad_C.to(grad_C_ptr.dtype.element_ty), mask=mask_tn)


@triton.jit(do_not_specialize=("num_blocks", "num_splits"))
def _state_sum_kernel(
    partial_ptr, v_ptr, z_ptr, C_ptr, w_ptr, blocks_ptr, splits_ptr, tokens_ptr,
    num_blocks, num_splits, stride_v_t, stride_z_t, stride_C_t,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, STATE_DIM: tl.constexpr,
    HAS_Z: tl.constexpr, EXP_WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (split, head): partial[split, head] = sum over the split's tokens, block by block in
    ascending order, of (f(w) * gate * v)^T C ([P, N]). partial is contiguous [NS, H, P, N], w
    contiguous [T, H]."""
    split = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    group = head // HEADS_PER_GROUP
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for block in range(tl.load(splits_ptr + split), tl.load(splits_ptr + num_splits + split)):
        tokens, mask, _ = _block(blocks_ptr, tokens_ptr, block, num_blocks, BLOCK_T)
        mask_tp = mask[:, None] & (p[None, :] < HEAD_DIM)
        C, _, _ = _load_C(C_ptr, tokens, group, stride_C_t, mask, STATE_DIM, BLOCK_N)
        v = _load_tp(v_ptr, tokens, head, stride_v_t, mask_tp, HEAD_DIM, BLOCK_P)
        if HAS_Z:
            z = _load_tp(z_ptr, tokens, head, stride_z_t, mask_tp, HEAD_DIM, BLOCK_P)
            v = v * z * tl.sigmoid(z)
        weight = tl.load(w_ptr + tokens * num_heads + head, mask=mask, other=0.0)
        if EXP_WEIGHT:
            weight = tl.exp(weight)
        acc += tl.dot(tl.trans((v * weight[:, None]).to(C.dtype)), C)
    tl.store(
        partial_ptr + ((split * num_heads + head) * HEAD_DIM + p[:, None]) * STATE_DIM + n[None, :],
        acc,
        mask=(p[:, None] < HEAD_DIM) & (n[None, :] < STATE_DIM),
    )


@triton.jit
def _piece_program(A_ptr, starts_ptr, lengths_ptr, pieces_ptr, num_pieces, num_heads,
                   BLOCK_H: tl.constexpr):  # fmt: skip
    """This program's piece (its segment, first and end token within the segment), its heads
    [BLOCK_H], their mask, A (float64), and the segment's start and length."""
    piece = tl.program_id(0)
    segment = tl.load(pieces_ptr + piece)
    first = tl.load(pieces_ptr + num_pieces + piece)
    end = tl.load(pieces_ptr + 2 * num_pieces + piece)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    A = tl.load(A_ptr + heads, mask=head_mask, other=0.0).to(tl.float64)
    start = tl.load(starts_ptr + segment)
    length = tl.load(lengths_ptr + segment)
    return segment, first, end, heads, head_mask, A, start, length


@triton.jit
def _segment_steps(dt_ptr, A, start, offset, limit, heads, head_mask, stride_dt_t, stride_dt_h,
                   BLOCK_T: tl.constexpr):  # fmt: skip
    """Tokens [BLOCK_T], mask [BLOCK_T, BLOCK_H], dt (float32) and a = dt * A (float64, 0 where
    masked) of the block of a segment's tokens at ``offset`` (tokens from ``limit`` on are
    masked)."""
    rows = tl.arange(0, BLOCK_T)
    tokens = start + offset + rows
    mask = ((offset + rows) < limit)[:, None] & head_mask[None, :]
    dt = tl.load(
        dt_ptr + tokens[:, None] * stride_dt_t + heads[None, :] * stride_dt_h, mask=mask, other=0.0
    )
    return tokens, mask, dt, tl.where(mask, dt.to(tl.float64) * A[None, :], 0.0)


@triton.jit
def _segment_sums(dt_ptr, A, start, length, first, heads, head_mask, stride_dt_t, stride_dt_h,
                  SUM_T: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Float64 sums over the segment, in blocks of SUM_T tokens, of a = dt * A (the segment's
    total log-decay) and of a before the piece's first token. Every program of a segment sums in
    the same order: the same total, bit for bit."""
    total = tl.zeros((BLOCK_H,), dtype=tl.float64)
    before = tl.zeros((BLOCK_H,), dtype=tl.float64)
    for offset in range(0, length, SUM_T):
        _, _, _, a = _segment_steps(dt_ptr, A, start, offset, length, heads, head_mask,
                                    stride_dt_t, stride_dt_h, SUM_T)  # fmt: skip
        earlier = ((offset + tl.arange(0, SUM_T)) < first)[:, None]
        total += tl.sum(a, axis=0)
        before += tl.sum(tl.where(earlier, a, 0.0), axis=0)
    return total, before


@triton.jit(do_not_specialize=("num_pieces",))
def _segment_decay_fwd_kernel(
    cum_ptr, weight_ptr, cum_end_ptr, dt_ptr, A_ptr, starts_ptr, lengths_ptr, pieces_ptr,
    num_pieces, num_heads, stride_dt_t, stride_dt_h,
    BLOCK_T: tl.constexpr, SUM_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (piece, head block): with a = dt * A (float64) summed within the segment,
    cum[t] = sum_{u <= t} a, cum_end = sum over the segment (written by the segment's first
    piece), input weight[t] = exp(cum_end - cum[t]) * dt[t], for the piece's tokens. cum and
    weight are contiguous [T, H] float32, cum_end [S, H] float32."""
    segment, first, end, heads, head_mask, A, start, length = _piece_program(
        A_ptr, starts_ptr, lengths_ptr, pieces_ptr, num_pieces, num_heads, BLOCK_H
    )
    total, running = _segment_sums(dt_ptr, A, start, length, first, heads, head_mask,
                                   stride_dt_t, stride_dt_h, SUM_T, BLOCK_H)  # fmt: skip
    if first == 0:
        tl.store(cum_end_ptr + segment * num_heads + heads, total.to(tl.float32), mask=head_mask)
    for offset in range(first, end, BLOCK_T):
        tokens, mask, dt, a = _segment_steps(dt_ptr, A, start, offset, end, heads, head_mask,
                                             stride_dt_t, stride_dt_h, BLOCK_T)  # fmt: skip
        cum = tl.cumsum(a, axis=0) + running[None, :]
        index = tokens[:, None] * num_heads + heads[None, :]
        tl.store(cum_ptr + index, cum.to(tl.float32), mask=mask)
        tl.store(weight_ptr + index, tl.exp((total[None, :] - cum).to(tl.float32)) * dt, mask=mask)
        running += tl.sum(a, axis=0)


@triton.jit(do_not_specialize=("num_pieces",))
def _piece_grad_sums_kernel(
    sums_ptr, grad_cum_ptr, grad_weight_ptr, dt_ptr, A_ptr, starts_ptr, lengths_ptr, pieces_ptr,
    num_pieces, num_heads, stride_dt_t, stride_dt_h,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (piece, head block), the first pass of :func:`segment_decay_backward`: float64
    sums over the piece's tokens t of a = dt * A, of d cum, and of d weight[t] * dt[t] *
    exp(sum of a over the piece's tokens after t), to sums [3, pieces, H] (contiguous float64).
    The last is the piece's part of sum_t d weight * weight but for exp(sum of a over the
    segment's tokens after the piece), which the second pass multiplies in; every exponent is
    <= 0 (a <= 0), however long the segment."""
    _, first, end, heads, head_mask, A, start, _ = _piece_program(
        A_ptr, starts_ptr, lengths_ptr, pieces_ptr, num_pieces, num_heads, BLOCK_H
    )
    sum_a = tl.zeros((BLOCK_H,), dtype=tl.float64)
    sum_grad_cum = tl.zeros((BLOCK_H,), dtype=tl.float64)
    grad_to_end = tl.zeros((BLOCK_H,), dtype=tl.float64)
    for offset in range(first, end, BLOCK_T):
        tokens, mask, dt, a = _segment_steps(dt_ptr, A, start, offset, end, heads, head_mask,
                                             stride_dt_t, stride_dt_h, BLOCK_T)  # fmt: skip
        index = tokens[:, None] * num_heads + heads[None, :]
        grad_cum = tl.load(grad_cum_ptr + index, mask=mask, other=0.0)
        grad_weight = tl.load(grad_weight_ptr + index, mask=mask, other=0.0)
        step = tl.sum(a, axis=0)
        after = step[None, :] - tl.cumsum(a, axis=0)  # sum of a over the block after t
        decay = tl.exp(after.to(tl.float32))
        grad_to_end = grad_to_end * tl.exp(step.to(tl.float32)).to(tl.float64) + tl.sum(
            (grad_weight * dt * decay).to(tl.float64), axis=0
        )
        sum_a += step
        sum_grad_cum += tl.sum(grad_cum.to(tl.float64), axis=0)
    at = tl.program_id(0) * num_heads + heads
    tl.store(sums_ptr + at, sum_a, mask=head_mask)
    tl.store(sums_ptr + num_pieces * num_heads + at, sum_grad_cum, mask=head_mask)
    tl.store(sums_ptr + 2 * num_pieces * num_heads + at, grad_to_end, mask=head_mask)


@triton.jit(do_not_specialize=("num_pieces", "piece_length"))
def _segment_decay_bwd_kernel(
    grad_dt_ptr, grad_A_partial_ptr, grad_cum_ptr, grad_weight_ptr, sums_ptr, chain_partial_ptr,
    segment_slot_ptr, dt_ptr, A_ptr, starts_ptr, lengths_ptr, pieces_ptr,
    num_pieces, num_heads, num_chunks, piece_length,
    stride_dt_t, stride_dt_h, stride_gdt_t, stride_gdt_h,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, MAX_PIECES: tl.constexpr,
):  # fmt: skip
    """Program (piece, head block), gradients of :func:`_segment_decay_fwd_kernel` at the piece's
    tokens. With g_te[t] = d weight[t] * weight[t] (the gradient of cum_end - cum[t]):
    d a[u] = sum_{t >= u} d cum[t] + sum_{t < u} g_te[t] + d cum_end, d dt = d a * A + d weight *
    exp(cum_end - cum), and per piece d A = sum_u d a[u] * dt[u] (grad_A_partial [pieces, H],
    float32, summed by the caller). What the piece needs of its segment's other tokens comes from
    the per-piece sums of :func:`_piece_grad_sums_kernel` (sums), read for the segment's pieces
    (at most MAX_PIECES, consecutive; the piece's index among them is first // piece_length) and
    summed in piece order, the same for every program of the segment. Float64 sums; d dt is added
    to grad_dt ([T, H] float32, rounded once); grad_cum and grad_weight are contiguous [T, H].
    d cum_end of a segment whose end state is chained from its parent's (segment_slot[segment] =
    its slot, else -1) is exp(cum_end) times the sum, in chunk order, of the chain backward's
    partials [slots, H, num_chunks]; of any other segment, 0."""
    segment, first, end, heads, head_mask, A, start, length = _piece_program(
        A_ptr, starts_ptr, lengths_ptr, pieces_ptr, num_pieces, num_heads, BLOCK_H
    )
    index_in_segment = first // piece_length
    count = (tl.maximum(length, 1) + piece_length - 1) // piece_length
    order = tl.arange(0, MAX_PIECES)
    at = (tl.program_id(0) - index_in_segment + order)[:, None] * num_heads + heads[None, :]
    valid = (order < count)[:, None] & head_mask[None, :]
    piece_a = tl.load(sums_ptr + at, mask=valid, other=0.0)
    piece_grad_cum = tl.load(sums_ptr + num_pieces * num_heads + at, mask=valid, other=0.0)
    piece_to_end = tl.load(sums_ptr + 2 * num_pieces * num_heads + at, mask=valid, other=0.0)
    total = tl.sum(piece_a, axis=0)
    earlier = (order < index_in_segment)[:, None]
    before = tl.sum(tl.where(earlier, piece_a, 0.0), axis=0)
    grad_cum_from = tl.sum(tl.where(earlier, 0.0, piece_grad_cum), axis=0)
    # sum_{t < first} g_te[t]: each earlier piece's sum times exp(sum of a after that piece).
    after_piece = total[None, :] - tl.cumsum(piece_a, axis=0)
    grad_to_end_before = tl.sum(
        tl.where(earlier, piece_to_end * tl.exp(after_piece.to(tl.float32)).to(tl.float64), 0.0),
        axis=0,
    )
    grad_cum_end = tl.zeros((BLOCK_H,), dtype=tl.float32)
    slot = tl.load(segment_slot_ptr + segment)
    if slot >= 0:
        for chunk in range(num_chunks):
            grad_cum_end += tl.load(
                chain_partial_ptr + (slot * num_heads + heads) * num_chunks + chunk,
                mask=head_mask,
                other=0.0,
            )
        grad_cum_end *= tl.exp(total.to(tl.float32))
    # d a[u] at the piece's first token; the loop adds the prefixes of later tokens.
    carry = grad_cum_from + grad_to_end_before + grad_cum_end.to(tl.float64)
    cum_before = before
    grad_A = tl.zeros((BLOCK_H,), dtype=tl.float64)
    for offset in range(first, end, BLOCK_T):
        tokens, mask, dt, a = _segment_steps(dt_ptr, A, start, offset, end, heads, head_mask,
                                             stride_dt_t, stride_dt_h, BLOCK_T)  # fmt: skip
        index = tokens[:, None] * num_heads + heads[None, :]
        cum = tl.cumsum(a, axis=0) + cum_before[None, :]
        decay = tl.exp((total[None, :] - cum).to(tl.float32))
        grad_weight = tl.load(grad_weight_ptr + index, mask=mask, other=0.0)
        grad_to_end = (grad_weight * decay * dt).to(tl.float64)
        grad_cum = tl.load(grad_cum_ptr + index, mask=mask, other=0.0).to(tl.float64)
        # exclusive prefixes within the block: sum_{t < u} of (g_te - d cum)
        step = grad_to_end - grad_cum
        grad_a = carry[None, :] + tl.cumsum(step, axis=0) - step
        grad_dt = grad_a * A[None, :] + (grad_weight * decay).to(tl.float64)
        grad_dt_at = grad_dt_ptr + tokens[:, None] * stride_gdt_t + heads[None, :] * stride_gdt_h
        grad_dt += tl.load(grad_dt_at, mask=mask, other=0.0).to(tl.float64)
        tl.store(grad_dt_at, grad_dt.to(tl.float32), mask=mask)
        grad_A += tl.sum(tl.where(mask, grad_a * dt.to(tl.float64), 0.0), axis=0)
        carry += tl.sum(step, axis=0)
        cum_before += tl.sum(a, axis=0)
    tl.store(
        grad_A_partial_ptr + tl.program_id(0) * num_heads + heads,
        grad_A.to(tl.float32),
        mask=head_mask,
    )


@triton.jit
def _slot_sum(partial_ptr, slot_splits_ptr, slot, num_slots, head, num_heads, size, offsets, mask,
              BLOCK: tl.constexpr):  # fmt: skip
    """[BLOCK] float32: a slot's own state, the sum of its splits' partials in index order."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    end = tl.load(slot_splits_ptr + num_slots + slot)
    for split in range(tl.load(slot_splits_ptr + slot), end):
        at = (split * num_heads + head) * size + offsets
        acc += tl.load(partial_ptr + at, mask=mask, other=0.0)
    return acc


@triton.jit(do_not_specialize=("num_slots",))
def _chain_fwd_kernel(copy_ptr, parent_ends_ptr, partial_ptr, slot_splits_ptr, cum_end_ptr,
                      slot_segment_ptr, slot_parent_ptr, parent_row_ptr, num_slots, num_heads,
                      size, BLOCK: tl.constexpr):  # fmt: skip
    """Program (head, chunk): end[s] = own[s] + exp(cum_end[segment(s)]) * end[parent(s)], slots
    in increasing order (parents first), own[s] the sum of the slot's splits (``_slot_sum``),
    written rounded to copy's dtype in copy (the states the token products read) and, for a slot
    that is another's parent (parent_row[s] >= 0), in float32 to parent_ends[parent_row[s]] (the
    states the chain reads, forward and backward). copy: contiguous [S, H, size]; partial:
    contiguous [splits, H, size]; parent_ends: contiguous [rows, H, size]."""
    head = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    for slot in range(num_slots):
        here = (slot * num_heads + head) * size + offsets
        value = _slot_sum(partial_ptr, slot_splits_ptr, slot, num_slots, head, num_heads, size,
                          offsets, mask, BLOCK)  # fmt: skip
        parent = tl.load(slot_parent_ptr + slot)
        if parent >= 0:
            decay = tl.exp(
                tl.load(cum_end_ptr + tl.load(slot_segment_ptr + slot) * num_heads + head)
            )
            there = (tl.load(parent_row_ptr + parent) * num_heads + head) * size + offsets
            value += decay * tl.load(parent_ends_ptr + there, mask=mask)
        tl.store(copy_ptr + here, value.to(copy_ptr.dtype.element_ty), mask=mask)
        row = tl.load(parent_row_ptr + slot)
        if row >= 0:
            tl.store(parent_ends_ptr + (row * num_heads + head) * size + offsets, value, mask=mask)
        # A later slot reads parent_ends[row] back, and the compiler may map an element of that
        # load to another thread than the store's (it lays out the float32 and bf16 accesses
        # apart).
        tl.debug_barrier()


@triton.jit(do_not_specialize=("num_slots",))
def _chain_bwd_kernel(grad_ptr, partial_ptr, slot_splits_ptr, copy_ptr, grad_decay_partial_ptr,
                      parent_ends_ptr, cum_end_ptr, slot_segment_ptr, slot_parent_ptr,
                      parent_row_ptr, num_slots, num_heads, size,
                      BLOCK: tl.constexpr):  # fmt: skip
    """Program (head, chunk). First grad[s] = d end[s], the sum of the slot's splits
    (``_slot_sum``) for every slot; then slots in decreasing order (children first), in place:
    grad becomes d own: when slot s is reached, its children have added their parts, so grad[s]
    is final; it is rounded to copy's dtype in copy, s passes exp(cum_end) * grad[s] to its
    parent, and grad_decay_partial[s, head, chunk] = sum over the chunk of grad[s] *
    end[parent(s)] (the parent's float32 end state, parent_ends[parent_row[parent(s)]]). grad:
    contiguous [S, H, size], written before it is read."""
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    for slot in range(num_slots):
        grad = _slot_sum(partial_ptr, slot_splits_ptr, slot, num_slots, head, num_heads, size,
                         offsets, mask, BLOCK)  # fmt: skip
        tl.store(grad_ptr + (slot * num_heads + head) * size + offsets, grad, mask=mask)
    tl.debug_barrier()  # the walk reads them back, maybe in other threads than wrote them
    for index in range(num_slots):
        slot = num_slots - 1 - index
        here = (slot * num_heads + head) * size + offsets
        grad = tl.load(grad_ptr + here, mask=mask, other=0.0)
        tl.store(copy_ptr + here, grad.to(copy_ptr.dtype.element_ty), mask=mask)
        parent = tl.load(slot_parent_ptr + slot)
        partial = 0.0
        if parent >= 0:
            there = (parent * num_heads + head) * size + offsets
            parent_end = (tl.load(parent_row_ptr + parent) * num_heads + head) * size + offsets
            decay = tl.exp(
                tl.load(cum_end_ptr + tl.load(slot_segment_ptr + slot) * num_heads + head)
            )
            partial = tl.sum(
                grad * tl.load(parent_ends_ptr + parent_end, mask=mask, other=0.0), axis=0
            )
            tl.store(
                grad_ptr + there, tl.load(grad_ptr + there, mask=mask) + decay * grad, mask=mask
            )
        tl.store(
            grad_decay_partial_ptr + (slot * num_heads + head) * tl.num_programs(1) + chunk, partial
        )
        tl.debug_barrier()  # grad[parent] is read back by a later slot (as in the forward)


def _rows_apart(tensor) -> bool:
    """Whether [T, X, Y] ``tensor``'s dimensions after the token's are contiguous: the token
    kernels address its rows by one stride (each launch argument costs host time, about 1 us on
    an H100's host, and a layer call makes five of these launches)."""
    stride, shape = tensor.stride(), tensor.shape
    return stride[2] == 1 and (stride[1] == shape[2] or shape[1] == 1)


def _row_stride(tensor, name) -> int:
    """The token stride of an output [T, X, Y] (None: 0), written in place by a kernel."""
    if tensor is None:
        return 0
    if not _rows_apart(tensor):
        raise ValueError(
            f"the forked states' kernels write {name} in place and need its dimensions after the "
            f"token's contiguous, got shape {tuple(tensor.shape)} and strides {tensor.stride()}"
        )
    return tensor.stride(0)


def _rows(tensor):
    """(``tensor``, its token stride) for an input [T, X, Y] whose dimensions after the token's
    are contiguous, else (a contiguous copy, its stride); None: (None, 0)."""
    if tensor is None:
        return None, 0
    if not _rows_apart(tensor):
        tensor = tensor.contiguous()
    return tensor, tensor.stride(0)


@functools.lru_cache(maxsize=None)
def _launch_sizes(heads, head_dim, groups, state_dim):
    """The constexpr arguments of the token kernels for a layer's sizes (computed once: the
    model's sizes are constants, so they compile one variant per layer shape)."""
    return {
        "HEADS_PER_GROUP": heads // groups,
        "HEAD_DIM": head_dim,
        "STATE_DIM": state_dim,
        "BLOCK_P": _pow2(head_dim),
        "BLOCK_N": _pow2(state_dim),
    }


def _sizes(values, C):
    """The token kernels' constexpr sizes of values [T, H, P] and C [T, G, N]."""
    return _launch_sizes(*values.shape[1:], *C.shape[1:])


def _in_product_dtype(states, C):
    """Contiguous states in C's dtype, in which every program multiplies them (each program reads
    the state of every head of its group: in bf16 that is half the reads of float32). The parent
    chain writes them so; this rounds states given in another dtype once, as it does."""
    if states.dtype == C.dtype and states.is_contiguous():
        return states
    return states.to(C.dtype).contiguous()


def token_product(z, C, w, states, tables: TokenBlocks, *, exp_weight, out):
    """Add ``f(w) * gate(z) * C . states[slot]`` to ``out`` ([T, H, P]) in place at the tokens of
    ``tables``. z: [T, H, P] or None; C [T, G, N]; w [T, H] float32; states [S, H, P, N]."""
    num_blocks = tables.blocks.shape[1]
    if num_blocks == 0:
        return out
    (z, stride_z), (C, stride_C), w = _rows(z), _rows(C), w.contiguous()
    states = _in_product_dtype(states, C)
    _token_product_kernel[(num_blocks, C.shape[1])](
        out, z if z is not None else out, C, w, states, tables.blocks, tables.tokens,
        num_blocks, _row_stride(out, "out"), stride_z, stride_C,
        HAS_Z=z is not None, EXP_WEIGHT=exp_weight, BLOCK_T=TOKENS_PER_BLOCK, **_sizes(out, C),
        num_stages=TOKEN_PRODUCT_STAGES,
    )  # fmt: skip
    return out


def token_grad(v, z, C, w, states, tables: TokenBlocks, *, exp_weight, grad_C, grad_z=None,
               product_out=None):  # fmt: skip
    """Gradients of :func:`token_product` given v, its output's gradient: dC is added to grad_C
    ([T, G, N]) and, with z, dz to grad_z ([T, H, P]), in place at the tables' tokens; returns
    dw [T, H] float32, zero outside the tables' tokens. With ``product_out`` ([T, H, P]; no z),
    the same pass also adds :func:`token_product`'s ``f(w) * C . states[slot]`` to it."""
    if product_out is not None and z is not None:
        raise ValueError("token_grad adds the token product only without a gate (z is None)")
    grad_w = torch.zeros(v.shape[0], v.shape[1], dtype=torch.float32, device=C.device)
    num_blocks = tables.blocks.shape[1]
    if num_blocks:
        (v, stride_v), (z, stride_z), (C, stride_C) = _rows(v), _rows(z), _rows(C)
        w, states = w.contiguous(), _in_product_dtype(states, C)
        grad_z = grad_z if z is not None else None
        _token_grad_kernel[(num_blocks, C.shape[1])](
            grad_C, grad_w, grad_z if grad_z is not None else grad_w,
            product_out if product_out is not None else v, v, z if z is not None else v,
            C, w, states, tables.blocks, tables.tokens, num_blocks,
            _row_stride(grad_C, "grad_C"), _row_stride(grad_z, "grad_z"),
            _row_stride(product_out, "product_out"), stride_v, stride_z, stride_C,
            HAS_Z=z is not None, EXP_WEIGHT=exp_weight, ADD_PRODUCT=product_out is not None,
            BLOCK_T=TOKENS_PER_BLOCK, **_sizes(v, C),
        )  # fmt: skip
    return grad_w


@dataclasses.dataclass(frozen=True)
class StatePartials:
    """A state sum in splits, as the parent chain reads it: partial [NS, H, P, N] float32 (per
    split, the sum over its tokens), slot_splits [2, S] int32 (per slot, its first and end split).
    The chain adds each slot's splits in index order where it reads the slot's state, so no
    [S, H, P, N] sum is written and launched for on its own."""

    partial: torch.Tensor
    slot_splits: torch.Tensor


def state_sum(v, z, C, w, tables: TokenBlocks, *, exp_weight) -> StatePartials:
    """Per slot, the sum over its tokens of (f(w) * gate(z) * v)^T C ([P, N] per head), as the
    float32 partial sums of its splits."""
    num_blocks, num_splits = tables.blocks.shape[1], tables.splits.shape[1]
    # Every element is written by the kernel: no fill.
    partial = torch.empty(num_splits, *v.shape[1:], C.shape[2], device=C.device)
    if num_splits:
        (v, stride_v), (z, stride_z), (C, stride_C) = _rows(v), _rows(z), _rows(C)
        _state_sum_kernel[(num_splits, v.shape[1])](
            partial, v, z if z is not None else v, C, w.contiguous(), tables.blocks,
            tables.splits, tables.tokens, num_blocks, num_splits, stride_v, stride_z, stride_C,
            HAS_Z=z is not None, EXP_WEIGHT=exp_weight, BLOCK_T=TOKENS_PER_BLOCK, **_sizes(v, C),
        )  # fmt: skip
    return StatePartials(partial, tables.slot_splits)


# Tokens per step and heads per program of the segment walk, from a sweep of the walk before it
# was cut into pieces (H200, 64 heads, a 4096-token prompt walked whole by one program): 128 x 4
# took 0.2 ms forward and backward, 64 x 16 0.4 ms.
DECAY_BLOCK_T = 128
DECAY_BLOCK_H = 4
DECAY_SUM_T = 512  # tokens per step of the forward's sums over a whole segment
DECAY_PIECES = 8  # pieces of the longest segment: each forward program reads the whole segment


def piece_table(segment_lengths) -> np.ndarray:
    """[3, pieces] int32 (segment, first token, end token counted from the segment's start) of the
    segments of ``segment_lengths`` (host ints) cut into pieces of one length for the whole row, a
    multiple of DECAY_BLOCK_T that cuts the longest segment into at most DECAY_PIECES; an empty
    segment gets one empty piece (its cum_end is still written).

    One length for the row: the walk takes the time of the longest segment's programs, so shorter
    segments are cut no finer (each of a segment's forward programs reads the whole segment)."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    longest = int(lengths.max(initial=0))
    piece = max(-(-longest // (DECAY_PIECES * DECAY_BLOCK_T)), 1) * DECAY_BLOCK_T
    counts = -(-np.maximum(lengths, 1) // piece)
    segment = np.repeat(np.arange(len(lengths)), counts)
    first = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * piece
    end = np.minimum(first + piece, lengths[segment])
    return np.stack([segment, first, end]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SegmentPieces:
    """The segments of a forest row and the pieces the segment walk splits them into (built once
    per forest, cached on it).

    Why pieces: the walk's sums run serially over a segment's tokens, so one program per segment
    takes the time of the longest segment (a 4096-token prompt: 64 steps forward and as many
    backward). With one program per piece, a forward program first sums its whole segment in long
    steps (reading only dt), then walks its piece alone; the backward sums each piece in one pass
    and then walks each piece, reading its segment's other pieces' sums
    (:func:`segment_decay_backward`).

    Attributes: starts, lengths [segments] int64 (the forest's); pieces [3, NP] int32
    (:func:`piece_table`); piece_length, the row's piece length (the longest piece; a piece's
    index in its segment is its first token // piece_length); max_segment_pieces, the most pieces
    of one segment (DECAY_PIECES when the table was built).
    """

    starts: torch.Tensor
    lengths: torch.Tensor
    pieces: torch.Tensor
    piece_length: int
    max_segment_pieces: int

    @classmethod
    def of(cls, forest: ForestTensors) -> "SegmentPieces":
        """The pieces of ``forest``'s segments (built on first use, cached on it)."""
        return forest.derive(
            ("segment_pieces", DECAY_BLOCK_T, DECAY_PIECES), lambda: cls._build(forest)
        )

    @classmethod
    def _build(cls, forest: ForestTensors) -> "SegmentPieces":
        table = piece_table(forest.layout.segment_lengths)
        return cls(
            forest.segment_starts,
            forest.segment_lengths,
            host_to_device(table, forest.device),
            max(int((table[2] - table[1]).max(initial=0)), 1),
            DECAY_PIECES,
        )


def segment_decay(dt, A, segments: SegmentPieces):
    """(cum [T, H], input_weight [T, H], cum_end [S, H]), float32, of (1)-(2) in tree_scan.py.

    With a = dt * A summed in float64 within each segment: cum[t] = the sum up to t, cum_end = the
    segment's sum, input_weight[t] = exp(cum_end - cum[t]) * dt[t]. One program per (piece, head
    block) (no [T, H] float64 temporaries, no gathers).

    Inputs: dt [T, H] float32 (processed step sizes), A [H] float32, the row's segments (covering
    every token) and their pieces.
    """
    length, heads = dt.shape
    num_pieces = segments.pieces.shape[1]
    cum = torch.empty(length, heads, dtype=torch.float32, device=dt.device)
    weight = torch.empty_like(cum)
    cum_end = torch.empty(segments.starts.shape[0], heads, dtype=torch.float32, device=dt.device)
    _segment_decay_fwd_kernel[(num_pieces, _cdiv(heads, DECAY_BLOCK_H))](
        cum, weight, cum_end, dt, A, segments.starts, segments.lengths, segments.pieces,
        num_pieces, heads, *dt.stride(),
        BLOCK_T=DECAY_BLOCK_T, SUM_T=DECAY_SUM_T, BLOCK_H=DECAY_BLOCK_H,
    )  # fmt: skip
    return cum, weight, cum_end


def segment_decay_backward(grad_cum, grad_weight, chain_partial, segment_slot, dt, A, segments,
                           *, grad_dt):  # fmt: skip
    """Gradients of :func:`segment_decay` given those of cum and input_weight (contiguous [T, H]
    float32) and, as the partials of :func:`chain_states_backward` (chain_partial), of cum_end
    (segment_slot [segments] int64: the slot of a segment whose end state is chained from its
    parent's, else -1, for which d cum_end = 0). d dt is added to grad_dt ([T, H] float32) in
    place; returns d A [H] float32."""
    heads = dt.shape[1]
    num_pieces = segments.pieces.shape[1]
    grid = (num_pieces, _cdiv(heads, DECAY_BLOCK_H))
    tables = (segments.starts, segments.lengths, segments.pieces)
    # Two passes over each piece: its sums, then the walk, which reads its segment's other pieces'
    # sums instead of the segment's tokens.
    sums = torch.empty(3, num_pieces, heads, dtype=torch.float64, device=dt.device)
    _piece_grad_sums_kernel[grid](
        sums, grad_cum, grad_weight, dt, A, *tables, num_pieces, heads, *dt.stride(),
        BLOCK_T=DECAY_BLOCK_T, BLOCK_H=DECAY_BLOCK_H,
    )  # fmt: skip
    grad_A_partial = torch.empty(num_pieces, heads, dtype=torch.float32, device=dt.device)
    _segment_decay_bwd_kernel[grid](
        grad_dt, grad_A_partial, grad_cum, grad_weight, sums, chain_partial, segment_slot,
        dt, A, *tables, num_pieces, heads, chain_partial.shape[-1], segments.piece_length,
        *dt.stride(), *grad_dt.stride(), BLOCK_T=DECAY_BLOCK_T, BLOCK_H=DECAY_BLOCK_H,
        MAX_PIECES=_pow2_at_least_1(segments.max_segment_pieces),
    )  # fmt: skip
    return grad_A_partial.sum(0)


def chain_states(own: StatePartials, cum_end, slot_segment, slot_parent, parent_row,
                 num_parent_rows, *, copy_dtype):  # fmt: skip
    """The end states ``end[s] = own[s] + exp(cum_end[segment(s)]) * end[parent(s)]`` (parents
    first; a root's end state is its own) of all internal segments, in one kernel launch:
    (copy [S, H, P, N] in ``copy_dtype``, every slot's end state rounded once; parent_ends
    [num_parent_rows, H, P, N] float32, the end states of the slots that are another's parent, by
    parent_row). Those are what the token products and the chain's backward read: the float32
    end states of the other slots are never written.

    Inputs: own, the internal segments' own states (:func:`state_sum`; the chain adds their
    splits), cum_end [segments, H] float32, slot_segment [S] int64 (the segment of each slot),
    slot_parent [S] int64 (the parent's slot, -1 for a root), parent_row [S] int64 (a parent's
    row in parent_ends, -1 for a slot that is no parent: ``TreeScanPlan.chain_parent_row``).
    """
    partial, slots = own.partial, own.slot_splits.shape[1]
    heads, size = partial.shape[1], partial.shape[2] * partial.shape[3]
    copy = torch.empty(slots, *partial.shape[1:], dtype=copy_dtype, device=partial.device)
    parent_ends = partial.new_empty(num_parent_rows, *partial.shape[1:])
    # Without parents no program touches parent_ends: any tensor stands in for its empty pointer.
    _chain_fwd_kernel[(heads, _cdiv(size, SUM_BLOCK))](
        copy, parent_ends if num_parent_rows else partial, partial, own.slot_splits, cum_end,
        slot_segment, slot_parent, parent_row, slots, heads, size, BLOCK=SUM_BLOCK,
    )  # fmt: skip
    return copy, parent_ends


def chain_states_backward(grad_ends: StatePartials, parent_ends, cum_end, slot_segment,
                          slot_parent, parent_row, *, copy_dtype):  # fmt: skip
    """Gradients of :func:`chain_states` given d ends (in splits, as :func:`state_sum` returns
    them) and its float32 parents' end states parent_ends: (d own [S, H, P, N] in
    ``copy_dtype``, partials [S, H, chunks] float32). d own is summed in a float32 buffer of the
    kernel, then rounded once. partials[s, h, c] = sum over chunk c of the state of d own[s] *
    end[parent(s)]: d cum_end[segment(s)] = exp(cum_end[segment(s)]) * their sum over chunks,
    which :func:`segment_decay_backward` adds where it needs it (no [segments, H] tensor is
    built)."""
    partial, slots = grad_ends.partial, grad_ends.slot_splits.shape[1]
    heads, size = partial.shape[1], partial.shape[2] * partial.shape[3]
    chunks = _cdiv(size, SUM_BLOCK)
    grad = partial.new_empty(slots, *partial.shape[1:])
    copy = torch.empty_like(grad, dtype=copy_dtype)
    grad_decay = torch.empty(slots, heads, chunks, device=partial.device)
    _chain_bwd_kernel[(heads, chunks)](  # parent_ends as in chain_states
        grad, partial, grad_ends.slot_splits, copy, grad_decay,
        parent_ends if parent_ends.numel() else grad, cum_end, slot_segment, slot_parent,
        parent_row, slots, heads, size, BLOCK=SUM_BLOCK,
    )  # fmt: skip
    return copy, grad_decay


@dataclasses.dataclass(frozen=True)
class ForkedStates:
    """The forked states of one forest row, (1)-(2) of tree_scan.py, in four steps around the
    packed scan: :meth:`states` and :meth:`correct` (forward: the correction written into the
    scan's output in place), :meth:`backward_states` and :meth:`backward_tokens` (backward: the
    fork's gradients added into the scan's).

    tree_scan's ``_ForkedChunkScan`` runs them around mamba_ssm's scan in one autograd function:
    the gradients of x, dt, B, C and z then get the fork's part added at the tokens it touches,
    instead of as zero-filled activation-sized tensors that autograd sums with the scan's, and
    the corrected output is the scan's own, not a copy. :meth:`states` and
    :meth:`backward_states` read nothing the scan computes, so they run on a stream of their own
    beside it.

    Shapes: x, z [T, H, P] (z None without the gate), dt [T, H] float32 (processed), A [H]
    float32, B, C [T, G, N]; their gradients alike.

    Attributes: segments, the row's segments and their pieces (the segment walk's table); own
    and children, the token tables of every internal segment's own tokens and of its children's
    tokens (slot = its index among the internal segments); slot_segment, slot_parent [S] int64,
    segment_chain_slot, chain_parent_row and num_chain_parents, the chain's tables
    (``TreeScanPlan``).

    Every row runs the chain, also a row whose internal segments have no parent (there it only
    rounds the states): one path and one set of kernel variants for every row, which the mixer's
    warm-up compiles with one forest.
    """

    segments: SegmentPieces
    own: TokenBlocks
    children: TokenBlocks
    slot_segment: torch.Tensor
    slot_parent: torch.Tensor
    segment_chain_slot: torch.Tensor
    chain_parent_row: torch.Tensor
    num_chain_parents: int

    @classmethod
    def of(cls, forest: ForestTensors, plan) -> "ForkedStates":
        """The forked states of ``forest`` given its ``TreeScanPlan`` (tables cached on it)."""
        return cls(
            segments=SegmentPieces.of(forest),
            own=TokenBlocks.of(
                forest,
                "internal segment tokens",
                lambda: [np.arange(first, end) for _, first, end, _ in plan.internal],
            ),
            children=TokenBlocks.of(forest, "child tokens", lambda: plan.host_child_tokens),
            slot_segment=plan.slot_segment,
            slot_parent=plan.slot_parent,
            segment_chain_slot=plan.segment_chain_slot,
            chain_parent_row=plan.chain_parent_row,
            num_chain_parents=plan.num_chain_parents,
        )

    def states(self, x, dt, A, B, dtype):
        """The end states of every internal segment, (2), from x, dt, A and B.

        Returns (cum [T, H] float32 log-decays, what :meth:`correct` reads; the end states
        [S, H, P, N] in ``dtype``, what the products multiply; in float32, those of the segments
        that are another internal segment's parent, [num_chain_parents, H, P, N], what the
        chain's backward reads). The [T, H] log-decays and input weights are not kept for
        backward: it recomputes them, the same bits, with one launch of the segment walk, rather
        than keep 8 bytes per token and head.
        """
        cum, weight, cum_end = segment_decay(dt, A, self.segments)
        own = state_sum(x, None, B, weight, self.own, exp_weight=False)
        ends, parent_ends = chain_states(
            own, cum_end, self.slot_segment, self.slot_parent, self.chain_parent_row,
            self.num_chain_parents, copy_dtype=dtype,
        )  # fmt: skip
        return cum, ends, parent_ends

    def correct(self, y, z, C, cum, ends):
        """(1): ``y += gate * exp(cum) * (C . ends[parent])`` in place at every child token of
        y [T, H, P], the packed scan's output (gated by silu(z) when z is given); cum and ends as
        :meth:`states` returned them."""
        token_product(z, C, cum, ends, self.children, exp_weight=True, out=y)

    def backward_states(self, grad_y, saved, z, dt, A, C, dtype):
        """The gradients of the end states, from the children's tokens back through the chain;
        grad_y: the corrected output's gradient, saved: (end states, parents' float32 end
        states) as :meth:`states` returned them. Returns what :meth:`backward_tokens` reads: (cum,
        weight [T, H] float32, the own states' gradients [S, H, P, N] in ``dtype``, the chain's
        [S, H] decay partials)."""
        _, parent_ends = saved
        cum, weight, cum_end = segment_decay(dt, A, self.segments)
        grad_own, chain_partial = chain_states_backward(
            state_sum(grad_y, z, C, cum, self.children, exp_weight=True),
            parent_ends,
            cum_end,
            self.slot_segment,
            self.slot_parent,
            self.chain_parent_row,
            copy_dtype=dtype,
        )
        return cum, weight, grad_own, chain_partial

    def backward_tokens(self, grad_y, saved, states, x, z, dt, A, B, C, *, grad_x, grad_dt,
                        grad_B, grad_C, grad_z):  # fmt: skip
        """Add the fork's token gradients to the packed scan's, in place: grad_x, grad_z,
        grad_dt, grad_B, grad_C (grad_z None without z); ``states``: what
        :meth:`backward_states` returned. Returns d A [H] float32, to be added to the scan's."""
        ends, _ = saved
        cum, weight, grad_own, chain_partial = states
        grad_cum = token_grad(
            grad_y, z, C, cum, ends, self.children, exp_weight=True, grad_C=grad_C, grad_z=grad_z
        )
        # dx (the own states' token product) and dB, dw (their token gradient) in one pass.
        grad_weight = token_grad(
            x, None, B, weight, grad_own, self.own, exp_weight=False, grad_C=grad_B,
            product_out=grad_x,
        )  # fmt: skip
        return segment_decay_backward(
            grad_cum,
            grad_weight,
            chain_partial,
            self.segment_chain_slot,
            dt,
            A,
            self.segments,
            grad_dt=grad_dt,
        )
