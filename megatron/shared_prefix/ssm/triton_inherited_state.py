"""Triton kernels for the tree scan's inherited-state correction (upstream: megatron/core/ssm/ops).

:func:`tree_scan.tree_ssd_scan` adds, at every token ``t`` of a non-root segment,

    out[t, h] = y[t, h] + gate[t, h] * exp(cum[t, h]) * (C[t, g(h)] . state[parent(t), h])

where ``state[parent, h]`` is the [P, N] SSM state at the end of the parent segment. In plain torch
(``tree_scan._InheritedStateOutput``, the oracle) this is a handful of gathers, float32 temporaries
as large as the layer output and batched GEMMs per parent; here it is one kernel forward and two
backward, each reading the bf16 activations once.

Precision follows mamba_ssm's chunk scan, which passes states between chunks the same way: the
float32 state is rounded to C's dtype and multiplied on tensor cores with float32 accumulation
(``tl.dot``; TF32 for float32 inputs); decay, gate and sums are float32.

Work is split into blocks of :data:`TOKENS_PER_BLOCK` child tokens of one parent (a table built
once per forest). Every output element is written by exactly one program and every reduction runs
in a fixed order (the state gradient: a fixed split of each parent's child tokens, then a sum over
the splits in index order), so results are bitwise reproducible; there are no atomics.

Shapes: T packed tokens, H heads in G groups (R = H / G heads per group), head dim P, state dim N,
S internal (parent) segments.
"""

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl

from megatron.shared_prefix.tensors import ForestTensors

# Mamba's notation (A, B, C, D) is kept for the SSM's tensors.
# pylint: disable=invalid-name

TOKENS_PER_BLOCK = 64  # child tokens per program
SPLIT_BLOCKS = 16  # token blocks summed by one program of the state-gradient kernel
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class ChildBlocks:
    """Work tables of one forest (built once, cached on it).

    Attributes:
        tokens: [K] int64 child tokens grouped by parent slot (each parent's run ascending).
        blocks: [3, NB] int32 per block: offset into ``tokens``, token count (at most
            TOKENS_PER_BLOCK), parent slot.
        splits: [2, NS] int32 per split: first block, end block (exclusive); one parent per split.
        slot_splits: per slot, (first split, end split).
    """

    tokens: torch.Tensor
    blocks: torch.Tensor
    splits: torch.Tensor
    slot_splits: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, forest: ForestTensors, child_tokens: tuple[torch.Tensor, ...]) -> "ChildBlocks":
        """The tables of ``forest`` whose parent slot ``i`` has children ``child_tokens[i]``."""
        return forest.derive(
            ("inherited_state_blocks", TOKENS_PER_BLOCK, SPLIT_BLOCKS),
            lambda: cls._build(forest.device, child_tokens),
        )

    @classmethod
    def _build(cls, device, child_tokens) -> "ChildBlocks":
        counts = np.array([len(c) for c in child_tokens], dtype=np.int64)
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

        def table(rows):
            return torch.tensor(np.array(rows, dtype=np.int32).T.copy(), device=device)

        return cls(
            tokens=torch.cat(child_tokens) if child_tokens else torch.zeros(0, dtype=torch.int64),
            blocks=table(blocks),
            splits=table(splits),
            slot_splits=tuple(slot_splits),
        )


def supported(y: torch.Tensor, C: torch.Tensor) -> bool:
    """Whether the kernels handle these tensors (CUDA, or Triton's interpreter; float dtypes)."""
    return y.dtype in SUPPORTED_DTYPES and C.dtype in SUPPORTED_DTYPES


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dimension >= 16


@triton.jit
def _block_tokens(blocks_ptr, tokens_ptr, num_blocks, BLOCK_T: tl.constexpr):
    """Token indices [BLOCK_T] (0 where masked), their mask and the parent slot of one block."""
    block = tl.program_id(0)
    offset = tl.load(blocks_ptr + block)
    count = tl.load(blocks_ptr + num_blocks + block)
    slot = tl.load(blocks_ptr + 2 * num_blocks + block)
    rows = tl.arange(0, BLOCK_T)
    mask = rows < count
    tokens = tl.load(tokens_ptr + offset + rows, mask=mask, other=0)
    return tokens, mask, slot


