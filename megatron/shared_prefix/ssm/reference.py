"""Sequential oracles for the Mamba-2 ops in ``torch_ssd``: slow, obviously correct, for tests only.

Each function walks the sequence one token at a time, exactly as the recurrence is written, so that
the chunked implementation (and mamba_ssm's Triton kernels) can be checked against it in float64.
They compute in the dtype of their inputs; use small sizes.

Sequence boundaries (``seq_idx``, [b, l] integer ids) follow mamba_ssm: a new sequence starts
wherever the id changes from one position to the next, and the position before the first token
counts as id 0, so the state carried in (``initial_states``, or the conv history) reaches the
leading tokens only if ``seq_idx[:, 0] == 0``.
"""

# Single-letter A, B, C, D (and xBC) are the SSM notation and mamba_ssm's argument names.
# pylint: disable=invalid-name

import math

import torch
import torch.nn.functional as F


def _starts_new_sequence(seq_idx, t):
    """[b] bool: does position t begin a sequence (its id differs from the previous position's)?"""
    previous = seq_idx[:, t - 1] if t > 0 else torch.zeros_like(seq_idx[:, 0])
    return seq_idx[:, t] != previous


def selective_scan_sequential(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, math.inf),
    initial_states=None,
    seq_idx=None,
):
    """Run the Mamba-2 recurrence token by token.

    Shapes: x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] (head i reads group i // (h //
    g)), D [h] or [h, p], z [b, l, h, p], dt_bias [h], initial_states [b, h, p, n], seq_idx [b, l].

    dt is biased, passed through softplus if asked, then clamped to dt_limit (always, as mamba_ssm's
    kernel does). Per head: state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T, zeroed first
    at every sequence start; y_t = state_t C_t + D * x_t, times silu(z_t) when z is given.

    Returns (y [b, l, h, p], final state [b, h, p, n]).
    """
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    # Give every head its own copy of its group's B and C.
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)

    if initial_states is None:
        state = x.new_zeros(batch, heads, head_dim, state_dim)
    else:
        state = initial_states
    outputs = []
    for t in range(length):
        if seq_idx is not None:
            keep = ~_starts_new_sequence(seq_idx, t)
            state = state * keep.to(state.dtype)[:, None, None, None]
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay * state + update
        outputs.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(outputs, dim=1)

    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def causal_conv1d_sequential(x, weight, bias=None, activation=None, seq_idx=None):
    """Depthwise causal convolution, one output position at a time.

    x [b, l, d] (token-major, as the features sit in ``zxbcdt``), weight [d, w], bias [d] or None,
    activation None, "silu" or "swish", seq_idx [b, l] or None. out[t] = bias + sum_k weight[:, k] *
    x[t - (w - 1) + k], where positions before 0 or before the start of t's sequence contribute
    nothing. Returns [b, l, d].
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    batch, length, _ = x.shape
    width = weight.shape[1]
    outputs = []
    for row in range(batch):
        sequence_start = 0
        for t in range(length):
            if seq_idx is not None and bool(_starts_new_sequence(seq_idx[row : row + 1], t)):
                sequence_start = t
            first = max(sequence_start, t - width + 1)
            window = x[row, first : t + 1]  # [t + 1 - first, d]
            taps = weight[
                :, width - (t + 1 - first) :
            ]  # the last taps line up with the newest tokens
            value = (window.T * taps).sum(-1)
            if bias is not None:
                value = value + bias
            outputs.append(value)
    out = torch.stack(outputs).view(batch, length, -1)
    return out if activation is None else F.silu(out)


def rms_norm_gated_reference(x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=True):
    """Gated RMSNorm over the last dimension, one group at a time.

    x and z [..., d], weight [d]. norm_before_gate: RMSNorm(x) * silu(z); otherwise RMSNorm(x *
    silu(z)). With group_size each consecutive block of group_size features gets its own
    root-mean-square.
    """
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    size = group_size or x.shape[-1]
    pieces = []
    for begin in range(0, x.shape[-1], size):
        block = x[..., begin : begin + size]
        root_mean_square = torch.sqrt(block.pow(2).mean(-1, keepdim=True) + eps)
        pieces.append(block / root_mean_square)
    out = torch.cat(pieces, dim=-1) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


def mamba_split_conv1d_scan_sequential(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    *,
    initial_states=None,
    seq_idx=None,
    dt_limit=(0.0, math.inf),
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
):
    """The split-conv Mamba-2 block, composed from the sequential pieces above.

    zxbcdt [b, l, 2 * d_mlp + 2 * dim + 2 * ngroups * n + h] is read as [x0, y0 | z | x, B, C | dt];
    the optional leading 2 * d_mlp features become silu(x0) * y0 and are concatenated in front of
    the SSM output. Then: causal conv (+ activation) over (x, B, C); the scan with softplus(dt +
    dt_bias), D and, without rmsnorm_weight, the gate silu(z); with rmsnorm_weight a gated RMSNorm
    in groups of dim // ngroups; finally the optional output projection. Returns (out, final state
    [b, h, p, n]).
    """
    heads = A.shape[0]
    head_dim = headdim if D.dim() == 1 else D.shape[1]
    dim = heads * head_dim
    state_dim = (conv1d_weight.shape[0] - dim) // (2 * ngroups)
    mlp_dim = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * state_dim - heads) // 2
    mlp_in, z, xBC, dt = torch.split(
        zxbcdt, [2 * mlp_dim, dim, dim + 2 * ngroups * state_dim, heads], dim=-1
    )
    xBC = causal_conv1d_sequential(xBC, conv1d_weight, conv1d_bias, activation, seq_idx)
    x, B, C = torch.split(xBC, [dim, ngroups * state_dim, ngroups * state_dim], dim=-1)
    batch, length = zxbcdt.shape[:2]
    z4 = z.reshape(batch, length, heads, head_dim)
    y, final_state = selective_scan_sequential(
        x.reshape(batch, length, heads, head_dim),
        dt,
        A,
        B.reshape(batch, length, ngroups, state_dim),
        C.reshape(batch, length, ngroups, state_dim),
        D=D,
        z=z4 if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=dt_limit,
        initial_states=initial_states,
        seq_idx=seq_idx,
    )
    out = y.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = rms_norm_gated_reference(
            out, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups, norm_before_gate
        )
    if mlp_dim > 0:
        gate, value = mlp_in.chunk(2, dim=-1)
        out = torch.cat([F.silu(gate) * value, out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return out, final_state


# ------------------------------------------------------------------------------------------------
# Prefix forests: the recurrences along each token's root path (oracles of tree_conv, tree_scan)


def root_path_predecessor(segment_starts, segment_lengths, segment_parents):
    """Previous token on each packed token's root path: a list of T ints (-1: a root's first token).

    Inside a segment that is the token before; for a segment's first token it is the last token of
    the parent segment. The arguments are a forest's segment arrays (lists, arrays or tensors).
    """
    starts = [int(v) for v in segment_starts]
    lengths = [int(v) for v in segment_lengths]
    parents = [int(v) for v in segment_parents]
    predecessor = []
    for start, length, parent in zip(starts, lengths, parents):
        predecessor.append(starts[parent] + lengths[parent] - 1 if parent >= 0 else -1)
        predecessor.extend(range(start, start + length - 1))
    return predecessor


def tree_causal_conv1d_sequential(x, weight, bias, forest, activation=None):
    """Depthwise causal convolution of a packed forest row, one token at a time along its root path.

    x [1, T, d], weight [d, w], bias [d] or None, forest: anything with ``segment_starts``,
    ``segment_lengths`` and ``segment_parents`` (a ForestLayout or ForestTensors). out[t] = bias +
    sum_j weight[:, w - 1 - j] * x[p_j(t)], where p_0(t) = t and p_{j+1}(t) is the root-path
    predecessor of p_j(t); taps past the root contribute nothing. Returns [1, T, d].
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    predecessor = root_path_predecessor(
        forest.segment_starts, forest.segment_lengths, forest.segment_parents
    )
    width = weight.shape[1]
    outputs = []
    for t in range(x.shape[1]):
        value = torch.zeros_like(x[0, t]) if bias is None else bias.clone()
        token = t
        for j in range(width):
            if token < 0:
                break
            value = value + weight[:, width - 1 - j] * x[0, token]
            token = predecessor[token]
        outputs.append(value)
    out = torch.stack(outputs).unsqueeze(0)
    return out if activation is None else F.silu(out)


