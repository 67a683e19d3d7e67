"""Causal depthwise conv1d over a prefix forest (upstream: megatron/core/ssm/ops/).

Mamba's short convolution gives token ``t`` the window of itself and the ``w - 1`` tokens before it.
On a packed forest "before" means along t's *root path*: inside its segment while it can, then the
tail of the parent segment, then the grandparent's when the parent is shorter than the window, and
zeros beyond the root. That is exactly the window the token has in every original sequence through
it, so the convolution of each packed token equals the dense one.

Implementation (memory O(T * channels)): the first ``min(w - 1, len)`` tokens of each segment
are the *fixed tokens*, whose windows leave their segment; every other token's window lies inside
its own segment, so an ordinary causal conv over the packed row is right for it. The fixed tokens'
windows are gathered along the root path (``ForestTensors.root_path_predecessors(w - 1)``, -1 =
zero) once per forest (``FixupWindows``). Backends:

* "torch": ``F.conv1d`` over the row with ``w - 1`` zeros of left padding and ``groups =
  channels``, then the activation, as megatron-core's non-fused path does; then a fix-up of the
  fixed tokens: the conv and the activation recomputed from their windows and written into the
  row conv's output (``index_put_`` without accumulation: each fixed token is written once, so
  the result and its gradient do not depend on any order). Autograd differentiates both steps.
* "triton": triton_causal_conv.py (activation fused, no channels-first copies), as one autograd
  node (``_TritonTreeConv``): the forward kernel reads every token's taps from a [T, w] table
  (the fixed tokens' windows in it), so there is no fix-up pass; the backward is the row conv's,
  skipping the fixed tokens, plus two kernels for the fixed tokens' windows.
* "auto": Triton for CUDA tensors (unless a row is too long for its int32 offsets: over about
  2^31 / d_proj tokens, or the conv wider than its ``MAX_WIDTH`` of 4 taps), torch otherwise.

The fixed tokens are at most ``S * (w - 1)`` (S segments), a small fraction of the row.
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
    tap_tokens: torch.Tensor  # [T, w] int32: the token tap k multiplies for every token, the
    # w - 1 before it and itself, the window of ``windows`` at a fixed token (Triton forward)
    targets: torch.Tensor  # [U] int64 distinct packed tokens the present entries read
    target_starts: torch.Tensor  # [U + 1] int64: the present entries that read ``targets[u]``
    # are ``target_entries[target_starts[u]:target_starts[u + 1]]``
    target_entries: torch.Tensor  # [P] int64 flat indices ``i * w + k`` of the present entries,
    # by target, in index order within one
    max_target_entries: int  # the most entries that read one target


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
        tap_tokens = np.arange(forest.num_tokens)[:, None] - (width - 1) + np.arange(width)
        tap_tokens[tokens] = windows  # the others' windows lie inside their segments
        present = np.flatnonzero(windows.reshape(-1) >= 0)
        targets, target_slots = np.unique(windows.reshape(-1)[present], return_inverse=True)
        counts = np.bincount(target_slots.reshape(-1), minlength=len(targets))
        arrays = (
            tokens,
            windows,
            skip,
            tap_tokens.astype(np.int32),
            targets,
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            present[np.argsort(target_slots.reshape(-1), kind="stable")],
        )
        return FixupWindows(
            *hosts_to_device(arrays, forest.device), max_target_entries=int(counts.max(initial=0))
        )

    return forest.derive(("tree_conv_fixup", width), build)


def _write_fixed_tokens(out, rows, fixup: FixupWindows, weight, bias, silu, compute) -> None:
    """Overwrite the fixed tokens of the row conv's output out [T, d] with their root-path conv
    (and SiLU) from rows [T, d] (zeros beyond the root, the bias added after the taps), computed
    in ``compute`` and rounded once (``index_put_`` without accumulation: each fixed token is
    written once). The torch backend's fix-up; the row conv does not keep its output for
    backward."""
    present = (fixup.windows >= 0).unsqueeze(-1)  # [F, w, 1]
    gathered = rows[fixup.windows.clamp(min=0)].to(compute) * present  # [F, w, d]
    fixed = torch.einsum("fkd,dk->fd", gathered, weight.to(compute))
    if bias is not None:
        fixed = fixed + bias.to(compute)
    out.index_put_((fixup.tokens,), (F.silu(fixed) if silu else fixed).to(out.dtype))


class _TritonTreeConv(torch.autograd.Function):
    """The tree conv on Triton (triton_causal_conv.py) as one autograd node: no fix-up pass.

    Forward: one launch of the row conv, every output reading its taps from the forest's
    ``FixupWindows.tap_tokens`` (the w - 1 tokens before it, or a fixed token's root-path window).
    Backward: the row conv's backward skips the fixed tokens' output gradients
    (``FixupWindows.skip``); two kernels then compute the fixed tokens' pre-activation gradients
    with their windows' weight and bias parts (as extra rows of the row backward's partial sums,
    all added by one ``torch.sum``) and add their windows' input gradients into dx at the U
    distinct tokens they read, each summed in float32 in a fixed order and rounded once.

    Composed of autograd ops (the torch backend's form), the fix-up costs about ten small ops
    forward and three passes over a [T, d] tensor backward (a clone of the output gradient to zero
    its fixed rows, a zero [T, d] gradient for the gathered windows, the sum of the two).

    Args (``apply``): rows [T, d] (unit channel stride), weight [d, w] (w >= 2), bias [d] or None,
    silu (bool), fixup (``FixupWindows``). Returns [T, d] contiguous in rows' dtype.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, silu, fixup):  # pylint: disable=arguments-differ
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import forward_rows

        out = forward_rows(rows, weight, bias, silu, tap_tokens=fixup.tap_tokens)
        ctx.save_for_backward(rows, weight, bias)
        ctx.silu, ctx.fixup = silu, fixup
        return out

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import (
            backward_fixed,
            backward_rows,
            fixed_blocks,
        )

        rows, weight, bias = ctx.saved_tensors
        fixup, width = ctx.fixup, weight.shape[1]
        fixed_rows = fixed_blocks(fixup.tokens.shape[0])
        dx, partial, grad = backward_rows(
            rows, grad, weight, bias, ctx.silu, skip=fixup.skip, extra_rows=fixed_rows
        )
        backward_fixed(
            rows, grad, weight, bias, ctx.silu, fixup.tokens, fixup.windows, fixup.targets,
            fixup.target_starts, fixup.target_entries, fixup.max_target_entries, dx=dx,
            partial=partial[partial.shape[0] - fixed_rows :],
        )  # fmt: skip
        sums = partial.sum(0)
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
        root path])``. The Triton conv computes in float32, the torch backend's fix-up in
        float32 (float64 for float64 inputs), and both round once.
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
