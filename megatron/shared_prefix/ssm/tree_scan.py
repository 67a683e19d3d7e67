"""Mamba-2 SSD scan over a prefix forest, exact and differentiable (upstream:
megatron/core/ssm/ops).

Every packed token must see the SSM state its original sequences have: the state entering a
segment is the state at the end of its parent segment (forked to every child), and so on up to the
root. :func:`tree_ssd_scan` computes that with one ordinary packed scan plus a small correction.

Linearity argument (what makes the correction exact)
----------------------------------------------------
Per head, the recurrence is ``s_t = a_t s_{t-1} + b_t`` with ``a_t = exp(dt_t A)`` (a scalar) and
``b_t = dt_t x_t B_t^T`` ([P, N]); ``y_t = s_t C_t + D x_t``. Take a segment ``c`` whose tokens are
``t_0 .. t_e`` and whose state entering ``t_0`` is ``h_in`` (the state after the parent's last
token; zero for a root). Unrolling the recurrence inside the segment,

    s_t = (a_t a_{t-1} ... a_{t_0}) h_in + s0_t,   s0_t = sum_{t_0 <= u <= t} (a_t ... a_{u+1}) b_u,

where ``s0`` is the solution of the same recurrence started from zero at ``t_0``. With the
within-segment cumulative log-decay ``cum_t = sum_{t_0 <= u <= t} dt_u A`` the product is
``exp(cum_t)``, hence

    y_t = y0_t + C_t . (exp(cum_t) h_in),                                                    (1)
    h_end(c) = s0_{t_e} + exp(cum_{t_e}) h_in,  s0_{t_e} = sum_u exp(cum_{t_e} - cum_u) b_u,  (2)

where ``y0`` is the output of a zero-initial-state scan of the segment alone (D skip included: it
does not involve the state). A packed scan with ``seq_idx = token_segment`` gives ``y0`` for every
segment at once; (2), evaluated parents-first, gives every internal segment's end state, and (1)
adds the inherited part to every token of a non-root segment. When the gate ``silu(z)`` is applied
to y (the unnormalized Mamba variant), it multiplies (1) term by term, so the scan keeps fusing it
and the correction is gated alike.

Cost: the packed scan (O(T) work and memory, no padding); a float64 segmented cumulative sum of
``dt * A`` over [T, H] (differences of float64 prefix sums: exact enough at any row length, where
float32 prefix sums minus offsets would cancel); per internal segment one [L, H, P] x [L, N]
product for (2); per internal segment, for (1), a gather of its children's C and a [K, N] x [N, P]
product per head, in a custom autograd function that keeps nothing of size [K, H, P] for backward.
Python iterates once per *internal* segment (a GRPO group has one); the end states kept for
backward are O(internal segments x H x P x N), float32. That is the torch path (CPU, and the
oracle). Next to mamba_ssm's Triton scan the same steps run as Triton kernels instead
(ssm/triton_inherited_state.py), a fixed number of launches per layer whatever the forest: the
segmented log-decay (float64 sums in registers), the own states of all internal segments, their
chain to the parents' end states, and the correction of every child token, each reading the
activations once, and as many for the backward. Python then loops over nothing per segment, which
matters on rows with many short segments, where the layer is otherwise bound by kernel launches.

Why not level-wise batches with ``initial_states``: mamba_ssm's chunk scan takes one initial state
per *batch row*. Running each depth of the forest as a batch whose rows are that depth's segments,
each started from its parent's end state (``return_final_states`` of the previous depth), pads
every row to its longest sibling (a GRPO group with completions of 64..2048 tokens costs
16 x 2048 tokens instead of their sum), gathers a padded copy of every depth, and launches one scan
per depth, one after the other. The packed scan plus (1)-(2) has no padding and one scan launch per
layer. tools/bench_mamba.py times both.

Backends: the packed scan is ``torch_ssd.mamba_chunk_scan_combined`` (pure torch, any device: the
CPU path and the oracle) or mamba_ssm's Triton ``mamba_chunk_scan_combined`` (CUDA); both are
called identically. On CUDA, mamba_ssm's own forward and backward functions and the Triton
correction run in one autograd function, ``_ForkedChunkScan``: the correction is written into the
scan's output and its gradients are added into the scan's (no activation-sized fills, copies or
sums for the fork), and without a gate nothing of the output's size is kept for backward (the norm
keeps the corrected output). With torch_ssd, or a mamba_ssm without those functions, the stock
scan runs and the correction is plain torch (the Triton kernels round the float32 state, or
weighted input, to the input dtype before the product, as mamba_ssm does for the states it passes
between chunks).
Gathers with repeated indices are kept out of the backward (see ``_per_token``); like mamba_ssm's
own backward kernels, the float accumulations left (cumulative sums, matrix products) are bitwise
reproducible under ``torch.use_deterministic_algorithms(True)``.
"""

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megatron.shared_prefix.ssm import torch_ssd
from megatron.shared_prefix.tensors import ForestTensors, cumsum_over_tokens, hosts_to_device

