"""Tiny MoE configs and routers for the MoE tests (CPU, float32)."""

import pytest
import torch
from tiny import tiny_config

# Every load-balancing loss megatron-core offers, each with its own coefficient.
ALL_AUX_LOSSES = dict(
    moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
    moe_aux_loss_coeff=[1e-2, 2e-2, 3e-2],
    moe_z_loss_coeff=1e-3,
)
# Aux-loss-free balancing: expert bias with a sigmoid score function (megatron-core requires it).
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")


def moe_config(**overrides):
    """A float32 TransformerConfig with 4 experts, top-2, hidden size 32."""
    settings = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    settings.update(overrides)
    return tiny_config(**settings)


@pytest.fixture
def build_router(megatron_world):
    """``build_router(count_padding=False, seed=0, **config)`` -> TreeTopKRouter in training mode.

    Weights are drawn with std 1 (not the init's 0.02) so routing decisions are far from ties.
    """
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron.shared_prefix.moe import TreeTopKRouter

    def build(count_padding=False, seed=0, **config):
        torch.manual_seed(seed)
        router = TreeTopKRouter(
            moe_config(**config), get_default_pg_collection(), count_padding=count_padding
        )
        with torch.no_grad():
            router.weight.normal_()
            if router.bias is not None:
                router.bias.normal_()
            if router.expert_bias is not None:
                router.expert_bias.normal_(std=0.1)
        router.set_layer_number(1)
        return router.train()

    return build


@pytest.fixture
def metrics():
    """A fresh global MoE metrics tracker (where routers log their aux losses) for this test.

    A fresh one, because the tracker sizes each metric by the first model's layer count.
    """
    from megatron.core.transformer.moe.moe_logging import (
        MoEMetricsTracker,
        destroy_moe_metrics_tracker,
        set_moe_metrics_tracker,
    )

    tracker = MoEMetricsTracker()
    set_moe_metrics_tracker(tracker)
    yield tracker
    destroy_moe_metrics_tracker()
