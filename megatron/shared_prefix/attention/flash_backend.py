"""Tree attention on flash attention: one varlen pass per ancestor depth, merged by log-sum-exp.

A token attends the tokens before it in its own segment and every token of its segment's
ancestors. In DFS order a segment's descendants are one contiguous range of tokens, right after
the segment, and the segment's tokens are one range too. So the row's attention is a few flash
calls:

* the segment pass: every segment against itself, causal, one varlen call whose sequences are the
  segments (what packed dense attention runs);
* one ancestor pass per depth ``d`` of the forest below its deepest level: for every segment at
  depth ``d`` that has descendants, those descendants' tokens (queries) against the segment's
  tokens (keys), not causal, as one varlen call. A token at depth ``D`` takes part in the passes of
  depths ``0 .. D - 1``, once for each of its ancestors.

A GRPO batch (a prompt, then its completions: a star) needs the segment pass and one ancestor
pass; packed dense rows (roots only) the segment pass alone. The partial results of a token merge
by their log-sum-exps: with ``l = logaddexp(l1, l2)``, ``o = o1 exp(l1 - l) + o2 exp(l2 - l)``,
accumulated in float32 and rounded once. Backward: flash's backward of a pass, handed the merged
output and log-sum-exp, computes that pass's share of dq, dk and dv of the whole softmax (its
probabilities ``exp(s - l)`` are the whole row's, and so is ``rowsum(do * o)``); autograd through
the separate calls would differentiate each pass's own normalization instead. The shares add up in
float32. torch's flash backward is deterministic only under ``torch.use_deterministic_algorithms``,
which the backward turns on for its calls. Off CUDA the passes run as plain torch math (the same
decomposition, for tests).

On an H200 (torch 2.11, FlashAttention 2) this took 2.4-3.3x flex_backend's time on every row of
tools/bench_attention.py, most of it in the deterministic backward (docs/benchmarks.md), so
``tree_backend="auto"`` never picks it.
"""

import contextlib
import dataclasses
from typing import Optional

import numpy as np
import torch

from megatron.shared_prefix.tensors import ForestTensors, host_to_device

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class FlashPass:
    """One varlen call: query sequences ``query_bounds[i]:query_bounds[i + 1]`` of the gathered
    queries against key sequences ``key_bounds[i]:key_bounds[i + 1]`` of the gathered keys.

    Attributes:
        query_index: [Q] packed token of each query row, None for the whole row in order.
        key_index: [K] packed token of each key row, None for the whole row in order.
        query_bounds, key_bounds: [N + 1] int32 cumulative lengths, on the forest's device.
        host_query_bounds, host_key_bounds: the same on the host.
        max_query, max_key: longest query and key sequence.
        causal: whether query ``j`` of a sequence sees only keys ``<= j`` (equal lengths here).
    """

    query_index: Optional[torch.Tensor]
    key_index: Optional[torch.Tensor]
    query_bounds: torch.Tensor
    key_bounds: torch.Tensor
    host_query_bounds: np.ndarray
    host_key_bounds: np.ndarray
    max_query: int
    max_key: int
    causal: bool


