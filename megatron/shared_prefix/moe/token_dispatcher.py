"""An all-gather token dispatcher that permutes a forest's tokens without a host sync (upstream:
megatron/core/transformer/moe/token_dispatcher.py).

megatron-core's MoEAllGatherTokenDispatcher copies the per-expert token counts to the host
(``.cpu()``) to size the permutation: the host waits there for every kernel queued before the MoE
layer. On a forest no token is ever dropped (validation refuses capacity factors), so when every
expert is local the permuted row holds exactly ``tokens * topk`` entries, a number the host already
knows; the counts can stay on the device, where :class:`ForestSequentialMLP` reads them.
"""

import torch
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from megatron.shared_prefix.tensors import current_forest


class ForestAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """MoEAllGatherTokenDispatcher whose permutation, on a forest with every expert local (expert
    parallel size 1), is sized on the host and returns the token counts on the device.

    The permuted tokens, their probabilities and the inverse mapping are the same tensors (same
    order, same values) as the stock dispatcher's; only ``tokens_per_expert`` stays where it was
    computed. Every token has exactly ``topk`` experts in the router's routing map (TopKRouter's,
    with token dropping refused on forests). Without a forest, with experts spread over
    expert-parallel ranks (the number of tokens routed to this rank's experts is then
    data-dependent), or with Transformer Engine's fused permutation, the stock method runs.
    """

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """(permuted tokens [N, hidden], tokens_per_expert [E] int64, permuted probs [N]), with
        ``N = tokens * topk``, sorted by expert and, within an expert, by token."""
        if (
            current_forest() is None
            or self.num_local_experts != self.config.num_moe_experts
            or self.config.moe_permute_fusion
        ):
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map.contiguous()
        tokens_per_expert = self.local_map.sum(dim=0)
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states,
            self.local_map,
            probs=probs.contiguous(),
            num_out_tokens=hidden_states.shape[0] * self.router_topk,
        )
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs
