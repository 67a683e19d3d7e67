"""Pure-PyTorch Mamba-2 SSD ops with the signatures of mamba_ssm 2.3.2.

megatron-core's ``MambaMixer`` binds ``mamba_chunk_scan_combined``,
``mamba_split_conv1d_scan_combined`` (``mamba_ssm.ops.triton.ssd_combined``) and ``RMSNorm``
(``mamba_ssm.ops.triton.layernorm_gated``) when it is imported. Without mamba_ssm (CPU, CI)
``megatron.shared_prefix.cpu`` registers the functions of this module under those names; on GPU they
are the oracle mamba_ssm's Triton kernels are tested against. They are ordinary autograd code (no
custom backward), so every input, ``initial_states`` included, gets a gradient.

Semantics follow mamba_ssm's Triton kernels, including where they differ from its slow reference
functions:

* dt: ``dt + dt_bias``, then softplus (identity above 20, as ``F.softplus``) if ``dt_softplus``,
  then always clamped to ``dt_limit``; with the default (0, inf) a negative dt (only possible
  without softplus) becomes 0.
* ``seq_idx`` [b, l]: the state restarts from zero wherever the id changes between neighbouring
  positions. The position before the first token counts as id 0, so ``initial_states`` reaches the
  leading tokens only when ``seq_idx[:, 0] == 0`` (Megatron's ids always start at 0). The causal
  conv of the split op does not look across those boundaries either.
* Precision: everything is computed in float32 (float64 when an input is float64, for tests);
  outputs come back in the dtype of ``x`` / ``zxbcdt``, states in the compute dtype.

The scan is the chunked SSD algorithm: per chunk of ``chunk_size`` tokens a quadratic
(attention-like) form with a causal decay matrix, per-chunk states, a decayed sum of those states
across chunks, and the contribution of the state carried into each chunk. Memory is O(b * l * h *
chunk_size) plus O(b * h * (l / chunk_size)^2) for passing states between chunks.
"""

# Single-letter A, B, C, D (and xBC) are the SSM notation and mamba_ssm's argument names.
# pylint: disable=invalid-name

import math

import torch
import torch.nn.functional as F

_NO_DT_LIMIT = (0.0, float("inf"))


def _compute_dtype(*tensors):
    """float64 if any given tensor is float64 (oracle runs), else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _cast(tensor, dtype):
    return None if tensor is None else tensor.to(dtype)


def _process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """The step size the recurrence uses: bias, optional softplus, clamp (module docstring)."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _segment_ids(seq_idx, batch, length, device):
    """[b, l] int64 ids that start at 0 and grow by one at every change of ``seq_idx``.

    Comparing these ids is the same as asking "no sequence boundary in between", whatever values the
    caller's ids take; the position before the first token has id 0, as in mamba_ssm.
    """
    if seq_idx is None:
        return torch.zeros(batch, length, dtype=torch.long, device=device)
    seq_idx = seq_idx.long()
    previous = F.pad(seq_idx[:, :-1], (1, 0))  # id 0 before position 0
    return torch.cumsum((seq_idx != previous).long(), dim=1)


def _segment_sums(values, valid):
    """Sums of ``values`` over every half-open range (j, i], masked to -inf where not ``valid``.

    values [..., T]; valid broadcastable to [..., T, T] (row i, column j). Entry [i, j] is
    values[j+1] + ... + values[i], built with one cumulative sum of masked copies rather than as a
    difference of two prefix sums, which would cancel badly; exp() of the result is the decay from
    position j to position i and is exactly 0 where masked.
    """
    size = values.shape[-1]
    after_column = torch.ones(size, size, dtype=torch.bool, device=values.device).tril(-1)
    terms = values.unsqueeze(-1).expand(*values.shape, size).masked_fill(~after_column, 0.0)
    return terms.cumsum(dim=-2).masked_fill(~valid, -math.inf)


def _ssd_scan(x, dt, A, B, C, chunk_size, initial_states, segments, state_positions=None):
    """Chunked scan of the SSM part (no D, no gate).

    x [b, l, h, p], dt [b, l, h] (processed), A [h], B and C [b, l, g, n],
    initial_states [b, h, p, n] or None, segments [b, l] from ``_segment_ids``,
    state_positions [k]: positions in row 0 whose states are wanted (varlen states), or None.
    All floating inputs share one dtype.

    Returns (y [b, l, h, p], final state [b, h, p, n], states at state_positions [k, h, p, n]
    or None).
    """
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    per_group = heads // groups
    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length
    if pad:
        # Padded steps have dt = 0 and x = 0: no decay and no input, so they change nothing.
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
        segments = torch.cat([segments, segments[:, -1:].expand(batch, pad)], dim=1)

    # Heads are split as (group, head within group) so B and C are shared without copies.
    # Index letters: b batch, c chunk, g group, r head in group, i/j/t position in chunk, p, n.
    x = x.reshape(batch, chunks, chunk_size, groups, per_group, head_dim)
    B = B.reshape(batch, chunks, chunk_size, groups, state_dim)
    C = C.reshape(batch, chunks, chunk_size, groups, state_dim)
    dt = dt.reshape(batch, chunks, chunk_size, groups, per_group)
    dt = dt.permute(0, 1, 3, 4, 2)  # [b, c, g, r, t]
    log_decay = dt * A.reshape(groups, per_group, 1)
    segments = segments.reshape(batch, chunks, chunk_size)

    # 1. Inside each chunk: y_i = sum_{j <= i, same sequence} (C_i . B_j) decay(j -> i) dt_j x_j.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    same_sequence = segments.unsqueeze(-1) == segments.unsqueeze(-2)
    valid = (causal & same_sequence)[:, :, None, None]  # [b, c, 1, 1, i, j]
    decay = torch.exp(_segment_sums(log_decay, valid))  # [b, c, g, r, i, j]
    scores = torch.einsum("bcign,bcjgn->bcgij", C, B)
    weights = scores.unsqueeze(3) * decay * dt.unsqueeze(-2)
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", weights, x)

    # 2. Each chunk's own contribution to the state after its last token.
    to_chunk_end = decay[..., -1, :] * dt  # [b, c, g, r, t]
    chunk_states = torch.einsum("bcgrt,bctgn,bctgrp->bcgrpn", to_chunk_end, B, x)

    # 3. State at every chunk boundary k (k = 0: before the first chunk; k = c + 1: after chunk
    #    c): a decayed sum of the initial state and the chunk states, cut at sequence boundaries.
    #    A boundary belongs to the sequence of the token just before it.
    if initial_states is None:
        initial_states = x.new_zeros(batch, heads, head_dim, state_dim)
    sources = torch.cat(
        [initial_states.reshape(batch, 1, groups, per_group, head_dim, state_dim), chunk_states],
        dim=1,
    )
    chunk_log_decay = F.pad(log_decay.sum(-1).permute(0, 2, 3, 1), (1, 0))  # [b, g, r, c + 1]
    boundary_segments = F.pad(segments[:, :, -1], (1, 0))  # [b, c + 1]
    passing_valid = (boundary_segments.unsqueeze(-1) == boundary_segments.unsqueeze(-2)).tril()
    passing = torch.exp(_segment_sums(chunk_log_decay, passing_valid[:, None, None]))
    boundary_states = torch.einsum("bgrkj,bjgrpn->bkgrpn", passing, sources)
    states_in = boundary_states[:, :-1]  # the state entering each chunk

    # 4. The carried state's contribution, same sequence only:
    #    y_i += C_i . (decay(chunk start -> i) * state_in).
    carried = segments == boundary_segments[:, :-1, None]  # [b, c, t]
    carry_decay = torch.exp(
        torch.cumsum(log_decay, dim=-1).masked_fill(~carried[:, :, None, None], -math.inf)
    )  # [b, c, g, r, t]
    y = y + torch.einsum("bcign,bcgrpn,bcgri->bcigrp", C, states_in, carry_decay)

    y = y.reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    final_states = boundary_states[:, -1].reshape(batch, heads, head_dim, state_dim)
    if state_positions is None:
        return y, final_states, None

    # The state after token t of row 0: the same two parts as y, without the product with C.
    chunk, offset = state_positions // chunk_size, state_positions % chunk_size
    own = decay[0, chunk, :, :, offset] * dt[0, chunk]  # [k, g, r, t]
    states = torch.einsum("kgrt,ktgn,ktgrp->kgrpn", own, B[0, chunk], x[0, chunk])
    states = states + carry_decay[0, chunk, :, :, offset][..., None, None] * states_in[0, chunk]
    return y, final_states, states.reshape(-1, heads, head_dim, state_dim)