@triton.jit
def _inherited_fwd_kernel(
    out_ptr, y_ptr, z_ptr, C_ptr, cum_ptr, states_ptr, blocks_ptr, tokens_ptr,
    num_blocks, heads_per_group, head_dim, state_dim,
    stride_out_t, stride_out_h, stride_out_p,
    stride_y_t, stride_y_h, stride_y_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cum_t, stride_cum_h,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (block, group): out = y + gate * exp(cum) * C . state for the group's heads."""
    tokens, mask, slot = _block_tokens(blocks_ptr, tokens_ptr, num_blocks, BLOCK_T)
    group = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_tp = mask[:, None] & (p[None, :] < head_dim)
    C = tl.load(
        C_ptr + tokens[:, None] * stride_C_t + group * stride_C_g + n[None, :] * stride_C_n,
        mask=mask[:, None] & (n[None, :] < state_dim),
        other=0.0,
    )
    for r in range(heads_per_group):
        head = group * heads_per_group + r
        state = tl.load(
            states_ptr + slot * stride_s_slot + head * stride_s_h
            + p[:, None] * stride_s_p + n[None, :] * stride_s_n,
            mask=(p[:, None] < head_dim) & (n[None, :] < state_dim),
            other=0.0,
        )  # fmt: skip
        inherited = tl.dot(C, tl.trans(state.to(C.dtype)))  # [T, P] float32
        decay = tl.exp(tl.load(cum_ptr + tokens * stride_cum_t + head * stride_cum_h, mask=mask))
        correction = inherited * decay[:, None]
        if HAS_Z:
            z = tl.load(
                z_ptr + tokens[:, None] * stride_z_t + head * stride_z_h + p[None, :] * stride_z_p,
                mask=mask_tp,
                other=0.0,
            ).to(tl.float32)
            correction = correction * z * tl.sigmoid(z)
        y = tl.load(
            y_ptr + tokens[:, None] * stride_y_t + head * stride_y_h + p[None, :] * stride_y_p,
            mask=mask_tp,
            other=0.0,
        ).to(tl.float32)
        tl.store(
            out_ptr + tokens[:, None] * stride_out_t + head * stride_out_h
            + p[None, :] * stride_out_p,
            (y + correction).to(out_ptr.dtype.element_ty),
            mask=mask_tp,
        )  # fmt: skip


@triton.jit
def _inherited_bwd_tokens_kernel(
    grad_C_ptr, grad_cum_ptr, grad_z_ptr, grad_out_ptr, z_ptr, C_ptr, cum_ptr, states_ptr,
    blocks_ptr, tokens_ptr,
    num_blocks, heads_per_group, head_dim, state_dim,
    stride_go_t, stride_go_h, stride_go_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cum_t, stride_cum_h,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (block, group): gradients of C (summed over the group's heads), cum and z.

    With g = d out * gate * exp(cum) ([T, P]) and u = g . state ([T, N]): d C = sum_heads u,
    d cum = sum_n u * C (= sum_p g * (C . state)), d z = d out * (C . state) * exp(cum) * silu'(z).
    grad_C, grad_cum and grad_z are contiguous [T, G, N], [T, H] and [T, H, P].
    """
    tokens, mask, slot = _block_tokens(blocks_ptr, tokens_ptr, num_blocks, BLOCK_T)
    group = tl.program_id(1)
    num_heads = tl.num_programs(1) * heads_per_group
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_tp = mask[:, None] & (p[None, :] < head_dim)
    mask_tn = mask[:, None] & (n[None, :] < state_dim)
    C = tl.load(
        C_ptr + tokens[:, None] * stride_C_t + group * stride_C_g + n[None, :] * stride_C_n,
        mask=mask_tn,
        other=0.0,
    )
    grad_C = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r in range(heads_per_group):
        head = group * heads_per_group + r
        state = tl.load(
            states_ptr + slot * stride_s_slot + head * stride_s_h
            + p[:, None] * stride_s_p + n[None, :] * stride_s_n,
            mask=(p[:, None] < head_dim) & (n[None, :] < state_dim),
            other=0.0,
        ).to(C.dtype)  # fmt: skip
        decay = tl.exp(tl.load(cum_ptr + tokens * stride_cum_t + head * stride_cum_h, mask=mask))
        grad = tl.load(
            grad_out_ptr + tokens[:, None] * stride_go_t + head * stride_go_h
            + p[None, :] * stride_go_p,
            mask=mask_tp,
            other=0.0,
        ).to(tl.float32)  # fmt: skip
        if HAS_Z:
            z = tl.load(
                z_ptr + tokens[:, None] * stride_z_t + head * stride_z_h + p[None, :] * stride_z_p,
                mask=mask_tp,
                other=0.0,
            ).to(tl.float32)
            sigmoid = tl.sigmoid(z)
            inherited = tl.dot(C, tl.trans(state))
            grad_z = grad * inherited * decay[:, None] * (sigmoid * (1 + z * (1 - sigmoid)))
            tl.store(
                grad_z_ptr + (tokens[:, None] * num_heads + head) * head_dim + p[None, :],
                grad_z.to(grad_z_ptr.dtype.element_ty),
                mask=mask_tp,
            )
            grad = grad * z * sigmoid
        grad = grad * decay[:, None]
        u = tl.dot(grad.to(C.dtype), state)  # [T, N] float32
        grad_cum = tl.sum(u * C.to(tl.float32), axis=1)
        tl.store(grad_cum_ptr + tokens * num_heads + head, grad_cum, mask=mask)
        grad_C += u
    num_groups = tl.num_programs(1)
    tl.store(
        grad_C_ptr + (tokens[:, None] * num_groups + group) * state_dim + n[None, :],
        grad_C.to(grad_C_ptr.dtype.element_ty),
        mask=mask_tn,
    )


@triton.jit
def _inherited_bwd_states_kernel(
    partial_ptr, grad_out_ptr, z_ptr, C_ptr, cum_ptr, blocks_ptr, splits_ptr, tokens_ptr,
    num_blocks, num_splits, heads_per_group, head_dim, state_dim,
    stride_go_t, stride_go_h, stride_go_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cum_t, stride_cum_h,
    HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (split, head): partial[split, head] = sum over the split's tokens of g^T C ([P, N]),
    g = d out * gate * exp(cum); blocks in ascending order. partial is contiguous [NS, H, P, N]."""
    split = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    first = tl.load(splits_ptr + split)
    end = tl.load(splits_ptr + num_splits + split)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for block in range(first, end):
        offset = tl.load(blocks_ptr + block)
        count = tl.load(blocks_ptr + num_blocks + block)
        mask = rows < count
        tokens = tl.load(tokens_ptr + offset + rows, mask=mask, other=0)
        mask_tp = mask[:, None] & (p[None, :] < head_dim)
        C = tl.load(
            C_ptr + tokens[:, None] * stride_C_t + group * stride_C_g + n[None, :] * stride_C_n,
            mask=mask[:, None] & (n[None, :] < state_dim),
            other=0.0,
        )
        grad = tl.load(
            grad_out_ptr + tokens[:, None] * stride_go_t + head * stride_go_h
            + p[None, :] * stride_go_p,
            mask=mask_tp,
            other=0.0,
        ).to(tl.float32)  # fmt: skip
        if HAS_Z:
            z = tl.load(
                z_ptr + tokens[:, None] * stride_z_t + head * stride_z_h + p[None, :] * stride_z_p,
                mask=mask_tp,
                other=0.0,
            ).to(tl.float32)
            grad = grad * z * tl.sigmoid(z)
        decay = tl.exp(tl.load(cum_ptr + tokens * stride_cum_t + head * stride_cum_h, mask=mask))
        grad = (grad * decay[:, None]).to(C.dtype)
        acc += tl.dot(tl.trans(grad), C)
    num_heads = tl.num_programs(1)
    tl.store(
        partial_ptr + ((split * num_heads + head) * head_dim + p[:, None]) * state_dim + n[None, :],
        acc,
        mask=(p[:, None] < head_dim) & (n[None, :] < state_dim),
    )


def _strides(tensor, dims):
    return tuple(tensor.stride()) if tensor is not None else (0,) * dims


def inherited_state_output(y, z, C, cum, states, tables: ChildBlocks):
    """out = y with the inherited-state correction at every child token (forward kernel).

    y [T, H, P], z [T, H, P] or None, C [T, G, N], cum [T, H] float32, states [S, H, P, N]
    float32 contiguous. Returns out [T, H, P] in y's dtype.
    """
    out = y.clone()
    num_blocks = tables.blocks.shape[1]
    if num_blocks == 0:
        return out
    groups = C.shape[1]
    heads, head_dim = y.shape[1:]
    _inherited_fwd_kernel[(num_blocks, groups)](
        out, y, z if z is not None else y, C, cum, states, tables.blocks, tables.tokens,
        num_blocks, heads // groups, head_dim, C.shape[2],
        *out.stride(), *y.stride(), *_strides(z, 3), *C.stride(), *cum.stride(), *states.stride(),
        HAS_Z=z is not None, BLOCK_T=TOKENS_PER_BLOCK,
        BLOCK_P=_pow2(head_dim), BLOCK_N=_pow2(C.shape[2]),
    )  # fmt: skip
    return out


def inherited_state_output_backward(grad_out, z, C, cum, states, tables: ChildBlocks, needs):
    """Gradients (z, C, cum, states) of :func:`inherited_state_output`; y's is ``grad_out``.

    ``needs`` is (z, C, cum, states) flags; an unneeded gradient is returned as None.
    Returns grad_z [T, H, P] (z's dtype), grad_C [T, G, N] (C's dtype), grad_cum [T, H] float32,
    grad_states [S, H, P, N] float32; zero at tokens outside every parent's children.
    """
    need_z, need_C, need_cum, need_states = needs
    length, heads, head_dim = grad_out.shape
    groups, state_dim = C.shape[1:]
    num_blocks = tables.blocks.shape[1]
    num_splits = tables.splits.shape[1]
    has_z = z is not None
    grad_z = torch.zeros(length, heads, head_dim, dtype=z.dtype, device=z.device) if has_z else None
    grad_C = torch.zeros(length, groups, state_dim, dtype=C.dtype, device=C.device)
    grad_cum = torch.zeros(length, heads, dtype=torch.float32, device=C.device)
    common = {
        "HAS_Z": has_z,
        "BLOCK_T": TOKENS_PER_BLOCK,
        "BLOCK_P": _pow2(head_dim),
        "BLOCK_N": _pow2(state_dim),
    }
    if num_blocks and (need_z or need_C or need_cum):
        _inherited_bwd_tokens_kernel[(num_blocks, groups)](
            grad_C, grad_cum, grad_z if has_z else grad_cum, grad_out, z if has_z else grad_out,
            C, cum, states, tables.blocks, tables.tokens,
            num_blocks, heads // groups, head_dim, state_dim,
            *grad_out.stride(), *_strides(z, 3), *C.stride(), *cum.stride(), *states.stride(),
            **common,
        )  # fmt: skip
    grad_states = None
    if need_states:
        partial = torch.zeros(num_splits, heads, head_dim, state_dim, device=C.device)
        if num_splits:
            _inherited_bwd_states_kernel[(num_splits, heads)](
                partial, grad_out, z if has_z else grad_out, C, cum, tables.blocks,
                tables.splits, tables.tokens,
                num_blocks, num_splits, heads // groups, head_dim, state_dim,
                *grad_out.stride(), *_strides(z, 3), *C.stride(), *cum.stride(),
                **common,
            )  # fmt: skip
        grad_states = torch.stack([partial[a:b].sum(0) for a, b in tables.slot_splits])
    return (
        grad_z if need_z else None,
        grad_C if need_C else None,
        grad_cum.to(cum.dtype) if need_cum else None,
        grad_states,
    )
