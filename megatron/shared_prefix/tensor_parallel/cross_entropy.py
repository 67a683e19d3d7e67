"""Cross entropy of loss edges over vocab-parallel logits (upstream:
megatron/core/tensor_parallel/cross_entropy.py).

Under tensor parallelism the output layer gives each rank the logits of its ``V / tp`` vocabulary
entries. A loss edge needs the log-normalizer of its source (a sum over the whole vocabulary) and
the logit of its target (held by one rank), so both are reduced over the tensor-parallel group and
no rank materializes full-vocabulary logits. Several edges share a source (a branch point predicts
the first token of every child), so the normalizer is computed once per distinct source.
"""

import torch
import torch.distributed as dist
from torch import Tensor

# Rows of [U, V / tp] logits turned into float32 at a time by the PyTorch path (256 MiB).
FLOAT32_CHUNK_ELEMENTS = 1 << 26


class _EdgeCrossEntropy(torch.autograd.Function):  # pylint: disable=abstract-method
    """``-log softmax(logits[slot])[target]`` per edge, in float32, over this rank's vocabulary
    shard, keeping for backward only the input logits and one float32 log-normalizer per source.

    Autograd through ``logits.float()`` and ``logsumexp`` keeps a float32 copy of the [U, V] logits
    and builds the float32 gradient of each step in full (the softmax term, the target term, their
    sum, then the cast back), several times the logits' size. A forest row concentrates the edges of
    every sequence through it on few tokens (a GRPO star's row holds all its completions), so that
    cost, which scales with edges, not tokens, set the row's peak memory on an H200
    (docs/benchmarks.md). Here float32 work runs in chunks of ``FLOAT32_CHUNK_ELEMENTS`` rows'
    worth, and the gradient is written once, in the logits' dtype: into the logits' own storage
    with ``overwrite``, which the output layer's backward no longer needs (megatron-core's
    vocab-parallel cross entropy reuses its input the same way), so no second [U, V] tensor exists.
    On CUDA the float32 work runs in Triton kernels instead (triton_cross_entropy.py: one program
    per source row, no float32 copy of the logits at all); the PyTorch path here runs on CPU and is
    what they are tested against.

    Under tensor parallelism (``group`` of size > 1) the forward all-reduces each source's maximum,
    its sum of exponentials and the target logits (held by the rank whose shard has the target);
    the backward needs no communication: each rank's gradient is that of its shard.

    Backward: ``grad_logits[u] = softmax(logits[u]) * sum_{e: slot e = u} grad_e``, minus
    ``grad_e`` at ``(slot_e, target_e)`` on the target's rank, both accumulated in float32 with
    ``index_put_`` (``accumulate=True``: sorted, deterministic, as autograd's backward of indexing)
    before one cast.
    """

    @staticmethod
    def forward(  # pylint: disable=arguments-differ
        ctx, logits, edge_source_slot, edge_target, group, overwrite
    ):
        rows = max(1, FLOAT32_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
        chunks = [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]
        fused = _triton_kernels(logits)
        if group is None or group.size() == 1:
            if fused is not None:
                shift = logits.amax(dim=-1).float()
                log_normalizer = fused.sum_exp(logits, shift).log_().add_(shift)
            else:
                log_normalizer = torch.empty(
                    logits.shape[0], dtype=torch.float32, device=logits.device
                )
                for chunk in chunks:
                    log_normalizer[chunk] = _log_sum_exp(logits[chunk])
            target, owned = edge_target, None
            target_logit = logits[edge_source_slot, target].float()
        else:
            # Shards' maxima are bf16/fp32 values: max commutes exactly with the cast.
            shift = logits.amax(dim=-1).float()
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            if fused is not None:
                sum_exp = fused.sum_exp(logits, shift)
            else:
                sum_exp = torch.empty_like(shift)
                for chunk in chunks:
                    values = logits[chunk].to(torch.float32, copy=True)  # the only temporary
                    sum_exp[chunk] = values.sub_(shift[chunk, None]).exp_().sum(dim=-1)
            dist.all_reduce(sum_exp, group=group)
            log_normalizer = sum_exp.log_().add_(shift)
            shard = logits.shape[-1]
            local = edge_target - group.rank() * shard
            owned = (local >= 0) & (local < shard)
            target = local.clamp(0, max(shard - 1, 0))
            target_logit = torch.where(owned, logits[edge_source_slot, target].float(), 0.0)
            dist.all_reduce(target_logit, group=group)
        ctx.rows, ctx.fused = rows, fused
        ctx.overwrite = overwrite
        ctx.save_for_backward(logits, edge_source_slot, target, owned, log_normalizer)
        return log_normalizer[edge_source_slot] - target_logit

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        logits, slot, target, owned, log_normalizer = ctx.saved_tensors
        grad = grad.float()
        num_sources = logits.shape[0]
        # Every edge's softmax term reaches every shard; its target term only the target's rank.
        source_grad = torch.zeros_like(log_normalizer).index_put_((slot,), grad, accumulate=True)
        target_grad = -grad if owned is None else torch.where(owned, -grad, 0.0)
        grad_logits = logits if ctx.overwrite else torch.empty_like(logits)
        if ctx.fused is not None:
            ctx.fused.softmax_grad(
                logits, log_normalizer, source_grad, slot, target, target_grad, out=grad_logits
            )
            return grad_logits, None, None, None, None
        for start in range(0, num_sources, ctx.rows):
            stop = min(start + ctx.rows, num_sources)
            # A copy even for float32 logits: the chunk is updated in place.
            chunk = logits[start:stop].to(torch.float32, copy=True)
            chunk.sub_(log_normalizer[start:stop, None]).exp_().mul_(source_grad[start:stop, None])
            # Edges of other chunks, and targets of other ranks, add 0 to a clamped row: x + 0 is x.
            here = (slot >= start) & (slot < stop)
            chunk.index_put_(
                ((slot - start).clamp(0, stop - start - 1), target),
                torch.where(here, target_grad, 0.0),
                accumulate=True,
            )
            grad_logits[start:stop] = chunk
        return grad_logits, None, None, None, None


def _triton_kernels(logits: Tensor):
    """The Triton kernels' module (triton_cross_entropy.py) for CUDA logits they take, else None
    (the PyTorch path below: CPU, or no Triton)."""
    if not logits.is_cuda:
        return None
    try:
        # pylint: disable-next=import-outside-toplevel
        from megatron.shared_prefix.tensor_parallel import triton_cross_entropy
    except ImportError:
        return None
    return triton_cross_entropy if triton_cross_entropy.supports(logits) else None


def _log_sum_exp(logits: Tensor) -> Tensor:
    """[rows] float32 ``log(sum(exp(logits)))`` over the last dim of [rows, V] logits, with one
    float32 copy of them as the only temporary (updated in place): ``torch.logsumexp`` of the
    float32 logits holds two, and a forest row's loss sits at the end of the forward, where its
    memory peaks (docs/benchmarks.md). For finite logits, as a GEMM gives them."""
    values = logits.to(torch.float32, copy=True)
    shift = values.amax(dim=-1)
    return values.sub_(shift[:, None]).exp_().sum(dim=-1).log_().add_(shift)


def edge_cross_entropy(
    source_logits: Tensor,
    edge_source_slot: Tensor,
    edge_target: Tensor,
    *,
    overwrite_logits: bool = False,
) -> Tensor:
    """Cross entropy of every loss edge from full-vocabulary logits (one rank).

    Args:
        source_logits: [U, V] logits of the distinct edge sources.
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge.
        overwrite_logits: let the backward write the logits' gradient into ``source_logits``'
            storage (its values are gone after the backward); for logits that nothing else reads
            afterwards, such as the output layer's, so the backward allocates no [U, V] tensor.

    Returns:
        [E] float32 ``-log softmax(source_logits[slot])[target]``; its backward keeps no float32
        copy of the logits (``_EdgeCrossEntropy``).
    """
    return _EdgeCrossEntropy.apply(
        source_logits, edge_source_slot, edge_target, None, overwrite_logits
    )


def warm_up(vocab_shard: int, *, dtype: torch.dtype, device) -> None:
    """Run the one-rank edge loss forward and backward on two random sources of ``vocab_shard``
    logits, so that the kernels a run's loss needs are compiled before its first step (on CUDA the
    two Triton kernels, which are specialized on the dtype and the width's alignment only, so any
    row and any tensor-parallel rank of that width then compiles nothing)."""
    generator = torch.Generator(device=device).manual_seed(vocab_shard)
    leaf = torch.randn(2, vocab_shard, generator=generator, device=device, dtype=dtype)
    logits = leaf.requires_grad_() * 1  # not a leaf, as the output layer's logits
    edges = torch.arange(2, device=device)
    loss = edge_cross_entropy(logits, edges, edges, overwrite_logits=True)
    torch.autograd.grad(loss.sum(), leaf)


def vocab_parallel_edge_cross_entropy(
    source_logits: Tensor,
    edge_source_slot: Tensor,
    edge_target: Tensor,
    group,
    *,
    overwrite_logits: bool = False,
) -> Tensor:
    """Cross entropy of every loss edge from this rank's vocabulary shard of the logits.

    Args:
        source_logits: [U, V / tp] logits of the distinct edge sources for this rank's contiguous
            vocabulary range (``rank * V / tp`` onwards, as megatron's output layer shards it).
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge (full-vocabulary ids).
        group: the tensor-parallel process group.
        overwrite_logits: as for ``edge_cross_entropy``.

    Returns:
        [E] float32 loss of every edge, the same on every rank of ``group``. Its gradient reaches
        each rank's logits shard; the caller sums the same weighted loss on every rank, as with
        megatron's ``vocab_parallel_cross_entropy``. Memory as for ``edge_cross_entropy``: float32
        work in chunks, one float32 value per source kept.
    """
    return _EdgeCrossEntropy.apply(
        source_logits, edge_source_slot, edge_target, group, overwrite_logits
    )


def vocab_parallel_edge_prediction_matches(
    source_logits: Tensor, edge_source_slot: Tensor, edge_target: Tensor, group
) -> Tensor:
    """Whether each edge's target is the first argmax of its source's full-vocabulary logits.

    What megatron-core's MTP acceptance rate counts (``torch.argmax`` over the whole vocabulary,
    ties to the lowest id), from this rank's vocabulary shard: the shards' maxima are reduced,
    then the lowest id holding the global maximum. No gradient.

    Args:
        source_logits: [U, V / tp] logits of the distinct edge sources (this rank's shard).
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge.
        group: the tensor-parallel process group.

    Returns:
        [E] bool, the same on every rank of ``group``.
    """
    with torch.no_grad():
        # On the logits' own dtype: max and argmax commute exactly with a cast to float32.
        logits = source_logits
        if group.size() == 1:
            return logits.argmax(dim=-1)[edge_source_slot] == edge_target
        shard = logits.shape[-1]
        local_max = logits.max(dim=-1).values.float()
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        first = logits.argmax(dim=-1) + group.rank() * shard
        first = torch.where(
            local_max == global_max, first, torch.full_like(first, shard * group.size())
        )
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        return first[edge_source_slot] == edge_target
