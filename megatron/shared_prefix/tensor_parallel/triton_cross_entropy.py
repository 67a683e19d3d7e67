"""Triton kernels of the edge loss (tensor_parallel/cross_entropy.py) on CUDA (upstream:
megatron/core/fusions/fused_cross_entropy.py).

The loss needs, per source row of [U, V] logits, ``sum_v exp(logits[u, v] - shift[u])`` in
float32, and in its backward ``softmax(logits[u]) * source_grad[u]`` plus each edge's target term,
rounded once to the logits' dtype. In PyTorch each is a float32 copy of a chunk of rows and four or
five passes over it (cast, subtract, exp, multiply, then the target terms and the cast back): a
fixed transient of ``FLOAT32_CHUNK_ELEMENTS`` float32 values (256 MiB) at the loss, where a forest
row's memory peaks, and several passes of memory traffic per element. Here one program per source
row walks its vocabulary in blocks, in float32 registers:

* ``sum_exp``: reads the logits once, writes one float32 per row;
* ``softmax_grad``: reads the logits once and writes the gradient once (into the logits' own storage
  when the caller allows it), adding the row's target terms at their columns in edge order.

Each row's values depend on that row alone, in a fixed order (block by block, then a tree sum
within the block), so a source's loss and gradient do not depend on which row or batch holds it
(tree and packed dense give the same bits) and replay bitwise. No atomics. Shapes: U sources, V
vocabulary entries of this rank, E edges.
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_V = 4096  # vocabulary entries per step of a row's walk


@triton.jit
def _sum_exp_kernel(logits_ptr, shift_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    """out[row] = sum_v exp(logits[row, v] - shift[row]), float32."""
    row = tl.program_id(0).to(tl.int64)
    shift = tl.load(shift_ptr + row)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(mask, tl.exp(x - shift), 0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _softmax_grad_kernel(
    logits_ptr,
    grad_ptr,
    log_normalizer_ptr,
    source_grad_ptr,
    edge_start_ptr,
    edge_column_ptr,
    edge_grad_ptr,
    vocab,
    stride_logits,
    stride_grad,
    BLOCK: tl.constexpr,
):
    """grad[row, v] = exp(logits[row, v] - log_normalizer[row]) * source_grad[row], plus, for each
    edge e of the row (edge_start[row] <= e < edge_start[row + 1], in order), edge_grad[e] at
    column edge_column[e]; float32, rounded once to grad's dtype. Reads each block before writing
    it, so grad may be logits."""
    row = tl.program_id(0).to(tl.int64)
    log_normalizer = tl.load(log_normalizer_ptr + row)
    source_grad = tl.load(source_grad_ptr + row)
    first_edge = tl.load(edge_start_ptr + row)
    end_edge = tl.load(edge_start_ptr + row + 1)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - log_normalizer) * source_grad
        for edge in range(first_edge, end_edge):
            column = tl.load(edge_column_ptr + edge)
            grad = tl.where(cols == column, grad + tl.load(edge_grad_ptr + edge), grad)
        tl.store(
            grad_ptr + row * stride_grad + cols,
            grad.to(grad_ptr.dtype.element_ty),
            mask=mask,
        )


def supports(logits: torch.Tensor) -> bool:
    """Whether the kernels take ``logits`` ([U, V], unit stride along V, a supported dtype)."""
    return (
        logits.dim() == 2
        and logits.dtype in SUPPORTED_DTYPES
        and (logits.shape[1] <= 1 or logits.stride(1) == 1)
    )


def sum_exp(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """[U] float32 ``sum_v exp(logits[u, v] - shift[u])`` of [U, V] logits and [U] float32 shifts
    (each row's maximum, or the maximum over the tensor-parallel group's shards)."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        _sum_exp_kernel[(logits.shape[0],)](
            logits, shift.contiguous(), out, logits.shape[1], logits.stride(0), BLOCK=BLOCK_V
        )
    return out


def softmax_grad(
    logits: torch.Tensor,
    log_normalizer: torch.Tensor,
    source_grad: torch.Tensor,
    edge_slot: torch.Tensor,
    edge_column: torch.Tensor,
    edge_grad: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """The loss's gradient with respect to [U, V] ``logits``, written into ``out`` (which may be
    ``logits`` itself) and returned.

    Args:
        log_normalizer: [U] float32 log-sum-exp of each row (over the whole vocabulary).
        source_grad: [U] float32 sum of the gradients of the edges of each row.
        edge_slot: [E] int64 row of each edge.
        edge_column: [E] int64 column of each edge's target in this rank's shard (any column,
            with a zero ``edge_grad``, for an edge whose target another rank holds).
        edge_grad: [E] float32 target term of each edge (minus its gradient).
    """
    num_sources = logits.shape[0]
    if num_sources == 0:
        return out
    # The edges of each row, contiguous and in their order (a stable sort is deterministic).
    sorted_slot, order = torch.sort(edge_slot, stable=True)
    rows = torch.arange(num_sources + 1, dtype=sorted_slot.dtype, device=logits.device)
    edge_start = torch.searchsorted(sorted_slot, rows)
    _softmax_grad_kernel[(num_sources,)](
        logits,
        out,
        log_normalizer.contiguous(),
        source_grad.contiguous(),
        edge_start,
        edge_column[order].contiguous(),
        edge_grad[order].contiguous(),
        logits.shape[1],
        logits.stride(0),
        out.stride(0),
        BLOCK=BLOCK_V,
    )
    return out
