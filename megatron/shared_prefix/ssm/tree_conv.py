"""Causal depthwise conv1d over a prefix forest (upstream: megatron/core/ssm/ops/).

Mamba's short convolution gives token ``t`` the window of itself and the ``w - 1`` tokens before it.
On a packed forest "before" means along t's *root path*: inside its segment while it can, then the
tail of the parent segment, then the grandparent's when the parent is shorter than the window, and
zeros beyond the root. That is exactly the window the token has in every original sequence through
it, so the convolution of each packed token equals the dense one.

Implementation (memory O(T * channels)):

1. one ordinary causal conv over the packed row, activation included. It is right for every token
   whose window lies inside its own segment, i.e. all but the first ``min(w - 1, len)`` tokens of
   each segment. Backends: "torch" runs ``F.conv1d`` with ``w - 1`` zeros of left padding and
   ``groups = channels``, then the activation, as megatron-core's non-fused path does; "triton"
   runs triton_causal_conv.py (forward and backward, activation fused, no channels-first copies);
   "auto" takes Triton for CUDA tensors (unless a row is too long for its int32 offsets: over
   about 2^31 / d_proj tokens, or the conv wider than its ``MAX_WIDTH`` of 4 taps) and torch
   otherwise;
2. a fix-up of those few tokens: their windows are gathered along the root path
   (``ForestTensors.root_path_predecessors(w - 1)``, -1 = zero), the conv and the activation are
   recomputed for them, and written into the row conv's output (``index_put_`` without
   accumulation: each fixed token is written once, so the result and its gradient do not depend on
   any order).

The fix-up touches at most ``S * (w - 1)`` tokens (S segments), a small fraction of the row. On the
torch backend autograd differentiates the two steps as written; on Triton they are one autograd
node (``_TritonTreeConv``) whose backward touches no more of the row than the row conv's own does.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megatron.shared_prefix.tensors import ForestTensors, hosts_to_device

ACTIVATIONS = (None, "silu", "swish")
CONV_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class FixupWindows:
    """The tokens of a row whose conv window leaves their segment, and where their windows lie.

    F fixed tokens, w taps, P present window entries (packed tokens, not beyond a root), U distinct
    tokens those entries read, T tokens in the row.
    """

    tokens: torch.Tensor  # [F] int64 packed indices of the fixed tokens (the first w - 1 of each
    # segment, fewer in a shorter segment)
    windows: torch.Tensor  # [F, w] int64: ``windows[i, k]`` is the packed token tap k multiplies
    # for ``tokens[i]`` (tap w - 1 the token itself), -1 where the root path is shorter
    skip: torch.Tensor  # [T] uint8, 1 at the fixed tokens (the Triton row conv's backward skips
    # their output gradients)
    sources: torch.Tensor  # [P] int64 flat indices ``i * w + k`` of the present window entries
    targets: torch.Tensor  # [U] int64 distinct packed tokens the present entries read
    target_slots: torch.Tensor  # [P] int64 index into ``targets`` of each present entry


def _fixup_windows(forest: ForestTensors, width: int) -> FixupWindows:
    """The ``FixupWindows`` of ``forest`` for a conv of ``width`` taps, cached on the forest."""

    def build():
        # On the host, from the layout: a device-side nonzero would synchronize inside the forward.
        layout = forest.layout
        offset = np.arange(forest.num_tokens) - layout.segment_starts[layout.token_segment]
        tokens = np.flatnonzero(offset < width - 1)
        predecessors = forest.host_root_path_predecessors(width - 1)[tokens]  # nearest first
        windows = np.concatenate([predecessors[:, ::-1], tokens[:, None]], axis=1)
        skip = np.zeros(forest.num_tokens, dtype=np.uint8)
        skip[tokens] = 1
        sources = np.flatnonzero(windows.reshape(-1) >= 0)
        targets, target_slots = np.unique(windows.reshape(-1)[sources], return_inverse=True)
        arrays = (tokens, windows, skip, sources, targets, target_slots.reshape(-1))
        return FixupWindows(*hosts_to_device(arrays, forest.device))

    return forest.derive(("tree_conv_fixup", width), build)


def _fixup_pre_activation(rows, fixup: FixupWindows, weight, bias, compute):
    """(windows [F, w, d], pre-activations [F, d]) in ``compute`` of the fixed tokens, from
    rows [T, d]: zeros beyond the root, the bias added after the taps."""
    present = (fixup.windows >= 0).unsqueeze(-1)  # [F, w, 1]
    gathered = rows[fixup.windows.clamp(min=0)].to(compute) * present  # [F, w, d]
    pre = torch.einsum("fkd,dk->fd", gathered, weight.to(compute))
    if bias is not None:
        pre = pre + bias.to(compute)
    return gathered, pre


def _write_fixed_tokens(out, rows, fixup: FixupWindows, weight, bias, silu, compute) -> None:
    """Overwrite the fixed tokens of the row conv's output out [T, d] with their root-path conv
    (and SiLU), computed in ``compute`` and rounded once (``index_put_`` without accumulation:
    each fixed token is written once). The row conv does not keep its output for backward."""
    _, fixed = _fixup_pre_activation(rows, fixup, weight, bias, compute)
    out.index_put_((fixup.tokens,), (F.silu(fixed) if silu else fixed).to(out.dtype))


class _TritonTreeConv(torch.autograd.Function):
    """The Triton row conv and the fix-up as one autograd node.

    Composed of autograd ops (the torch backend's form), the fix-up's backward costs three passes
    over a [T, d] tensor: the in-place write of the fixed outputs clones the output gradient to
    zero its fixed rows, and the gather of their windows scatters into a zero [T, d] gradient that
    is then added to the row conv's. Here the row conv's backward skips the fixed rows' gradients
    (``FixupWindows.skip``) and the windows' gradients are added into its dx at the U tokens they
    read, in float32 (``index_put_`` with accumulation, which sorts its indices on CUDA: the order
    of addition is fixed) and rounded once.

    Args (``apply``): rows [T, d] (unit channel stride), weight [d, w] (w >= 2), bias [d] or None,
    silu (bool), fixup (``FixupWindows``). Returns [T, d] contiguous in rows' dtype.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, silu, fixup):  # pylint: disable=arguments-differ
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import forward_rows

        out = forward_rows(rows, weight, bias, silu)
        _write_fixed_tokens(out, rows, fixup, weight, bias, silu, torch.float32)
        ctx.save_for_backward(rows, weight, bias)
        ctx.silu, ctx.fixup = silu, fixup
        return out

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import backward_rows

        rows, weight, bias = ctx.saved_tensors
        fixup, width, channels = ctx.fixup, weight.shape[1], weight.shape[0]
        dx, sums = backward_rows(rows, grad, weight, bias, ctx.silu, skip=fixup.skip)
        gathered, pre = _fixup_pre_activation(rows, fixup, weight, bias, torch.float32)
        pre_grad = grad[fixup.tokens].float()  # [F, d]
        if ctx.silu:
            sigmoid = torch.sigmoid(pre)
            pre_grad = pre_grad * sigmoid * (1 + pre * (1 - sigmoid))
        sums[:, :width] += torch.einsum("fd,fkd->dk", pre_grad, gathered)
        sums[:, width] += pre_grad.sum(0)
        window_grads = pre_grad.unsqueeze(1) * weight.float().t().unsqueeze(0)  # [F, w, d]
        window_grads = window_grads.reshape(-1, channels)[fixup.sources]  # [P, d]
        added = torch.zeros(len(fixup.targets), channels, dtype=torch.float32, device=dx.device)
        added.index_put_((fixup.target_slots,), window_grads, accumulate=True)
        dx[fixup.targets] = (dx[fixup.targets].float() + added).to(dx.dtype)
        dweight = sums[:, :width].to(weight.dtype)
        dbias = None if bias is None else sums[:, width].to(bias.dtype)
        return dx, dweight, dbias, None, None


def prepare_tree_conv(forest: ForestTensors, width: int) -> None:
    """Build and cache what ``tree_causal_conv1d`` reads of ``forest`` for a conv of ``width``
    taps (a ``ForestTable`` build)."""
    _fixup_windows(forest, width)


def _use_triton(x: torch.Tensor, width: int, backend: str) -> bool:
    """Whether ``backend`` runs the row conv of x [1, T, d] with ``width`` taps on the Triton
    kernel: "auto" does for CUDA tensors of the kernel's dtypes whose offsets fit its int32
    arithmetic, up to its widest conv."""
    if backend != "auto":
        return backend == "triton"
    if not x.is_cuda:
        return False
    # pylint: disable-next=import-outside-toplevel
    from megatron.shared_prefix.ssm.triton_causal_conv import (
        MAX_WIDTH,
        SUPPORTED_DTYPES,
        offsets_fit,
    )

    token_stride = x.stride(1) if x.stride(2) == 1 else x.shape[2]  # else a contiguous copy runs
    return (
        x.dtype in SUPPORTED_DTYPES
        and width <= MAX_WIDTH
        and offsets_fit(x.shape[1], token_stride, x.shape[2])
    )


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    forest: ForestTensors,
    activation: Optional[str] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Depthwise causal convolution of every packed token over its root-path window.

    Args:
        x: [1, T, d] packed features (token-major, as they sit in Mamba's ``xBC``).
        weight: [d, w] or [d, 1, w] taps; tap ``w - 1`` multiplies the token itself.
        bias: [d] or None.
        forest: the row's metadata; T must equal ``forest.num_tokens``.
        activation: None, "silu" or "swish" (applied after the bias).
        backend: the row conv's, "auto", "torch" or "triton" (the module docstring). "triton" also
            runs CPU tensors, under Triton's interpreter (TRITON_INTERPRET=1), for tests.

    Returns:
        [1, T, d] in x's dtype: ``act(bias + sum_k weight[:, k] * x[token w-1-k steps back on the
        root path])``. The Triton row conv and the fix-up compute in float32 (the fix-up in float64
        for float64 inputs) and round once.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if backend not in CONV_BACKENDS:
        raise ValueError(f"backend must be one of {CONV_BACKENDS}, got {backend!r}")
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != forest.num_tokens:
        raise ValueError(
            f"tree_causal_conv1d expects x of shape [1, T={forest.num_tokens}, d], "
            f"got {tuple(x.shape)}"
        )
    channels = x.shape[2]
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    if weight.shape[0] != channels or (bias is not None and tuple(bias.shape) != (channels,)):
        raise ValueError(
            f"weight must be [{channels}, w] (or [{channels}, 1, w]) and bias [{channels}], got "
            f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}"
        )
    width, length = weight.shape[1], x.shape[1]

    silu = activation is not None
    if _use_triton(x, width, backend):
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import row_causal_conv1d

        rows = x[0] if x.stride(2) == 1 else x[0].contiguous()
        if width == 1:  # every window is the token itself: nothing to fix up
            return row_causal_conv1d(rows, weight, bias, silu).unsqueeze(0)
        fixup = _fixup_windows(forest, width)
        return _TritonTreeConv.apply(rows, weight, bias, silu, fixup).unsqueeze(0)

    # 1. The ordinary causal conv of the packed row: right wherever the window stays in-segment.
    out = F.conv1d(
        x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=channels
    )[..., :length]
    out = out.transpose(1, 2)[0]  # [T, d]
    if silu:
        out = F.silu(out)

    # 2. Recompute the first min(w - 1, len) tokens of every segment from their root-path windows.
    if width > 1:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        _write_fixed_tokens(out, x[0], _fixup_windows(forest, width), weight, bias, silu, compute)
    return out.unsqueeze(0)