@dataclasses.dataclass(frozen=True)
class FlashPasses:
    """The passes of a row (``flash_passes``): the segment pass, then one per ancestor depth."""

    segments: FlashPass
    ancestors: tuple[FlashPass, ...]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of the ranges ``[starts[i], ends[i])`` in order, [N + 1] int32 cumulative lengths)."""
    lengths = ends - starts
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = np.repeat(starts - bounds[:-1], lengths) + np.arange(bounds[-1])
    return tokens.astype(np.int64), bounds


def flash_passes(forest: ForestTensors) -> FlashPasses:
    """The passes of ``forest``'s row, built on the host from the layout once per row (cached on
    the forest)."""

    def build():
        layout = forest.layout
        starts, depth = layout.segment_starts, layout.segment_depth
        ends = starts + layout.segment_lengths
        subtree_ends = forest.host_subtree_end()[starts]
        device = forest.device

        def flash_pass(query_tokens, query_bounds, key_tokens, key_bounds, causal):
            return FlashPass(
                query_index=None if query_tokens is None else host_to_device(query_tokens, device),
                key_index=None if key_tokens is None else host_to_device(key_tokens, device),
                query_bounds=host_to_device(query_bounds, device),
                key_bounds=host_to_device(key_bounds, device),
                host_query_bounds=query_bounds,
                host_key_bounds=key_bounds,
                max_query=int(np.diff(query_bounds).max()),
                max_key=int(np.diff(key_bounds).max()),
                causal=causal,
            )

        segment_bounds = np.append(starts, forest.num_tokens).astype(np.int32)
        ancestors = []
        for level in range(int(depth.max(initial=0))):
            above = np.flatnonzero((depth == level) & (subtree_ends > ends))
            query_tokens, query_bounds = _ranges(ends[above], subtree_ends[above])
            key_tokens, key_bounds = _ranges(starts[above], ends[above])
            ancestors.append(
                flash_pass(query_tokens, query_bounds, key_tokens, key_bounds, causal=False)
            )
        segments = flash_pass(None, segment_bounds, None, segment_bounds, causal=True)
        return FlashPasses(segments, tuple(ancestors))

    return forest.derive(("flash_passes",), build)


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the flash passes run rows of queries on ``device`` in ``dtype``: on CUDA, in a
    flash dtype, with a head dimension flash attention takes (a multiple of 8, at most 256)."""
    return (
        torch.device(device).type == "cuda"
        and dtype in FLASH_DTYPES
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def _math_forward(q, k, v, flash_pass: FlashPass, scale: float):
    """Pass forward in plain torch: ([Q, H, D] output, [H, Q] log-sum-exp; float32, float64 for
    float64 inputs)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    repeat = q.shape[1] // k.shape[1]
    outputs, lses = [], []
    for i in range(len(flash_pass.host_query_bounds) - 1):
        qs = slice(*map(int, flash_pass.host_query_bounds[i : i + 2]))
        ks = slice(*map(int, flash_pass.host_key_bounds[i : i + 2]))
        scores = _scores(q[qs], k[ks], repeat, scale, flash_pass.causal, compute)
        lse = torch.logsumexp(scores, dim=-1)  # [H, q]
        probs = torch.exp(scores - lse[..., None])
        values = v[ks].to(compute).repeat_interleave(repeat, dim=1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype))
        lses.append(lse)
    return torch.cat(outputs), torch.cat(lses, dim=1)


def _scores(q, k, repeat, scale, causal, compute):
    """[H, q, k] scaled scores of one sequence of a pass, -inf above the diagonal when causal."""
    keys = k.to(compute).repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), keys) * scale
    if causal:
        visible = torch.ones(scores.shape[1:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _math_backward(grad, q, k, v, out, lse, flash_pass: FlashPass, scale: float):
    """Pass backward in plain torch, given the merged output and log-sum-exp (flash's formulas)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    repeat = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=compute, device=t.device) for t in (q, k, v))
    for i in range(len(flash_pass.host_query_bounds) - 1):
        qs = slice(*map(int, flash_pass.host_query_bounds[i : i + 2]))
        ks = slice(*map(int, flash_pass.host_key_bounds[i : i + 2]))
        scores = _scores(q[qs], k[ks], repeat, scale, flash_pass.causal, compute)
        probs = torch.exp(scores - lse[:, qs, None].to(compute))  # [H, q, k]
        g = grad[qs].to(compute)
        values = v[ks].to(compute).repeat_interleave(repeat, dim=1)
        row_dot = (g * out[qs].to(compute)).sum(-1).transpose(0, 1)  # [H, q]
        dscores = probs * (torch.einsum("qhd,khd->hqk", g, values) - row_dot[..., None])
        keys = k[ks].to(compute).repeat_interleave(repeat, dim=1)
        dq[qs] = torch.einsum("hqk,khd->qhd", dscores, keys) * scale
        grouped = (-1, k.shape[1], repeat, k.shape[2])
        dk[ks] = (
            (torch.einsum("hqk,qhd->khd", dscores, q[qs].to(compute)) * scale)
            .reshape(grouped)
            .sum(2)
        )
        dv[ks] = torch.einsum("hqk,qhd->khd", probs, g).reshape(grouped).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _pass_forward(q, k, v, flash_pass: FlashPass, scale: float):
    """One pass: ([Q, H, D] output, [H, Q] float32 log-sum-exp), flash's varlen call on CUDA."""
    if not q.is_cuda:
        return _math_forward(q, k, v, flash_pass, scale)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        flash_pass.query_bounds,
        flash_pass.key_bounds,
        flash_pass.max_query,
        flash_pass.max_key,
        0.0,
        flash_pass.causal,
        False,
        scale=scale,
    )
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"flash attention returned a log-sum-exp of shape {tuple(lse.shape)}, not the "
            f"[heads, tokens] = {(q.shape[1], q.shape[0])} of its varlen form"
        )
    return out, lse