# Mamba's notation (A, B, C, D) is kept for the SSM's tensors.
# pylint: disable=invalid-name

TREE_SCAN_BACKENDS = ("auto", "torch", "triton")
_NO_DT_LIMIT = (0.0, math.inf)


def triton_chunk_scan():
    """mamba_ssm's Triton ``mamba_chunk_scan_combined``, or None when mamba_ssm cannot be imported
    (or when the pure-torch fallback of ``megatron.shared_prefix.cpu`` stands in for it)."""
    try:
        from mamba_ssm.ops.triton import ssd_combined  # pylint: disable=import-outside-toplevel
    except Exception:  # pylint: disable=broad-except  # any import failure means "not available"
        return None
    if getattr(ssd_combined, "__shared_prefix_fallback__", False):
        return None
    return ssd_combined.mamba_chunk_scan_combined


_SCAN_FORWARD_ARGS = ("x", "dt", "A", "B", "C", "chunk_size")
_SCAN_BACKWARD_ARGS = ("dout", "x", "dt", "A", "B", "C", "out", "chunk_size")
_SCAN_BACKWARD_BUFFERS = ("dx", "dB", "dC")  # gradient buffers it writes into when given


def scan_functions(scan, scan_kwargs: Optional[dict] = None):
    """mamba_ssm's (forward, backward) functions behind ``scan`` when ``scan`` is its Triton
    ``mamba_chunk_scan_combined`` and the module has them with the leading arguments that
    ``_ForkedChunkScan`` passes (mamba_ssm 2.3) and the keywords D, z, seq_idx and those of
    ``scan_kwargs`` (the backward also dx, dB and dC: the buffers it writes the gradients into);
    else None (the stock scan runs, with the torch correction)."""
    module = sys.modules.get(getattr(scan, "__module__", None) or "")
    if module is None or scan is not getattr(module, "mamba_chunk_scan_combined", None):
        return None
    functions = (
        getattr(module, "_mamba_chunk_scan_combined_fwd", None),
        getattr(module, "_mamba_chunk_scan_combined_bwd", None),
    )
    keywords = ("D", "z", "seq_idx", *sorted(scan_kwargs or {}))
    if _takes(functions[0], _SCAN_FORWARD_ARGS, keywords) and _takes(
        functions[1], _SCAN_BACKWARD_ARGS, keywords + _SCAN_BACKWARD_BUFFERS
    ):
        return functions
    return None


@functools.lru_cache(maxsize=None)
def _takes(function, leading: tuple, keywords: tuple) -> bool:
    """Whether ``function`` (None: no) starts with the parameters ``leading`` and has the
    parameters ``keywords`` (read once per function: this runs in every forward)."""
    if function is None:
        return False
    parameters = inspect.signature(function).parameters
    return tuple(parameters)[: len(leading)] == leading and set(keywords) <= set(parameters)


