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

The fix-up touches at most ``S * (w - 1)`` tokens (S segments), a small fraction of the row.
"""

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megatron.shared_prefix.tensors import ForestTensors, hosts_to_device

ACTIVATIONS = (None, "silu", "swish")
CONV_BACKENDS = ("auto", "torch", "triton")


def _fixup_windows(forest: ForestTensors, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [F], windows [F, width]) of the tokens whose window leaves their segment.

    ``windows[i, k]`` is the packed index of the token that tap ``k`` of the weight multiplies for
    ``tokens[i]`` (tap ``width - 1`` is the token itself, tap ``width - 1 - j`` the j-th previous
    token on its root path), -1 where the root path is shorter. Cached on the forest.
    """

    def build():
        # On the host, from the layout: a device-side nonzero would synchronize inside the forward.
        layout = forest.layout
        offset = np.arange(forest.num_tokens) - layout.segment_starts[layout.token_segment]
        tokens = np.flatnonzero(offset < width - 1)
        predecessors = forest.host_root_path_predecessors(width - 1)[tokens]  # nearest first
        windows = np.concatenate([predecessors[:, ::-1], tokens[:, None]], axis=1)
        return hosts_to_device([tokens, windows], forest.device)

    return forest.derive(("tree_conv_fixup", width), build)


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

    # 1. The ordinary causal conv of the packed row: right wherever the window stays in-segment.
    if _use_triton(x, width, backend):
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_causal_conv import row_causal_conv1d

        rows = x[0] if x.stride(2) == 1 else x[0].contiguous()
        out = row_causal_conv1d(rows, weight, bias, silu=activation is not None)  # [T, d]
    else:
        out = F.conv1d(
            x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=channels
        )[..., :length]
        out = out.transpose(1, 2)[0]  # [T, d]
        if activation is not None:
            out = F.silu(out)

    # 2. Recompute the first min(w - 1, len) tokens of every segment from their root-path windows.
    if width > 1:
        tokens, windows = _fixup_windows(forest, width)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        present = (windows >= 0).unsqueeze(-1)  # [F, w, 1]
        gathered = x[0][windows.clamp(min=0)] * present  # [F, w, d]; zeros beyond the root
        fixed = torch.einsum("fkd,dk->fd", gathered.to(compute), weight.to(compute))
        if bias is not None:
            fixed = fixed + bias.to(compute)
        if activation is not None:
            fixed = F.silu(fixed)
        # Neither row conv keeps its output for backward, so the fix-up writes into it in place.
        out.index_put_((tokens,), fixed.to(out.dtype))
    return out.unsqueeze(0)