def _check_scan_shapes(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx):
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seqlen, nheads, headdim], got shape {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(f"B must be [{batch}, {length}, ngroups, dstate], got {tuple(B.shape)}")
    groups = B.shape[2]
    expected = {
        "dt": (dt, [(batch, length, heads)]),
        "A": (A, [(heads,)]),
        "C": (C, [tuple(B.shape)]),
        "D": (D, [(heads,), (heads, head_dim)]),
        "z": (z, [tuple(x.shape)]),
        "dt_bias": (dt_bias, [(heads,)]),
        "initial_states": (initial_states, [(batch, heads, head_dim, B.shape[3])]),
        "seq_idx": (seq_idx, [(batch, length)]),
    }
    for name, (tensor, shapes) in expected.items():
        if tensor is not None and tuple(tensor.shape) not in shapes:
            raise ValueError(
                f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(tensor.shape)}"
            )
    if heads % groups:
        raise ValueError(f"nheads ({heads}) must be a multiple of ngroups ({groups})")
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _scan_with_skip_and_gate(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    segments,
    *,
    D,
    z,
    dt_bias,
    initial_states,
    dt_softplus,
    dt_limit,
    state_positions=None,
):
    """Scan in the compute dtype, add D * x, gate with silu(z); returns compute-dtype results."""
    dtype = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    x, A, B, C, D, z = (_cast(t, dtype) for t in (x, A, B, C, D, z))
    dt = _process_dt(dt.to(dtype), _cast(dt_bias, dtype), dt_softplus, dt_limit)
    y, final_states, states = _ssd_scan(
        x, dt, A, B, C, int(chunk_size), _cast(initial_states, dtype), segments, state_positions
    )
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, final_states, states


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=_NO_DT_LIMIT,
    return_final_states=False,
    return_varlen_states=False,
):
    """Mamba-2 selective scan, chunked; drop-in for mamba_ssm's function of the same name.

    Shapes: x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] (g divides h),
    D [h] or [h, p], z [b, l, h, p], dt_bias [h], initial_states [b, h, p, n],
    seq_idx [b, l] integer, cu_seqlens [k + 1] (only with return_varlen_states, b == 1).

    Per head: state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T; y_t = state_t C_t + D x_t;
    out = y * silu(z) if z is given.

    Returns out [b, l, h, p] in x's dtype, then (in this order, when asked) final_states
    [b, h, p, n] and varlen_states [k, h, p, n]: the state after the last token cu_seqlens[i+1] - 1
    of each sequence. Sequences must be non-empty and separated by seq_idx for their states to be
    their own (as with mamba_ssm); unlike mamba_ssm's, these varlen states are differentiable.
    """
    _check_scan_shapes(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx)
    state_positions = None
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states=True needs cu_seqlens")
        if x.shape[0] != 1:
            raise ValueError(f"return_varlen_states needs batch size 1, got {x.shape[0]}")
        state_positions = cu_seqlens[1:].to(device=x.device, dtype=torch.long) - 1
    elif cu_seqlens is not None:
        raise ValueError(
            "cu_seqlens is only read with return_varlen_states=True (it selects which states are "
            "returned; it does not separate sequences: pass seq_idx for that)"
        )
    segments = _segment_ids(seq_idx, x.shape[0], x.shape[1], x.device)
    y, final_states, varlen_states = _scan_with_skip_and_gate(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        segments,
        D=D,
        z=z,
        dt_bias=dt_bias,
        initial_states=initial_states,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        state_positions=state_positions,
    )
    results = (y.to(x.dtype),)
    if return_final_states:
        results += (final_states,)
    if return_varlen_states:
        results += (varlen_states,)
    return results[0] if len(results) == 1 else results