class _ForkedChunkScan(torch.autograd.Function):  # pylint: disable=abstract-method
    """mamba_ssm's Triton chunk scan of a forest row, with the forked states (1)-(2) added by the
    Triton kernels of ssm/triton_inherited_state.py, as one autograd function.

    Forward: mamba_ssm's forward function with ``seq_idx = token_segment`` gives y0 (gated by
    silu(z) when z is given); then ``ForkedStates.correct`` adds the inherited part to y0 in place
    at every child token. Backward: mamba_ssm's backward function with the corrected output's
    gradient (y0's, since the correction adds to it), then ``ForkedStates.backward_tokens`` adds
    the fork's gradients into the scan's gradients of x, dt, A, B, C and z, in place, at the
    tokens it touches.

    Why one function: as separate autograd functions, every input that both reach (x, dt, B, C,
    z) would get from the fork a zero-filled tensor of its size, written at some tokens, that
    autograd then adds to the scan's; and the correction could not write into the scan's output
    (the stock function keeps it for backward), so it would be a corrected copy. Those fills,
    copies and sums cost about as much as the fork's arithmetic (docs/benchmarks.md).

    The fork's work that reads nothing of the scan's results (the end states in the forward,
    ``ForkedStates.states``; their gradients in the backward, ``ForkedStates.backward_states``)
    is queued first, on a stream of its own (:func:`_fork_stream`), and runs beside mamba_ssm's
    kernels, some of which leave most of the GPU idle; the current stream waits for it only
    before the correction and the token gradients. Every kernel computes what it did on one
    stream, so the bits do not depend on how the two streams interleave.

    Kept for backward: what mamba_ssm's own ``MambaChunkScanCombinedFn`` keeps, except the
    output when there is no gate (its backward reads it only for the gate; with z the ungated
    output is kept, as there), plus the fork's [internal segments, h, p, n] end states in the
    activations' dtype and, in float32, those of the internal segments that are another's parent
    (its [T, h] float32 log-decays and input weights are recomputed in backward). A row without
    internal segments runs the scan alone, its outputs and gradients bitwise mamba_ssm's stock
    function's.

    When x, B and C are the adjacent channel views of one [1, T, h*p + 2*g*n] tensor that
    :func:`split_channels` gives (the conv output in the mixer), mamba_ssm's backward writes their
    gradients into the matching views of one buffer of that layout, which the split's backward
    then passes on as the whole tensor's gradient without a concatenation.

    Inputs: x [1, T, h, p], dt [1, T, h] float32 (processed: no bias, no softplus), A [h]
    float32, B and C [1, T, g, n], D, z [1, T, h, p] or None, the forest, chunk_size, and
    mamba_ssm's (forward, backward) of :func:`scan_functions`, then keyword arguments of both.
    """

    @staticmethod
    # pylint: disable-next=arguments-differ
    def forward(ctx, x, dt, A, B, C, D, z, forest, chunk_size, functions, scan_kwargs):
        scan_forward, ctx.scan_backward = functions
        ctx.chunk_size, ctx.scan_kwargs = chunk_size, scan_kwargs
        ctx.joint_grads = _channels_of(x, B, C) is not None
        plan = TreeScanPlan.of(forest)
        ctx.fork, fork_saved = None, ()
        if plan.internal:
            # pylint: disable-next=import-outside-toplevel
            from megatron.shared_prefix.ssm.triton_inherited_state import ForkedStates

            ctx.fork = ForkedStates.of(forest, plan)
            with _fork_stream(x.device):
                cum, *fork_saved = ctx.fork.states(x[0], dt[0], A, B[0], C.dtype)
        y, y_ungated = scan_forward(
            x, dt, A, B, C, chunk_size, D=D, z=z, seq_idx=plan.seq_idx, **scan_kwargs
        )[:2]
        if ctx.fork is not None:
            _join_fork_stream(x.device)
            ctx.fork.correct(y[0], None if z is None else z[0], C[0], cum, fork_saved[0])
        ctx.save_for_backward(x, dt, A, B, C, D, z, plan.seq_idx, y_ungated, *fork_saved)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):  # pylint: disable=arguments-differ
        x, dt, A, B, C, D, z, seq_idx, y_ungated, *fork_saved = ctx.saved_tensors
        z0 = None if z is None else z[0]
        if ctx.fork is not None:
            with _fork_stream(x.device):
                fork_states = ctx.fork.backward_states(
                    grad_y[0], fork_saved, z0, dt[0], A, C[0], B.dtype
                )
        buffers = _joint_channel_grads(x, B, C) if ctx.joint_grads else {}
        # The output argument: with z, the ungated output; without, only its shape (x's) is read.
        grad_x, grad_dt, grad_A, grad_B, grad_C, grad_D, grad_z, *_ = ctx.scan_backward(
            grad_y,
            x,
            dt,
            A,
            B,
            C,
            x if z is None else y_ungated,
            ctx.chunk_size,
            D=D,
            z=z,
            seq_idx=seq_idx,
            **buffers,
            **ctx.scan_kwargs,
        )
        if ctx.fork is not None:
            _join_fork_stream(x.device)
            fork_grad_A = ctx.fork.backward_tokens(
                grad_y[0],
                fork_saved,
                fork_states,
                x[0],
                z0,
                dt[0],
                A,
                B[0],
                C[0],
                grad_x=grad_x[0],
                grad_dt=grad_dt[0],
                grad_B=grad_B[0],
                grad_C=grad_C[0],
                grad_z=None if z is None else grad_z[0],
            )
            grad_A = grad_A + fork_grad_A.to(grad_A.dtype)
        return grad_x, grad_dt, grad_A, grad_B, grad_C, grad_D, grad_z, None, None, None, None


