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
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor


def edge_cross_entropy(
    source_logits: Tensor, edge_source_slot: Tensor, edge_target: Tensor
) -> Tensor:
    """Cross entropy of every loss edge from full-vocabulary logits (one rank).

    Args:
        source_logits: [U, V] logits of the distinct edge sources.
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge.

    Returns:
        [E] float32 ``-log softmax(source_logits[slot])[target]``.
    """
    logits = source_logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1)
    return log_normalizer[edge_source_slot] - logits[edge_source_slot, edge_target]


def vocab_parallel_edge_cross_entropy(
    source_logits: Tensor, edge_source_slot: Tensor, edge_target: Tensor, group
) -> Tensor:
    """Cross entropy of every loss edge from this rank's vocabulary shard of the logits.

    Args:
        source_logits: [U, V / tp] logits of the distinct edge sources for this rank's contiguous
            vocabulary range (``rank * V / tp`` onwards, as megatron's output layer shards it).
        edge_source_slot: [E] row of ``source_logits`` that predicts each edge.
        edge_target: [E] target token id of each edge (full-vocabulary ids).
        group: the tensor-parallel process group.

    Returns:
        [E] float32 loss of every edge, the same on every rank of ``group``. Its gradient reaches
        each rank's logits shard; the caller sums the same weighted loss on every rank, as with
        megatron's ``vocab_parallel_cross_entropy``.
    """
    if group.size() == 1:
        return edge_cross_entropy(source_logits, edge_source_slot, edge_target)
    logits = source_logits.float()
    shard = logits.shape[-1]
    with torch.no_grad():
        shift = logits.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    sum_exp = reduce_from_tensor_model_parallel_region(
        (logits - shift.unsqueeze(-1)).exp().sum(dim=-1), group
    )
    log_normalizer = sum_exp.log() + shift
    local_target = edge_target - group.rank() * shard
    owned = (local_target >= 0) & (local_target < shard)
    target_logit = logits[edge_source_slot, local_target.clamp(0, shard - 1)]
    target_logit = reduce_from_tensor_model_parallel_region(
        torch.where(owned, target_logit, torch.zeros_like(target_logit)), group
    )
    return log_normalizer[edge_source_slot] - target_logit


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
        logits = source_logits.float()
        if group.size() == 1:
            return logits.argmax(dim=-1)[edge_source_slot] == edge_target
        shard = logits.shape[-1]
        local_max = logits.max(dim=-1).values
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        first = logits.argmax(dim=-1) + group.rank() * shard
        first = torch.where(
            local_max == global_max, first, torch.full_like(first, shard * group.size())
        )
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        return first[edge_source_slot] == edge_target