def tree_selective_scan_sequential(
    x,
    dt,
    A,
    B,
    C,
    forest,
    *,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, math.inf),
):
    """The Mamba-2 recurrence over a packed forest row, token by token.

    Shapes as ``selective_scan_sequential`` with batch 1: x [1, T, h, p], dt [1, T, h], A [h], B
    and C [1, T, g, n], D [h] or [h, p], z [1, T, h, p], dt_bias [h]; forest as in
    ``tree_causal_conv1d_sequential``. The state of token t starts from the state after its
    root-path predecessor (zero at a root): state_t = exp(dt_t A) state_pred(t) + dt_t x_t B_t^T;
    y_t = state_t C_t + D x_t, times silu(z_t) when z is given. Packed order visits every
    predecessor first (DFS order).
    Returns y [1, T, h, p].
    """
    heads, head_dim = x.shape[2], x.shape[3]
    groups = B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    predecessor = root_path_predecessor(
        forest.segment_starts, forest.segment_lengths, forest.segment_parents
    )
    states, outputs = [], []
    for t in range(x.shape[1]):
        previous = predecessor[t]
        assert previous < t, "packed order must visit a token's root path first"
        state = states[previous] if previous >= 0 else x.new_zeros(heads, head_dim, B.shape[3])
        decay = torch.exp(dt[0, t] * A)[:, None, None]
        state = decay * state + (dt[0, t, :, None] * x[0, t])[..., None] * B[0, t, :, None, :]
        states.append(state)
        outputs.append((state * C[0, t, :, None, :]).sum(-1))
    y = torch.stack(outputs).unsqueeze(0)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y