def split_channels(xBC: torch.Tensor, heads: int, head_dim: int, groups: int, state_dim: int):
    """xBC [1, T, h*p + 2*g*n] -> views (x [1, T, h, p], B [1, T, g, n], C [1, T, g, n]) of its
    channels, in that order: no copies when xBC's channels are contiguous (mamba_ssm's kernels
    read rows of any stride whose channels are), else one. The gradient of xBC is the one buffer
    that the tree scan writes the three gradients into when it can (``_ForkedChunkScan``), else
    their concatenation."""
    if xBC.dim() == 3 and xBC.stride(-1) != 1:
        xBC = xBC.contiguous()  # PyTorch's conv1d gives [1, T, channels] with strided channels
    return _SplitChannels.apply(xBC, heads, head_dim, groups, state_dim)


class _SplitChannels(torch.autograd.Function):  # pylint: disable=abstract-method
    """:func:`split_channels` (torch's split would concatenate the gradients in every case)."""

    @staticmethod
    # pylint: disable-next=arguments-differ
    def forward(ctx, xBC, heads, head_dim, groups, state_dim):
        width = heads * head_dim + 2 * groups * state_dim
        if xBC.dim() != 3 or xBC.shape[0] != 1 or xBC.shape[-1] != width:
            raise ValueError(
                f"split_channels expects [1, T, {width}] (h={heads}, p={head_dim}, g={groups}, "
                f"n={state_dim}), got {tuple(xBC.shape)}"
            )
        return _channel_views(xBC, heads, head_dim, groups, state_dim)

    @staticmethod
    def backward(ctx, grad_x, grad_B, grad_C):  # pylint: disable=arguments-differ
        whole = _channels_of(grad_x, grad_B, grad_C)
        if whole is None:
            whole = torch.cat([grad.flatten(2) for grad in (grad_x, grad_B, grad_C)], dim=-1)
        return whole, None, None, None, None


def _channel_views(xBC, heads, head_dim, groups, state_dim):
    x, B, C = xBC.split([heads * head_dim, groups * state_dim, groups * state_dim], dim=-1)
    return (
        x.unflatten(-1, (heads, head_dim)),
        B.unflatten(-1, (groups, state_dim)),
        C.unflatten(-1, (groups, state_dim)),
    )


def _channels_of(x, B, C) -> Optional[torch.Tensor]:
    """The [1, T, h*p + 2*g*n] tensor whose adjacent channel views x [1, T, h, p], B and C
    [1, T, g, n] are (as :func:`split_channels` makes them), with channels contiguous; None when
    they are not such views (separate tensors, other strides, a gap or another order)."""
    if x is None or B is None or C is None:
        return None
    _, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    x_width, bc_width = heads * head_dim, groups * state_dim
    width = x_width + 2 * bc_width
    views = (
        (x, (width, head_dim, 1), 0),
        (B, (width, state_dim, 1), x_width),
        (C, (width, state_dim, 1), x_width + bc_width),
    )
    storage = x.untyped_storage().data_ptr()
    start = x.storage_offset()
    for view, strides, channel in views:
        if (
            view.dtype != x.dtype
            or view.device != x.device
            or view.untyped_storage().data_ptr() != storage
            or view.storage_offset() != start + channel
            or (length > 1 and view.stride()[1:] != strides)
            or (length == 1 and view.stride()[2:] != strides[1:])
        ):
            return None
    return x.as_strided((1, length, width), (length * width, width, 1), start)


def _joint_channel_grads(x, B, C) -> dict:
    """mamba_ssm's dx, dB and dC gradient buffers as the adjacent channel views of one new
    [1, T, h*p + 2*g*n] tensor: what :func:`split_channels`' backward passes on whole."""
    _, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    whole = torch.empty(
        (1, length, heads * head_dim + 2 * groups * state_dim), dtype=x.dtype, device=x.device
    )
    dx, dB, dC = _channel_views(whole, heads, head_dim, groups, state_dim)
    return {"dx": dx, "dB": dB, "dC": dC}


_FORK_STREAMS: dict = {}


@contextlib.contextmanager
def _fork_stream(device: torch.device):
    """Run the block on the device's fork stream, after all work queued so far on the current
    stream: the forked states' work that reads no output of the packed scan (the end states in the
    forward, their gradients in the backward) then runs next to mamba_ssm's kernels, filling the
    GPU where those leave it idle (their state passing runs one program per head and dim block).

    Memory: the block's tensors are allocated on the fork stream. Each one that the current stream
    reads afterwards (after :func:`_join_fork_stream`) may be freed there while a kernel reading it
    is still queued; the allocator may then hand it to a later allocation on the fork stream, but
    every later use of the fork stream starts here, after the current stream's queued work, so no
    kernel writes it before those reads are done.

    Off CUDA (the kernels under Triton's interpreter, in the tests) the block runs as it is.
    """
    if device.type != "cuda":
        yield
        return
    main = torch.cuda.current_stream(device)
    stream = _FORK_STREAMS.get(device)
    if stream is None:
        stream = _FORK_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        yield


def _join_fork_stream(device: torch.device) -> None:
    """Make the current stream wait for the work queued on the device's fork stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).wait_stream(_FORK_STREAMS[device])


def packed_chunk_scan(backend: str, device: torch.device):
    """The packed scan that ``backend`` ("auto", "torch", "triton") selects on ``device``."""
    if backend not in TREE_SCAN_BACKENDS:
        raise ValueError(f"backend must be one of {TREE_SCAN_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return torch_ssd.mamba_chunk_scan_combined
    triton_scan = triton_chunk_scan()
    if backend == "triton":
        if triton_scan is None or device.type != "cuda":
            raise ValueError(
                "backend='triton' needs CUDA tensors and mamba_ssm's Triton kernels "
                f"(device {device}, mamba_ssm {'importable' if triton_scan else 'not importable'})"
            )
        return triton_scan
    return (
        triton_scan
        if triton_scan is not None and device.type == "cuda"
        else torch_ssd.mamba_chunk_scan_combined
    )


@dataclasses.dataclass(frozen=True)
class TreeScanPlan:
    """Index tables of one forest for :func:`tree_ssd_scan` (built once per forest, cached on it).

    Attributes:
        seq_idx: [1, T] int32 segment id of each token (the packed scan's sequence boundaries).
        internal: per internal segment (one with children), in increasing segment index (parents
            first): (segment, first token, end token (exclusive), slot of its parent among the
            internal segments or -1 for a root).
        child_tokens: per internal segment, [K_p] int64 packed indices of its children's tokens.
        host_child_tokens: the same on the host (numpy), for tables built from them.
        all_child_tokens: [sum K_p] the concatenation (distinct indices: every token of a non-root
            segment, once).
        segment_first: [S] int64 first token of each segment; segment_last: [S] its last token.
        slot_segment, slot_parent: [internal] int64 device copies of ``internal``'s segment and
            parent slot (the Triton state chain's tables).
        segment_chain_slot: [S] int64 the slot of each internal segment that has a parent, -1
            for every other segment (where the Triton segment walk's backward finds a segment's
            part of the chain's gradient).
        chain_parent_row: [internal] int64 the row of each internal segment that is the parent
            of another internal segment among those (in slot order), -1 for the others: the
            chain's backward reads the float32 end states of those alone.
        num_chain_parents: how many rows ``chain_parent_row`` numbers.
    """

    seq_idx: torch.Tensor
    internal: tuple[tuple[int, int, int, int], ...]
    child_tokens: tuple[torch.Tensor, ...]
    host_child_tokens: tuple[np.ndarray, ...]
    all_child_tokens: torch.Tensor
    segment_first: torch.Tensor
    segment_last: torch.Tensor
    slot_segment: torch.Tensor
    slot_parent: torch.Tensor
    segment_chain_slot: torch.Tensor
    chain_parent_row: torch.Tensor
    num_chain_parents: int

    @classmethod
    def of(cls, forest: ForestTensors) -> "TreeScanPlan":
        """The plan of ``forest``, cached on it."""
        return forest.derive("tree_scan_plan", lambda: cls._build(forest))

    @classmethod
    def _build(cls, forest: ForestTensors) -> "TreeScanPlan":
        layout = forest.layout
        starts, lengths, parents = (
            layout.segment_starts,
            layout.segment_lengths,
            layout.segment_parents,
        )
        internal_segments = np.unique(parents[parents >= 0])
        slot_of = {int(segment): slot for slot, segment in enumerate(internal_segments)}
        internal = tuple(
            (
                int(segment),
                int(starts[segment]),
                int(starts[segment] + lengths[segment]),
                slot_of.get(int(parents[segment]), -1),
            )
            for segment in internal_segments
        )
        token_parent = parents[layout.token_segment]  # parent segment of each token's segment
        order = np.argsort(token_parent, kind="stable")
        bounds = np.searchsorted(token_parent[order], internal_segments, side="left")
        ends = np.searchsorted(token_parent[order], internal_segments, side="right")

        segment_chain_slot = np.full(len(starts), -1, dtype=np.int64)
        for slot, (segment, _, _, parent_slot) in enumerate(internal):
            if parent_slot >= 0:
                segment_chain_slot[segment] = slot
        chain_parents = sorted({parent_slot for *_, parent_slot in internal if parent_slot >= 0})
        chain_parent_row = np.full(len(internal), -1, dtype=np.int64)
        chain_parent_row[chain_parents] = np.arange(len(chain_parents))
        host_child_tokens = tuple(order[b:e] for b, e in zip(bounds, ends))
        all_children = order[bounds[0] :] if len(internal_segments) else order[:0]
        tables = [
            all_children,
            starts,
            starts + lengths - 1,
            [segment for segment, *_ in internal],
            [parent_slot for *_, parent_slot in internal],
            segment_chain_slot,
            chain_parent_row,
            *host_child_tokens,
        ]
        # One transfer from the host for all of them (tensors.hosts_to_device).
        (all_child_tokens, first, last, slot_segment, slot_parent, chain_slot, parent_row,
         *child_tokens) = hosts_to_device(
            [np.asarray(table, dtype=np.int64) for table in tables], forest.device
        )  # fmt: skip
        return cls(
            seq_idx=forest.token_segment.to(torch.int32).unsqueeze(0).contiguous(),
            internal=internal,
            child_tokens=tuple(child_tokens),
            host_child_tokens=host_child_tokens,
            all_child_tokens=all_child_tokens,
            segment_first=first,
            segment_last=last,
            slot_segment=slot_segment,
            slot_parent=slot_parent,
            segment_chain_slot=chain_slot,
            chain_parent_row=parent_row,
            num_chain_parents=len(chain_parents),
        )


def prepare_tree_scan(forest: ForestTensors) -> None:
    """Build and cache what ``tree_ssd_scan`` reads of ``forest``, the forked states' Triton
    tables included where Triton imports (a ``ForestTable`` build)."""
    plan = TreeScanPlan.of(forest)
    if not plan.internal:
        return
    try:
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.ssm.triton_inherited_state import ForkedStates
    except ImportError:  # no Triton: the fork runs in torch, from the plan alone
        return
    ForkedStates.of(forest, plan)


def _compute_dtype(*tensors):
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """mamba_ssm's step size: ``clamp(softplus?(dt + dt_bias), *dt_limit)`` (softplus is the
    identity above 20, as ``F.softplus``). After the softplus, which is never negative, the default
    limit (0, inf) is no clamp, and none runs: each op is an autograd node and a kernel forward
    and backward."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
        if tuple(dt_limit) == _NO_DT_LIMIT:
            return dt
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _per_token(values: torch.Tensor, plan: TreeScanPlan, length: int) -> torch.Tensor:
    """[T, h] holding ``values[s]`` ([S, h], float64) on every token of segment s.

    Built as the cumulative sum of the steps between consecutive segments' values, placed at the
    segment starts, rather than as ``values[token_segment]``: the backward of that gather would add
    every token's gradient into its segment's row through atomics on CUDA (run-to-run bit changes,
    heavy contention); this one's backward is a reverse cumulative sum and a gather at distinct
    indices. Rounding: float64 sums of at most S steps, far below float32 resolution.
    """
    steps = torch.diff(values, dim=0, prepend=values.new_zeros(1, values.shape[1]))
    return cumsum_over_tokens(
        values.new_zeros(length, values.shape[1]).index_put((plan.segment_first,), steps)
    )


def tree_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    forest: ForestTensors,
    *,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_DT_LIMIT,
    backend: str = "auto",
    scan_kwargs: Optional[dict] = None,
) -> torch.Tensor:
    """Mamba-2 selective scan of a packed forest row; every token sees its root path's state.

    Arguments follow mamba_ssm's ``mamba_chunk_scan_combined`` for one row: x [1, T, h, p], dt
    [1, T, h], A [h], B and C [1, T, g, n] (head i reads group i // (h // g)), D [h] or [h, p], z
    [1, T, h, p] (output gate ``silu(z)``), dt_bias [h], dt_softplus, dt_limit; T is
    ``forest.num_tokens``.

    Args:
        chunk_size: chunk size of the packed scan.
        forest: the row's metadata.
        backend: "torch" (torch_ssd, any device), "triton" (mamba_ssm, CUDA) or "auto" (triton for
            CUDA tensors when mamba_ssm imports, torch otherwise).
        scan_kwargs: extra keyword arguments for the packed scan (e.g. mamba_ssm's ``state_dtype``).

    Returns:
        y [1, T, h, p] in x's dtype: for every token, the output its original sequences give it.
        dt is processed once here (bias, softplus, clamp; float32, or float64 for float64 inputs)
        and the packed scan gets the processed dt, so it and the correction use the same steps. The
        correction and the forked states are float32 (float64 for float64 inputs), whatever
        x's dtype.
    """
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] != forest.num_tokens:
        raise ValueError(
            f"tree_ssd_scan expects x of shape [1, T={forest.num_tokens}, h, p], "
            f"got {tuple(x.shape)}"
        )
    _, length, heads, _ = x.shape
    groups, state_dim = B.shape[-2:]
    if tuple(dt.shape) != (1, length, heads) or tuple(A.shape) != (heads,):
        raise ValueError(
            f"dt must be [1, {length}, {heads}] and A [{heads}], "
            f"got {tuple(dt.shape)}, {tuple(A.shape)}"
        )
    if tuple(B.shape) != (1, length, groups, state_dim) or C.shape != B.shape or heads % groups:
        raise ValueError(
            f"B and C must be [1, {length}, g, n] with g dividing {heads}, "
            f"got {tuple(B.shape)}, {tuple(C.shape)}"
        )
    mamba_chunk_scan_combined = packed_chunk_scan(backend, x.device)  # torch_ssd's or mamba_ssm's
    plan = TreeScanPlan.of(forest)
    compute = _compute_dtype(x, dt, A, B, C, D, z, dt_bias)
    # With a bias in the compute dtype, its add converts dt (the values of a conversion first).
    dt = process_dt(
        dt.to(compute) if dt_bias is None else dt,
        None if dt_bias is None else dt_bias.to(compute),
        dt_softplus,
        dt_limit,
    )

    # y0: zero initial state at every segment start (seq_idx changes there), D skip and gate fused.
    scan_kwargs = scan_kwargs or {}
    functions = scan_functions(mamba_chunk_scan_combined, scan_kwargs)
    if functions is not None and compute == torch.float32:
        from megatron.shared_prefix.ssm import (  # pylint: disable=import-outside-toplevel
            triton_inherited_state,
        )

        if triton_inherited_state.supported(*(t for t in (x, B, C, z) if t is not None)):
            return _ForkedChunkScan.apply(
                x, dt, A, B, C, D, z, forest, chunk_size, functions, scan_kwargs
            )
    y = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, seq_idx=plan.seq_idx, dt_softplus=False, **scan_kwargs
    )
    if not plan.internal:
        return y
    return _torch_correction(
        x[0], B[0], C[0], y[0], None if z is None else z[0], dt[0], A, forest
    ).unsqueeze(0)


