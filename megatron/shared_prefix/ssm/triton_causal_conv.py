"""Triton causal depthwise conv1d over a packed row, forward and backward, with the SiLU fused
(upstream: megatron/core/ssm/ops).

The ordinary causal conv of a packed row for training: ``out[t, c] = act(bias[c] + sum_k
weight[c, k] * x[t - (w-1) + k, c])`` (zeros before the row's first token), with the backward; and
the tree conv's (tree_conv.py) variant, where the first ``w - 1`` tokens of every segment (the
*fixed tokens*) read their root-path windows instead: the forward reads every token's taps from a
[T, w] table (``tap_tokens``), and the backward is the row conv's, skipping the fixed tokens'
output gradients, plus two small kernels for them (:func:`backward_fixed`).

Why not PyTorch's: ``F.conv1d`` wants channels-first input, so Mamba's token-major ``xBC`` (a
strided view of the input projection) is copied around it, the SiLU runs as separate kernels, and
the pre-activation is kept for the SiLU's backward. On an H200 the conv and SiLU took 5.2 ms of a
21 ms Mamba layer (docs/benchmarks.md). megatron-core 0.19.2's Triton causal-conv1d kernels are
forward-only (its inference paths), so training cannot use them.

Here the forward reads the strided input once and writes the activated output; nothing of the
output's size is kept for backward (only the input, a view of the projection that the gate's view
keeps alive anyway). In the backward each program walks ``BACKWARD_TOKENS`` consecutive tokens
of ``BACKWARD_BLOCK_C`` channels one token at a time, holding the inputs and the gradients
``g' = g * act'(pre)`` of the last ``w`` tokens in registers (hence ``w <= MAX_WIDTH``). At token
t it loads x[t] and g[t] once, recomputes the pre-activation from the window in registers, and
writes:

* ``dx[t - (w-1)] = sum_k weight[:, k] * g'[t - k]``, whose last term g'[t] is then known (the
  program walks ``w - 1`` tokens past its own for their g' only), zero past the row's end;
* with a ``skip`` mask (the tree conv's fixed tokens, whose taps were not the w - 1 tokens
  before them), the output gradient of a skipped token counts as zero, without a masked copy of
  the gradient;
* at its end, partial sums over its own tokens of ``g'[t] * x[t - (w-1) + k]`` (weight) and
  ``g'[t]`` (bias), added over programs by ``torch.sum`` (a fixed order): no atomics, so results
  are bitwise reproducible.

The fixed tokens' backward (:func:`backward_fixed`): one program per block of fixed tokens and
channels recomputes their pre-activations from their windows (the forward's order) and writes
their ``g'`` and the block's weight and bias sums (further rows of the partial sums above); then
one program per block of the distinct tokens their windows read adds, token by token, the
entries that read it (``weight[:, k] * g'``, in index order) in float32 and adds that to dx,
rounding once.

An earlier backward, on tiles of tokens, recomputed g' for each of the ``w`` outputs that read a
token and summed the weight gradients across every tile; it ran 5.7 times longer on an H100
(docs/benchmarks.md).

Everything is computed in float32 and rounded once. Shapes: T tokens, C channels, w taps.
"""

import torch
import triton
import triton.language as tl

# Grid sizes by plain-Python ceil division (triton.cdiv is a constexpr function, microseconds
# of host time per call): the forked states' kernels' helper.
from megatron.shared_prefix.ssm.triton_inherited_state import _cdiv

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_T = 32  # tokens per forward tile
BLOCK_C = 128  # channels per forward tile
BACKWARD_TOKENS = 128  # tokens one backward program walks
BACKWARD_BLOCK_C = 128  # channels of a backward program
BACKWARD_WARPS = 1  # a program is one warp: 4 channels per thread
MAX_WIDTH = 4  # taps (Mamba's conv has 4): the backward holds the last four tokens in registers
FIXED_BLOCK_F = 16  # fixed tokens (or targets) per program of the tree conv's window gradients
MAX_OFFSET = 2**31 - 1  # the kernels compute element offsets in int32


