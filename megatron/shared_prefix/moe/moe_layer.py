"""The MoE layer of a forest: megatron-core's MoELayer with a dispatcher that does not wait for the
GPU (upstream: megatron/core/transformer/moe/moe_layer.py).

With the all-gather dispatcher (megatron-core's default) the layer builds a
:class:`ForestAllGatherTokenDispatcher`, which on a forest hands the experts their token counts on
the device; :class:`ForestSequentialMLP` experts run on those without a host sync. Other
dispatchers, and every forward without a forest, are megatron-core's.
"""

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from megatron.shared_prefix.moe.token_dispatcher import ForestAllGatherTokenDispatcher


class TreeMoELayer(MoELayer):
    """MoELayer whose all-gather token dispatcher is a :class:`ForestAllGatherTokenDispatcher`
    (in training: megatron-core's inference-optimized layers keep their own dispatchers).

    Args: as MoELayer.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=None,
        pg_collection=None,
        is_mtp_layer=False,
        name=None,
    ):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(
            config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        if (
            type(self.token_dispatcher) is MoEAllGatherTokenDispatcher
            and config.transformer_impl != "inference_optimized"
        ):
            self.token_dispatcher = ForestAllGatherTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
            if self.use_shared_expert and self.shared_expert_overlap:
                self.token_dispatcher.set_shared_experts(self.shared_experts)