def _torch_correction(x, B, C, y, z, dt, A, forest):
    """(2) and (1) in plain torch: the CPU path and the oracle of the Triton kernels
    (``_ForkedChunkScan``).

    x, y, z [T, h, p] (z may be None), B, C [T, g, n], dt [T, h] (processed, compute dtype), A [h];
    returns [T, h, p] in y's dtype.
    """
    plan = TreeScanPlan.of(forest)
    compute = dt.dtype
    length, heads, head_dim = x.shape
    groups = B.shape[1]
    # Segmented cumulative log-decay: float64 prefix sums, differences taken in float64 (no
    # cancellation), then the compute dtype. cum[t] = sum over t's segment up to t; to_end[t] = sum
    # over (t, end of t's segment] (<= 0).
    log_decay = dt.double() * A.double()  # [T, h]
    prefix = cumsum_over_tokens(log_decay)
    before_segment = F.pad(prefix, (0, 0, 1, 0))[plan.segment_first]  # [S, h] sum before segment
    segment_end = prefix[plan.segment_last]  # [S, h]
    cum = (prefix - _per_token(before_segment, plan, length)).to(compute)  # [T, h]
    to_end = (_per_token(segment_end, plan, length) - prefix).to(compute)  # [T, h]
    cum_end = (segment_end - before_segment).to(compute)  # [S, h]
    # Weight of token u's input in its segment's end state, (2): exp(cum_end - cum_u) * dt_u.
    input_weight = torch.exp(to_end) * dt  # [T, h]

    per_group = heads // groups
    ends = []
    for segment, first, end, parent_slot in plan.internal:
        # (2): this segment's own contribution, then the inherited state decayed over the segment.
        weighted_x = x[first:end].to(compute) * input_weight[first:end, :, None]
        weighted_x = weighted_x.reshape(end - first, groups, per_group, head_dim)
        state = torch.einsum("lgrp,lgn->grpn", weighted_x, B[first:end].to(compute))
        if parent_slot >= 0:
            decay = torch.exp(cum_end[segment]).view(groups, per_group, 1, 1)
            state = state + decay * ends[parent_slot]
        ends.append(state)
    # (1) for every child token, gated like y when z is given.
    return _InheritedStateOutput.apply(y, z, C, cum, plan.child_tokens, *ends)