def _causal_depthwise_conv(x, weight, bias, activation, segments):
    """Causal depthwise conv over tokens.

    x [b, l, d], weight [d, w], bias [d] or None, segments [b, l] from ``_segment_ids``.

    out[t] = bias + sum_s weight[:, w - 1 - s] * x[t - s], skipping taps before position 0 or in an
    earlier sequence; then silu if activation is "silu"/"swish".
    """
    length, width = x.shape[1], weight.shape[1]
    out = x * weight[:, -1]
    for shift in range(1, width):
        past = F.pad(x, (0, 0, shift, 0))[:, :length]  # x[t - shift], zeros before the start
        same_sequence = F.pad(segments, (shift, 0), value=-1)[:, :length] == segments
        out = out + past * same_sequence.unsqueeze(-1) * weight[:, width - 1 - shift]
    if bias is not None:
        out = out + bias
    return out if activation is None else F.silu(out)


def _gated_rms_norm(x, weight, z, eps, group_size, norm_before_gate):
    """RMSNorm over groups of the last dimension, gated by silu(z) before or after normalizing."""
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    features = x.shape[-1]
    grouped = x.unflatten(-1, (features // group_size, group_size))
    grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    out = grouped.flatten(-2) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


def mamba_split_conv1d_scan_combined(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    initial_states=None,
    seq_idx=None,
    dt_limit=_NO_DT_LIMIT,
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
):
    """The Mamba-2 block after its input projection; drop-in for mamba_ssm's function.

    zxbcdt [b, l, 2 * d_mlp + 2 * dim + 2 * ngroups * n + h] is split as [x0, y0 | z | x, B, C | dt]
    (dim = h * headdim; d_mlp >= 0 is inferred from the width, as in mamba_ssm).
    conv1d_weight [dim + 2 * ngroups * n, width], conv1d_bias [same] or None, dt_bias [h], A [h],
    D [h] (then headdim is required) or [h, headdim], initial_states [b, h, headdim, n],
    seq_idx [b, l], rmsnorm_weight [dim], outproj_weight [out, d_mlp + dim], outproj_bias [out].

    Steps: causal depthwise conv over (x, B, C) that does not cross seq_idx boundaries, with the
    activation ("silu"/"swish" or None); the scan with dt_softplus=True, dt_bias and D; then
    out = y * silu(z) without rmsnorm_weight, or the gated RMSNorm(y, z) in groups of
    dim // ngroups with rmsnorm_weight; silu(x0) * y0 concatenated in front when d_mlp > 0; the
    optional output projection. Returns out [b, l, out or d_mlp + dim] in zxbcdt's dtype, and
    final_states [b, h, headdim, n] when return_final_states.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if D.dim() == 1 and headdim is None:
        raise ValueError("headdim must be given when D has shape [nheads]")
    if D.dim() == 2:
        if headdim not in (None, D.shape[1]):
            raise ValueError(f"headdim={headdim} contradicts D of shape {tuple(D.shape)}")
        headdim = D.shape[1]
    heads = D.shape[0]
    dim = heads * headdim
    conv_dim = conv1d_weight.shape[0]
    state_dim = (conv_dim - dim) // (2 * ngroups)
    if conv_dim != dim + 2 * ngroups * state_dim or state_dim < 1:
        raise ValueError(
            f"conv1d_weight has {conv_dim} channels; expected dim + 2 * ngroups * dstate with "
            f"dim={dim}, ngroups={ngroups}"
        )
    batch, length, width = zxbcdt.shape
    mlp_dim, odd = divmod(width - 2 * dim - 2 * ngroups * state_dim - heads, 2)
    if mlp_dim < 0 or odd:
        raise ValueError(
            f"zxbcdt width {width} does not fit "
            f"2 * d_mlp + 2 * {dim} + 2 * {ngroups} * {state_dim} + {heads}"
        )
    if rmsnorm_weight is not None and tuple(rmsnorm_weight.shape) != (dim,):
        raise ValueError(
            f"rmsnorm_weight must have shape ({dim},), got {tuple(rmsnorm_weight.shape)}"
        )
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError("outproj_bias needs outproj_weight")

    dtype = _compute_dtype(
        zxbcdt,
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        initial_states,
        rmsnorm_weight,
        outproj_weight,
    )
    mlp_in, z, xBC, dt = torch.split(
        zxbcdt.to(dtype), [2 * mlp_dim, dim, dim + 2 * ngroups * state_dim, heads], dim=-1
    )
    segments = _segment_ids(seq_idx, batch, length, zxbcdt.device)
    xBC = _causal_depthwise_conv(
        xBC, conv1d_weight.to(dtype), _cast(conv1d_bias, dtype), activation, segments
    )
    x, B, C = torch.split(xBC, [dim, ngroups * state_dim, ngroups * state_dim], dim=-1)
    x = x.reshape(batch, length, heads, headdim)
    B = B.reshape(batch, length, ngroups, state_dim)
    C = C.reshape(batch, length, ngroups, state_dim)
    z = z.reshape(batch, length, heads, headdim)
    _check_scan_shapes(x, dt, A, B, C, chunk_size, D, None, dt_bias, initial_states, seq_idx)
    y, final_states, _ = _scan_with_skip_and_gate(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        segments,
        D=D,
        z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        initial_states=initial_states,
        dt_softplus=True,
        dt_limit=dt_limit,
    )
    out = y.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = _gated_rms_norm(
            out,
            rmsnorm_weight.to(dtype),
            z.reshape(batch, length, dim),
            rmsnorm_eps,
            dim // ngroups,
            norm_before_gate,
        )
    if mlp_dim:
        gate, value = mlp_in.chunk(2, dim=-1)
        out = torch.cat([F.silu(gate) * value, out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight.to(dtype), _cast(outproj_bias, dtype))
    out = out.to(zxbcdt.dtype)
    return (out, final_states) if return_final_states else out


class RMSNorm(torch.nn.Module):
    """Gated RMSNorm, interface and state_dict of mamba_ssm.ops.triton.layernorm_gated.RMSNorm.

    ``weight`` [hidden_size] is the only parameter; ``bias`` is registered as None (as in
    mamba_ssm), so the state_dict holds just ``weight`` and megatron's ``ExtendedRMSNorm`` subclass
    can shard it. forward(x [..., hidden_size], z [same] or None): norm_before_gate: RMSNorm(x) *
    silu(z), otherwise RMSNorm(x * silu(z)); each block of group_size features (default: all) is
    normalized on its own. Computed in float32 (float64 for float64 inputs), returned in x's dtype.
    """

    def __init__(
        self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None
    ):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        """Weight to ones (the identity scale), as mamba_ssm initializes it."""
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        """Normalize x [..., hidden_size], gated by z [same] when given."""
        dtype = _compute_dtype(x, z, self.weight)
        out = _gated_rms_norm(
            x.to(dtype),
            self.weight.to(dtype),
            _cast(z, dtype),
            self.eps,
            self.group_size or x.shape[-1],
            self.norm_before_gate,
        )
        return out.to(x.dtype)
