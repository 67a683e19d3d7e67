"""Oracle of the multiplicity-weighted router statistics: expand the forest to its dense tokens.

Readable, slow, and independent of the index tables in statistics.py: every sequence's root path is
gathered into dense rows (``ForestLayout.root_path``), and each statistic is computed with the
textbook formulas of megatron-core's router over those rows, treating the row's sequences as one
padded dense micro-batch with its padding masked (TreeTopKRouter's dense reference). Values are
differentiable in ``logits`` so tests can compare gradients too.
"""

import dataclasses
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

from megatron.shared_prefix.layout import ForestLayout


@dataclasses.dataclass
class DenseRouterStatistics:
    """Router statistics of the dense micro-batch (losses include their coefficients).

    Attributes:
        tokens_per_expert: [E] int64 expert-bias counts (``routing_map``, padding per
        ``count_padding``).
        aux_loss, seq_aux_loss, global_aux_loss, z_loss: scalar losses, None where not asked for.
        global_tokens_per_expert: [E] float32 running counts after this micro-batch
        (global_aux_loss).
    """

    tokens_per_expert: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None
    seq_aux_loss: Optional[torch.Tensor] = None
    global_aux_loss: Optional[torch.Tensor] = None
    z_loss: Optional[torch.Tensor] = None
    global_tokens_per_expert: Optional[torch.Tensor] = None


def _switch_loss(probs, tokens_per_expert, num_tokens, topk, coeff):
    """E * coeff / (topk * N^2) * sum_e (sum_x probs[x, e]) * tokens_per_expert[e]."""
    num_experts = probs.shape[-1]
    return (probs.sum(0) * tokens_per_expert).sum() * num_experts * coeff / (topk * num_tokens**2)


def dense_router_statistics(
    layout: ForestLayout,
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    topk: int,
    score_function: str,
    count_padding: bool,
    aux_loss_coeff: float = 0.0,
    seq_aux_loss_coeff: float = 0.0,
    global_aux_loss_coeff: float = 0.0,
    z_loss_coeff: Optional[float] = None,
    global_tokens_per_expert: Optional[torch.Tensor] = None,
    global_steps: int = 0,
) -> DenseRouterStatistics:
    """Statistics of the dense tokens of ``layout``'s sequences.

    Args:
        layout: the forest row.
        logits: [T, E] router logits of the packed tokens.
        routing_map: [T, E] bool experts chosen for each packed token (expert bias included).
        topk, score_function: the router's.
        count_padding: count the row's padding tokens once each in ``tokens_per_expert``.
        *_coeff: loss coefficients (0 / None: not computed).
        global_tokens_per_expert, global_steps: running counts and micro-batch count before this
            micro-batch (global_aux_loss); None / 0 for the first.

    Returns:
        DenseRouterStatistics.
    """
    paths = [torch.as_tensor(layout.root_path(k)) for k in range(len(layout.sequence_ids))]
    dense = torch.cat(paths)
    num_tokens = len(dense)

    counts = routing_map[dense].sum(0)
    if count_padding and layout.num_padding:
        counts = counts + routing_map[layout.num_tokens - layout.num_padding :].sum(0)
    stats = DenseRouterStatistics(tokens_per_expert=counts)

    aux_map, scores = compute_routing_scores_for_aux_loss(logits[dense], topk, score_function)
    aux_counts = aux_map.sum(0)
    if aux_loss_coeff:
        stats.aux_loss = _switch_loss(scores, aux_counts, num_tokens, topk, aux_loss_coeff)
    if seq_aux_loss_coeff:
        # megatron-core's padded batch: every sequence is normalised by the mean length N / n.
        mean_length = num_tokens / len(paths)
        lengths = [len(p) for p in paths]
        per_sequence = [
            _switch_loss(seq_scores, seq_map.sum(0), mean_length, topk, seq_aux_loss_coeff)
            for seq_map, seq_scores in zip(aux_map.split(lengths), scores.split(lengths))
        ]
        stats.seq_aux_loss = torch.stack(per_sequence).mean()
    if global_aux_loss_coeff:
        previous = (
            global_tokens_per_expert
            if global_tokens_per_expert is not None
            else torch.zeros(len(aux_counts))
        )
        stats.global_tokens_per_expert = previous + aux_counts
        averaged = stats.global_tokens_per_expert / (global_steps + 1)
        stats.global_aux_loss = _switch_loss(
            scores, averaged, num_tokens, topk, global_aux_loss_coeff
        )
    if z_loss_coeff is not None:
        stats.z_loss = torch.logsumexp(logits[dense], dim=-1).square().mean() * z_loss_coeff
    return stats