@contextlib.contextmanager
def _deterministic():
    """torch.use_deterministic_algorithms(True) inside, the caller's setting restored after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _pass_backward(grad, q, k, v, out, lse, flash_pass: FlashPass, scale: float):
    """One pass's share (dq, dk, dv) of the gradient, given the merged ``out`` and ``lse``."""
    if not q.is_cuda:
        return _math_backward(grad, q, k, v, out, lse, flash_pass, scale)
    no_dropout_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    with _deterministic():
        return torch.ops.aten._flash_attention_backward(
            grad,
            q,
            k,
            v,
            out,
            lse,
            flash_pass.query_bounds,
            flash_pass.key_bounds,
            flash_pass.max_query,
            flash_pass.max_key,
            0.0,
            flash_pass.causal,
            no_dropout_state,
            torch.empty(0, device=q.device),
            scale=scale,
        )


class _TreeAttention(torch.autograd.Function):
    """[T, H, D] queries, [T, G, D] keys and values -> [T, H, D] (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, passes: FlashPasses, scale: float):
        out, lse = _pass_forward(q, k, v, passes.segments, scale)
        if passes.ancestors:
            # float32 (float64 for float64 inputs), rounded once; merged and lse are this
            # forward's own tensors, updated in place level by level (no copy of the row per level).
            merged = out.to(lse.dtype)
            for ancestor in passes.ancestors:
                rows = ancestor.query_index
                part_out, part_lse = _pass_forward(
                    q.index_select(0, rows),
                    k.index_select(0, ancestor.key_index),
                    v.index_select(0, ancestor.key_index),
                    ancestor,
                    scale,
                )
                row_lse = lse.index_select(1, rows)
                new_lse = torch.logaddexp(row_lse, part_lse)
                kept, added = (
                    torch.exp(part - new_lse).t()[..., None] for part in (row_lse, part_lse)
                )
                row_out = merged.index_select(0, rows) * kept + part_out.to(lse.dtype) * added
                merged[rows] = row_out
                lse[:, rows] = new_lse
            out = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.passes, ctx.scale = passes, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        passes, scale = ctx.passes, ctx.scale
        grad = grad.contiguous()
        dq, dk, dv = _pass_backward(grad, q, k, v, out, lse, passes.segments, scale)
        if passes.ancestors:
            accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
            dq, dk, dv = (t.to(accumulate) for t in (dq, dk, dv))  # fresh: added to in place
            for ancestor in passes.ancestors:
                rows, keys = ancestor.query_index, ancestor.key_index
                part_dq, part_dk, part_dv = _pass_backward(
                    grad.index_select(0, rows),
                    q.index_select(0, rows),
                    k.index_select(0, keys),
                    v.index_select(0, keys),
                    out.index_select(0, rows),
                    lse.index_select(1, rows).contiguous(),
                    ancestor,
                    scale,
                )
                dq[rows] += part_dq.to(accumulate)
                dk[keys] += part_dk.to(accumulate)
                dv[keys] += part_dv.to(accumulate)
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv, None, None


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    forest: ForestTensors,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of every packed token over its root path.

    Args:
        query: [T, 1, H, D].
        key, value: [T, 1, G, D] with G dividing H (query head h reads group h // (H // G)).
        forest: the row's metadata; T must equal ``forest.num_tokens``.
        softmax_scale: multiplier of q.k before the softmax.

    Returns:
        [T, 1, H * D] context in the query's dtype.
    """
    num_tokens, batch, num_heads, head_dim = query.shape
    if batch != 1 or num_tokens != forest.num_tokens:
        raise ValueError(
            f"tree attention expects [T={forest.num_tokens}, 1, H, D] queries for this forest, "
            f"got {tuple(query.shape)}"
        )
    q, k, v = (tensor[:, 0].contiguous() for tensor in (query, key, value))
    out = _TreeAttention.apply(q, k, v, flash_passes(forest), softmax_scale)
    return out.reshape(num_tokens, 1, num_heads * head_dim)