class _InheritedStateOutput(torch.autograd.Function):  # pylint: disable=abstract-method
    """``y`` with ``gate_t * exp(cum_t) * (C_t . state(parent))`` added at every child token t, (1).

    Inputs: y [T, h, p] (the packed scan's output), z [T, h, p] or None (gate silu(z)), C [T, g, n],
    cum [T, h] (compute dtype), child_tokens (per internal segment, the tokens of its children;
    disjoint), then one end state [g, h / g, p, n] (compute dtype) per internal segment.

    A custom function so that nothing of size [children, h, p] is kept for backward: autograd
    through the same expression would save the product C . state, the decayed correction and the
    gate, each a float32 tensor as large as the layer's output; here backward recomputes C . state
    per parent from C and the small states. Every child token is written exactly once (the sets are
    disjoint), so forward and backward are plain gathers and writes, with no accumulation whose
    order could vary.
    """

    @staticmethod
    def forward(ctx, y, z, C, cum, child_tokens, *states):  # pylint: disable=arguments-differ
        compute = cum.dtype
        out = y.clone()
        for children, state in zip(child_tokens, states):
            correction = _inherited(C[children].to(compute), state) * torch.exp(
                cum[children]
            ).unsqueeze(-1)
            if z is not None:
                correction = correction * F.silu(z[children].to(compute))
            out[children] = (y[children].to(compute) + correction).to(out.dtype)
        ctx.child_tokens = child_tokens
        ctx.save_for_backward(z, C, cum, *states)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # pylint: disable=arguments-differ
        z, C, cum, *states = ctx.saved_tensors
        compute = cum.dtype
        need_z, need_C, need_cum = ctx.needs_input_grad[1:4]
        grad_z = None if z is None or not need_z else torch.zeros_like(z)
        grad_C = torch.zeros_like(C) if need_C else None
        grad_cum = torch.zeros_like(cum) if need_cum else None
        grad_states = []
        for children, state in zip(ctx.child_tokens, states):
            grad = grad_out[children].to(compute)  # [k, h, p]
            C_k = C[children].to(compute)
            decay = torch.exp(cum[children]).unsqueeze(-1)  # [k, h, 1]
            inherited = _inherited(C_k, state)  # [k, h, p], recomputed
            if z is not None:
                z_k = z[children].to(compute)
                sigmoid = torch.sigmoid(z_k)
                if grad_z is not None:
                    d_silu = sigmoid * (1 + z_k * (1 - sigmoid))
                    grad_z[children] = (grad * inherited * decay * d_silu).to(z.dtype)
                grad = grad * (z_k * sigmoid)
            if grad_cum is not None:
                grad_cum[children] = (grad * inherited).sum(-1) * decay.squeeze(-1)
            grad = (grad * decay).view(len(children), *state.shape[:3])  # [k, g, r, p]
            if grad_C is not None:
                grad_C[children] = torch.einsum("kgrp,grpn->kgn", grad, state).to(C.dtype)
            grad_states.append(torch.einsum("kgrp,kgn->grpn", grad, C_k))
        return (grad_out, grad_z, grad_C, grad_cum, None, *grad_states)


def _inherited(C_k: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """[k, h, p] = C_k . state per head: C_k [k, g, n], state [g, h / g, p, n]."""
    return torch.einsum("kgn,grpn->kgrp", C_k, state).flatten(1, 2)
