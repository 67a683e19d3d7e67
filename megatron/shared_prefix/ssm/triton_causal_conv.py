"""Triton causal depthwise conv1d over a packed row, forward and backward, with the SiLU fused
(upstream: megatron/core/ssm/ops).

The tree conv (tree_conv.py) runs one ordinary causal conv over the whole packed row and then
recomputes the first ``w - 1`` tokens of every segment from their root-path windows. This module is
that ordinary conv for training: ``out[t, c] = act(bias[c] + sum_k weight[c, k] * x[t - (w-1) + k,
c])`` (zeros before the row's first token), with the backward.

Why not PyTorch's: ``F.conv1d`` wants channels-first input, so Mamba's token-major ``xBC`` (a
strided view of the input projection) is copied around it, the SiLU runs as separate kernels, and
the pre-activation is kept for the SiLU's backward. On an H200 the conv and SiLU took 5.2 ms of a
21 ms Mamba layer (docs/benchmarks.md). megatron-core 0.19.2's Triton causal-conv1d kernels are
forward-only (its inference paths), so training cannot use them.

Here the forward reads the strided input once and writes the activated output; nothing of the
output's size is kept for backward (only the input, a view of the projection that the gate's view
keeps alive anyway). The backward recomputes the pre-activation of the ``w`` tokens that each
gradient element needs (``w`` loads per token, cached) and writes:

* ``dx[t] = sum_k weight[:, k] * g'[t + (w-1) - k]`` with ``g' = g * act'(pre)``, one program per
  element, zero past the row's end;
* per program, partial sums over its tokens of ``g'[t] * x[t - (w-1) + k]`` (weight) and ``g'[t]``
  (bias), added over programs in index order by ``torch.sum`` afterwards: no atomics, so results
  are bitwise reproducible.

Everything is computed in float32 and rounded once. Shapes: T tokens, C channels, w taps.
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_T = 32  # tokens per tile
BLOCK_C = 128  # channels per tile
TILES_PER_PROGRAM = 8  # token tiles one backward program walks (fewer weight partial sums)
MAX_OFFSET = 2**31 - 1  # the kernels compute element offsets in int32


@triton.jit
def _load_tap_input(x_ptr, rows, cols, col_mask, num_tokens, stride_x, WIDTH: tl.constexpr, k):
    """[BLOCK_T, BLOCK_C] float32 input that tap ``k`` multiplies for the outputs at ``rows``:
    x[rows - (WIDTH - 1) + k], zero outside the row."""
    source = rows - (WIDTH - 1) + k
    mask = ((source >= 0) & (source < num_tokens))[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + source[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _pre_activation(
    x_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    cols,
    col_mask,
    num_tokens,
    stride_x,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """[BLOCK_T, BLOCK_C] float32 ``bias + sum_k weight[:, k] * x[rows - (WIDTH-1) + k]``: the
    bias first, then the taps in order (forward and backward add in the same order)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        x = _load_tap_input(x_ptr, rows, cols, col_mask, num_tokens, stride_x, WIDTH, k)
        tap = tl.load(weight_ptr + cols * WIDTH + k, mask=col_mask, other=0.0).to(tl.float32)
        acc += x * tap[None, :]
    return acc


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_forward_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    channels,
    stride_x,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    acc = _pre_activation(
        x_ptr, weight_ptr, bias_ptr, rows, cols, col_mask, num_tokens, stride_x,
        WIDTH, HAS_BIAS, BLOCK_T, BLOCK_C,
    )  # fmt: skip
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out_mask = (rows < num_tokens)[:, None] & col_mask[None, :]
    tl.store(
        out_ptr + rows[:, None] * channels + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


@triton.jit
def _pre_activation_grad(
    x_ptr,
    grad_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    cols,
    col_mask,
    num_tokens,
    stride_x,
    stride_grad,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """[BLOCK_T, BLOCK_C] float32 gradient of the pre-activation at ``rows`` (0 outside the row)."""
    inside = (rows >= 0) & (rows < num_tokens)
    mask = inside[:, None] & col_mask[None, :]
    grad = tl.load(
        grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    if SILU:
        pre = _pre_activation(
            x_ptr, weight_ptr, bias_ptr, rows, cols, col_mask, num_tokens, stride_x,
            WIDTH, HAS_BIAS, BLOCK_T, BLOCK_C,
        )  # fmt: skip
        sigmoid = tl.sigmoid(pre)
        grad = grad * sigmoid * (1.0 + pre * (1.0 - sigmoid))
    return grad


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_backward_kernel(
    x_ptr,
    grad_ptr,
    weight_ptr,
    bias_ptr,
    dx_ptr,
    partial_ptr,
    num_tokens,
    channels,
    stride_x,
    stride_grad,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILES: tl.constexpr,
    TAPS: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    taps = tl.arange(0, TAPS)  # WIDTH rounded up to a power of two
    weight_sums = tl.zeros((BLOCK_C, TAPS), dtype=tl.float32)
    bias_sums = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for tile in range(TILES):
        rows = (program * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        # g' at the tile's own tokens (tap w-1 reads x[t] for output t), then the w-1 outputs
        # after each token, whose taps k < w-1 read it.
        own_grad = _pre_activation_grad(
            x_ptr, grad_ptr, weight_ptr, bias_ptr, rows, cols, col_mask,
            num_tokens, stride_x, stride_grad, WIDTH, HAS_BIAS, SILU, BLOCK_T, BLOCK_C,
        )  # fmt: skip
        last_tap = tl.load(weight_ptr + cols * WIDTH + (WIDTH - 1), mask=col_mask, other=0.0)
        dx = own_grad * last_tap.to(tl.float32)[None, :]
        for k in tl.static_range(WIDTH - 1):
            grad = _pre_activation_grad(
                x_ptr, grad_ptr, weight_ptr, bias_ptr, rows + (WIDTH - 1) - k, cols, col_mask,
                num_tokens, stride_x, stride_grad, WIDTH, HAS_BIAS, SILU, BLOCK_T, BLOCK_C,
            )  # fmt: skip
            tap = tl.load(weight_ptr + cols * WIDTH + k, mask=col_mask, other=0.0).to(tl.float32)
            dx += grad * tap[None, :]
        dx_mask = (rows < num_tokens)[:, None] & col_mask[None, :]
        tl.store(
            dx_ptr + rows[:, None] * channels + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=dx_mask,
        )
        bias_sums += tl.sum(own_grad, axis=0)
        for k in tl.static_range(WIDTH):
            x = _load_tap_input(x_ptr, rows, cols, col_mask, num_tokens, stride_x, WIDTH, k)
            tap_sum = tl.sum(own_grad * x, axis=0)  # [BLOCK_C]
            weight_sums += tl.where(taps[None, :] == k, tap_sum[:, None], 0.0)
    # partial[program, c, k] for k < WIDTH (weight), partial[program, c, WIDTH] (bias)
    base = partial_ptr + program * channels * (WIDTH + 1) + cols * (WIDTH + 1)
    tl.store(
        base[:, None] + taps[None, :], weight_sums, mask=col_mask[:, None] & (taps < WIDTH)[None, :]
    )
    tl.store(base + WIDTH, bias_sums, mask=col_mask)


def offsets_fit(num_tokens: int, token_stride: int, channels: int) -> bool:
    """Whether the kernels' int32 offsets reach every element of a [T, C] row whose tokens are
    ``token_stride`` elements apart (and of the contiguous [T, C] outputs and gradients)."""
    return (num_tokens - 1) * max(token_stride, channels) + channels <= MAX_OFFSET


def _check(x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"x must be [T, C] with unit channel stride, got shape {tuple(x.shape)} and strides "
            f"{x.stride()}"
        )
    if not offsets_fit(x.shape[0], x.stride(0), x.shape[1]):
        raise ValueError(
            f"a row of {x.shape[0]} tokens {x.stride(0)} elements apart is too long for the Triton "
            "row conv's int32 offsets; run the tree conv with backend='torch'"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [C={x.shape[1]}, w], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"bias must be [C={x.shape[1]}], got {tuple(bias.shape)}")


class RowCausalConv(torch.autograd.Function):
    """``act(causal depthwise conv)`` of a packed row (the module docstring has the math).

    Args (``apply``): x [T, C] (any token stride, unit channel stride), weight [C, w], bias [C]
    or None, silu (bool). Returns [T, C] contiguous in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, silu):  # pylint: disable=arguments-differ
        _check(x, weight, bias)
        num_tokens, channels = x.shape
        weight = weight.contiguous()
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))
        _conv_forward_kernel[grid](
            x, weight, bias, out, num_tokens, channels, x.stride(0),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=bool(silu),
            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
        )  # fmt: skip
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = bool(silu)
        return out

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        x, weight, bias = ctx.saved_tensors
        if grad.stride(1) != 1 or not offsets_fit(*grad.shape[:1], grad.stride(0), grad.shape[1]):
            grad = grad.contiguous()
        num_tokens, channels = x.shape
        width = weight.shape[1]
        programs = triton.cdiv(num_tokens, BLOCK_T * TILES_PER_PROGRAM)
        dx = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
        # Every element is written by its program (masked channels are never read).
        partial = torch.empty(programs, channels, width + 1, dtype=torch.float32, device=x.device)
        grid = (programs, triton.cdiv(channels, BLOCK_C))
        _conv_backward_kernel[grid](
            x, grad, weight, bias, dx, partial, num_tokens, channels, x.stride(0), grad.stride(0),
            WIDTH=width, HAS_BIAS=bias is not None, SILU=ctx.silu,
            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, TILES=TILES_PER_PROGRAM,
            TAPS=triton.next_power_of_2(width),
        )  # fmt: skip
        sums = partial.sum(0)  # [C, w + 1], float32, the programs in index order
        dweight = sums[:, :width].to(weight.dtype)
        dbias = None if bias is None else sums[:, width].to(bias.dtype)
        return dx, dweight, dbias, None


def row_causal_conv1d(x, weight, bias=None, silu=False) -> torch.Tensor:
    """[T, C] -> [T, C]: ``RowCausalConv`` (CUDA, or Triton's interpreter on CPU)."""
    return RowCausalConv.apply(x, weight, bias, silu)