@triton.jit
def _load_tap_input(x_ptr, tap_tokens_ptr, rows, cols, col_mask, num_tokens, stride_x,
                    WIDTH: tl.constexpr, HAS_TAP_TOKENS: tl.constexpr, k):  # fmt: skip
    """[BLOCK_T, BLOCK_C] float32 input that tap ``k`` multiplies for the outputs at ``rows``:
    x[rows - (WIDTH - 1) + k], zero outside the row's ``num_tokens`` tokens; or with
    HAS_TAP_TOKENS x[tap_tokens[rows, k]] (a [num_tokens, WIDTH] table of tokens of x, -1 for
    zero)."""
    if HAS_TAP_TOKENS:
        source = tl.load(tap_tokens_ptr + rows * WIDTH + k, mask=rows < num_tokens, other=-1)
        inside = source >= 0
    else:
        source = rows - (WIDTH - 1) + k
        inside = (source >= 0) & (source < num_tokens)
    mask = inside[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + source[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _pre_activation(
    x_ptr,
    tap_tokens_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    cols,
    col_mask,
    num_tokens,
    stride_x,
    WIDTH: tl.constexpr,
    HAS_TAP_TOKENS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """[BLOCK_T, BLOCK_C] float32 ``bias + sum_k weight[:, k] * x[source of tap k]``
    (``_load_tap_input``): the bias first, then the taps in order (forward and backward add in
    the same order)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        x = _load_tap_input(x_ptr, tap_tokens_ptr, rows, cols, col_mask, num_tokens, stride_x,
                            WIDTH, HAS_TAP_TOKENS, k)  # fmt: skip
        tap = tl.load(weight_ptr + cols * WIDTH + k, mask=col_mask, other=0.0).to(tl.float32)
        acc += x * tap[None, :]
    return acc


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_forward_kernel(
    x_ptr,
    tap_tokens_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    channels,
    stride_x,
    WIDTH: tl.constexpr,
    HAS_TAP_TOKENS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    acc = _pre_activation(
        x_ptr, tap_tokens_ptr, weight_ptr, bias_ptr, rows, cols, col_mask, num_tokens, stride_x,
        WIDTH, HAS_TAP_TOKENS, HAS_BIAS, BLOCK_T, BLOCK_C,
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
def _load_row(ptr, row, cols, col_mask, num_tokens, stride):
    """[BLOCK_C] float32 ``ptr[row, cols]``, zero outside the row's tokens."""
    inside = (row >= 0) & (row < num_tokens)
    return tl.load(ptr + row * stride + cols, mask=col_mask & inside, other=0.0).to(tl.float32)


@triton.jit
def _tap(weight_ptr, cols, col_mask, WIDTH: tl.constexpr, back: tl.constexpr):
    """[BLOCK_C] float32 weight of the tap that reads the token ``back`` steps before the output
    (tap ``WIDTH - 1 - back``); zero for taps the conv does not have."""
    if back < WIDTH:
        tap = tl.load(weight_ptr + cols * WIDTH + (WIDTH - 1 - back), mask=col_mask, other=0.0)
        return tap.to(tl.float32)
    return tl.zeros(cols.shape, dtype=tl.float32)


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_backward_kernel(
    x_ptr,
    grad_ptr,
    weight_ptr,
    bias_ptr,
    dx_ptr,
    partial_ptr,
    skip_ptr,
    num_tokens,
    channels,
    stride_x,
    stride_grad,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: BLOCK_C channels of TOKENS consecutive tokens, walked one token at a time
    with the last four inputs and pre-activation gradients held in registers (WIDTH <= 4; the
    taps a narrower conv lacks are zero and never added). With HAS_SKIP, the output gradient of
    every token t with skip[t] != 0 counts as zero (outputs another computation replaced)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    start = tl.program_id(0) * TOKENS
    w_back0 = _tap(weight_ptr, cols, col_mask, WIDTH, 0)  # multiplies the output's own token
    w_back1 = _tap(weight_ptr, cols, col_mask, WIDTH, 1)
    w_back2 = _tap(weight_ptr, cols, col_mask, WIDTH, 2)
    w_back3 = _tap(weight_ptr, cols, col_mask, WIDTH, 3)
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Inputs 1, 2, 3 tokens before the current one, and g' there (g' before ``start`` is only
    # read for dx of tokens before ``start``, which another program writes).
    x_back1 = _load_row(x_ptr, start - 1, cols, col_mask, num_tokens, stride_x)
    x_back2 = _load_row(x_ptr, start - 2, cols, col_mask, num_tokens, stride_x)
    x_back3 = _load_row(x_ptr, start - 3, cols, col_mask, num_tokens, stride_x)
    g_back1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_back2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_back3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_back0 = tl.zeros((BLOCK_C,), dtype=tl.float32)  # sum of g'[t] * x[t]
    sum_back1 = tl.zeros((BLOCK_C,), dtype=tl.float32)  # sum of g'[t] * x[t - 1]
    sum_back2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_back3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    bias_sum = tl.zeros((BLOCK_C,), dtype=tl.float32)
    x_next = _load_row(x_ptr, start, cols, col_mask, num_tokens, stride_x)
    grad_next = _load_row(grad_ptr, start, cols, col_mask, num_tokens, stride_grad)
    # Token t = start + i: g'[t] from its window, then dx[t - (WIDTH - 1)], whose last term is
    # g'[t]. The WIDTH - 1 tokens after the program's own are walked for their g' only.
    for i in range(TOKENS + WIDTH - 1):
        token = start + i
        x_now, grad = x_next, grad_next
        x_next = _load_row(x_ptr, token + 1, cols, col_mask, num_tokens, stride_x)
        grad_next = _load_row(grad_ptr, token + 1, cols, col_mask, num_tokens, stride_grad)
        if HAS_SKIP:
            skip = tl.load(skip_ptr + token, mask=token < num_tokens, other=0)
            grad = tl.where(skip != 0, 0.0, grad)
        if SILU:
            # The forward's order: the bias, then the taps from the oldest token on.
            pre = bias
            if WIDTH > 3:
                pre += w_back3 * x_back3
            if WIDTH > 2:
                pre += w_back2 * x_back2
            if WIDTH > 1:
                pre += w_back1 * x_back1
            pre += w_back0 * x_now
            sigmoid = tl.sigmoid(pre)
            grad = grad * sigmoid * (1.0 + pre * (1.0 - sigmoid))
        own_grad = tl.where(i < TOKENS, grad, 0.0)
        bias_sum += own_grad
        sum_back0 += own_grad * x_now
        sum_back1 += own_grad * x_back1
        sum_back2 += own_grad * x_back2
        sum_back3 += own_grad * x_back3
        # dx[t - (WIDTH-1)] = sum_k weight[:, k] * g'[t - k]
        if WIDTH == 4:
            dx = w_back0 * g_back3 + w_back1 * g_back2 + w_back2 * g_back1 + w_back3 * grad
        elif WIDTH == 3:
            dx = w_back0 * g_back2 + w_back1 * g_back1 + w_back2 * grad
        elif WIDTH == 2:
            dx = w_back0 * g_back1 + w_back1 * grad
        else:
            dx = w_back0 * grad
        out_row = token - (WIDTH - 1)
        tl.store(
            dx_ptr + out_row * channels + cols,
            dx.to(dx_ptr.dtype.element_ty),
            mask=col_mask & (out_row >= start) & (out_row < num_tokens),
        )
        x_back3, x_back2, x_back1 = x_back2, x_back1, x_now
        g_back3, g_back2, g_back1 = g_back2, g_back1, grad
    # partial[program, c, k] for k < WIDTH (weight: tap k reads the token WIDTH-1-k back),
    # partial[program, c, WIDTH] (bias)
    base = partial_ptr + tl.program_id(0) * channels * (WIDTH + 1) + cols * (WIDTH + 1)
    tl.store(base + (WIDTH - 1), sum_back0, mask=col_mask)
    if WIDTH > 1:
        tl.store(base + (WIDTH - 2), sum_back1, mask=col_mask)
    if WIDTH > 2:
        tl.store(base + (WIDTH - 3), sum_back2, mask=col_mask)
    if WIDTH > 3:
        tl.store(base + (WIDTH - 4), sum_back3, mask=col_mask)
    tl.store(base + WIDTH, bias_sum, mask=col_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_fixed"])
def _fixed_grad_kernel(
    x_ptr,
    grad_ptr,
    weight_ptr,
    bias_ptr,
    fixed_ptr,
    windows_ptr,
    fixed_grad_ptr,
    partial_ptr,
    num_tokens,
    num_fixed,
    channels,
    stride_x,
    stride_grad,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (block of fixed tokens, channel block): for the fixed tokens i of the block, the
    pre-activation gradient g'[i] = g[fixed[i]] * act'(pre) with the pre-activation recomputed
    from their windows (windows [F, WIDTH]: the token tap k reads, -1 for zero) in the forward's
    order, written to fixed_grad [F, C] float32, and the block's partial sums over its tokens of
    g' * x[window k] (weight tap k) and of g' (bias) to partial[block, c, :] ([blocks, C,
    WIDTH + 1], the row conv's layout)."""
    fixed = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    fixed_mask = fixed < num_fixed
    tokens = tl.load(fixed_ptr + fixed, mask=fixed_mask, other=num_tokens)
    pre = _pre_activation(
        x_ptr, windows_ptr, weight_ptr, bias_ptr, fixed, cols, col_mask, num_fixed, stride_x,
        WIDTH, True, HAS_BIAS, BLOCK_F, BLOCK_C,
    )  # fmt: skip
    mask = fixed_mask[:, None] & col_mask[None, :]
    grad = tl.load(grad_ptr + tokens[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0)
    grad = grad.to(tl.float32)
    if SILU:
        sigmoid = tl.sigmoid(pre)
        grad = grad * sigmoid * (1.0 + pre * (1.0 - sigmoid))
    tl.store(fixed_grad_ptr + fixed[:, None] * channels + cols[None, :], grad, mask=mask)
    base = partial_ptr + tl.program_id(0) * channels * (WIDTH + 1) + cols * (WIDTH + 1)
    for k in tl.static_range(WIDTH):
        x = _load_tap_input(x_ptr, windows_ptr, fixed, cols, col_mask, num_fixed, stride_x,
                            WIDTH, True, k)  # fmt: skip
        tl.store(base + k, tl.sum(grad * x, axis=0), mask=col_mask)
    tl.store(base + WIDTH, tl.sum(grad, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["num_targets", "max_entries"])
def _fixed_input_grad_kernel(
    dx_ptr,
    fixed_grad_ptr,
    weight_ptr,
    targets_ptr,
    target_starts_ptr,
    target_entries_ptr,
    num_targets,
    max_entries,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (block of targets, channel block): dx[targets[u]] += sum over the target's window
    entries e = i * WIDTH + k (target_entries[target_starts[u]:target_starts[u + 1]], in that
    order) of weight[:, k] * g'[i], summed in float32 and added to dx (contiguous [T, C]) with
    one rounding. Targets are distinct tokens: each dx element has one program."""
    slots = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    slot_mask = slots < num_targets
    first = tl.load(target_starts_ptr + slots, mask=slot_mask, other=0)
    count = tl.load(target_starts_ptr + slots + 1, mask=slot_mask, other=0) - first
    acc = tl.zeros((BLOCK_U, BLOCK_C), dtype=tl.float32)
    for e in range(max_entries):
        valid = e < count
        entry = tl.load(target_entries_ptr + first + e, mask=valid, other=0)
        mask = valid[:, None] & col_mask[None, :]
        grad = tl.load(
            fixed_grad_ptr + (entry // WIDTH)[:, None] * channels + cols[None, :],
            mask=mask,
            other=0.0,
        )
        tap = tl.load(
            weight_ptr + cols[None, :] * WIDTH + (entry % WIDTH)[:, None], mask=mask, other=0.0
        )
        acc += tap.to(tl.float32) * grad
    tokens = tl.load(targets_ptr + slots, mask=slot_mask, other=0)
    mask = slot_mask[:, None] & col_mask[None, :]
    at = dx_ptr + tokens[:, None] * channels + cols[None, :]
    dx = tl.load(at, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(at, dx.to(dx_ptr.dtype.element_ty), mask=mask)


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
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or not 1 <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(
            f"weight must be [C={x.shape[1]}, w] with 1 <= w <= {MAX_WIDTH}, got "
            f"{tuple(weight.shape)}; run the tree conv with backend='torch' for wider convs"
        )
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"bias must be [C={x.shape[1]}], got {tuple(bias.shape)}")


def forward_rows(x, weight, bias, silu: bool, tap_tokens=None) -> torch.Tensor:
    """[T, C] ``act(causal depthwise conv)`` of x [T, C] (unit channel stride), contiguous in x's
    dtype: the forward kernel, no autograd. With ``tap_tokens`` ([T, w] int32 contiguous: the
    token tap k reads for output t, -1 for zero), each output reads its taps there instead of
    from the w - 1 tokens before it (the tree conv's root-path windows)."""
    _check(x, weight, bias)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if tap_tokens is not None and (
        tuple(tap_tokens.shape) != (num_tokens, width) or tap_tokens.dtype != torch.int32
    ):
        raise ValueError(
            f"tap_tokens must be int32 [{num_tokens}, {width}], got {tap_tokens.dtype} "
            f"{tuple(tap_tokens.shape)}"
        )
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    grid = (_cdiv(num_tokens, BLOCK_T), _cdiv(channels, BLOCK_C))
    _conv_forward_kernel[grid](
        x, tap_tokens, weight.contiguous(), bias, out, num_tokens, channels, x.stride(0),
        WIDTH=width, HAS_TAP_TOKENS=tap_tokens is not None, HAS_BIAS=bias is not None,
        SILU=bool(silu), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out


def backward_rows(x, grad, weight, bias, silu: bool, skip=None, extra_rows: int = 0):
    """(dx [T, C] in x's dtype, partial [programs + extra_rows, C, w + 1] float32, grad) of
    ``forward_rows`` (without tap_tokens) for the output gradient ``grad`` [T, C]: ``partial[p,
    :, k]`` is program p's part of weight tap k's gradient and ``partial[p, :, w]`` of the bias's,
    to be summed over p (``torch.sum``: a fixed order) and rounded; the last ``extra_rows`` rows
    are left to the caller to write its own parts in. ``skip`` [T] uint8 (or None): tokens whose
    output gradient counts as zero, without a masked copy of ``grad``. The returned grad is the
    one the kernel read (a contiguous copy where its layout did not fit)."""
    if grad.stride(1) != 1 or not offsets_fit(*grad.shape[:1], grad.stride(0), grad.shape[1]):
        grad = grad.contiguous()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    programs = _cdiv(num_tokens, BACKWARD_TOKENS)
    dx = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    # Every element is written by its program (masked channels are never read).
    partial = torch.empty(
        programs + extra_rows, channels, width + 1, dtype=torch.float32, device=x.device
    )
    grid = (programs, _cdiv(channels, BACKWARD_BLOCK_C))
    _conv_backward_kernel[grid](
        x, grad, weight.contiguous(), bias, dx, partial, skip, num_tokens, channels, x.stride(0),
        grad.stride(0), WIDTH=width, HAS_BIAS=bias is not None, SILU=bool(silu),
        HAS_SKIP=skip is not None, TOKENS=BACKWARD_TOKENS, BLOCK_C=BACKWARD_BLOCK_C,
        num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    return dx, partial, grad


def fixed_blocks(num_fixed: int) -> int:
    """Rows of partial sums that :func:`backward_fixed` writes for ``num_fixed`` fixed tokens."""
    return _cdiv(num_fixed, FIXED_BLOCK_F)


def backward_fixed(x, grad, weight, bias, silu: bool, fixed, windows, targets, target_starts,
                   target_entries, max_entries: int, *, dx, partial):  # fmt: skip
    """The gradients through the outputs ``forward_rows`` computed from ``tap_tokens`` windows:
    the fixed tokens ``fixed`` [F] (int64), whose taps read ``windows`` [F, w] (int64, -1 for
    zero) and whose output gradients the row backward skipped. Adds the windows' input gradients
    into dx ([T, C] contiguous, in place) at the distinct tokens they read, ``targets`` [U]
    (int64; ``target_entries[target_starts[u]:target_starts[u + 1]]``, int64, are the flat
    window entries i * w + k that read target u, at most ``max_entries`` of them), and writes the
    weight and bias gradients' parts into partial [fixed_blocks(F), C, w + 1] (a view of the rows
    ``backward_rows`` left). grad: as ``backward_rows`` returned it."""
    num_tokens, channels = x.shape
    width, num_fixed, num_targets = weight.shape[1], fixed.shape[0], targets.shape[0]
    if num_fixed == 0:
        return
    # g' of every fixed token, written by the first kernel and read by the second.
    fixed_grad = torch.empty(num_fixed, channels, dtype=torch.float32, device=x.device)
    weight = weight.contiguous()
    _fixed_grad_kernel[(fixed_blocks(num_fixed), _cdiv(channels, BLOCK_C))](
        x, grad, weight, bias, fixed, windows, fixed_grad, partial, num_tokens, num_fixed,
        channels, x.stride(0), grad.stride(0), WIDTH=width, HAS_BIAS=bias is not None,
        SILU=bool(silu), BLOCK_F=FIXED_BLOCK_F, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    if num_targets:
        _fixed_input_grad_kernel[(_cdiv(num_targets, FIXED_BLOCK_F), _cdiv(channels, BLOCK_C))](
            dx, fixed_grad, weight, targets, target_starts, target_entries, num_targets,
            max_entries, channels, WIDTH=width, BLOCK_U=FIXED_BLOCK_F, BLOCK_C=BLOCK_C,
        )  # fmt: skip


class RowCausalConv(torch.autograd.Function):
    """``act(causal depthwise conv)`` of a packed row (the module docstring has the math).

    Args (``apply``): x [T, C] (any token stride, unit channel stride), weight [C, w], bias [C]
    or None, silu (bool). Returns [T, C] contiguous in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, silu):  # pylint: disable=arguments-differ
        out = forward_rows(x, weight, bias, silu)
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = bool(silu)
        return out

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        x, weight, bias = ctx.saved_tensors
        dx, partial, _ = backward_rows(x, grad, weight, bias, ctx.silu)
        sums = partial.sum(0)
        width = weight.shape[1]
        dweight = sums[:, :width].to(weight.dtype)
        dbias = None if bias is None else sums[:, width].to(bias.dtype)
        return dx, dweight, dbias, None


def row_causal_conv1d(x, weight, bias=None, silu=False) -> torch.Tensor:
    """[T, C] -> [T, C]: ``RowCausalConv`` (CUDA, or Triton's interpreter on CPU)."""
    return RowCausalConv.apply(x, weight, bias, silu)
