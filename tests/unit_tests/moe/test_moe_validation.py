"""moe_forest_errors / moe_router_errors: what a forest cannot reproduce is named, with the reason."""

import pytest
import torch

from megatron.shared_prefix.moe import moe_forest_errors, moe_router_errors

from .conftest import ALL_AUX_LOSSES, EXPERT_BIAS, moe_config

REJECTED = {
    "sinkhorn": (dict(moe_router_load_balancing_type="sinkhorn"), "Sinkhorn"),
    "quantile_balancing": (dict(moe_router_load_balancing_type="quantile_balancing"), "quantiles"),
    "moe_expert_capacity_factor": (dict(moe_expert_capacity_factor=1.5), "token dropping"),
    "moe_pad_expert_input_to_capacity": (
        dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True),
        "capacity is computed",
    ),
    "moe_expert_rank_capacity_factor": (
        dict(
            moe_expert_rank_capacity_factor=2.0,
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="hybridep",
            use_transformer_engine_op_fuser=True,
        ),
        "dropped",
    ),
    "moe_enable_routing_replay": (dict(moe_enable_routing_replay=True), "replayed"),
    "moe_input_jitter_eps": (dict(moe_input_jitter_eps=0.01), "jitter"),
    "moe_router_force_load_balancing": (dict(moe_router_force_load_balancing=True), "random"),
    "moe_router_force_biased": (dict(moe_router_force_biased=0.5), "random"),
}


@pytest.mark.parametrize("setting", sorted(REJECTED))
def test_rejected_setting_is_named_with_reason(setting):
    overrides, reason = REJECTED[setting]
    errors = moe_forest_errors(moe_config(**overrides))
    assert any(setting in error and reason in error for error in errors), errors


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        ALL_AUX_LOSSES,
        dict(ALL_AUX_LOSSES, **EXPERT_BIAS),
        dict(moe_router_load_balancing_type="none", moe_router_topk=1, moe_router_pre_softmax=True),
        dict(
            moe_token_dispatcher_type="alltoall", moe_router_num_groups=2, moe_router_group_topk=1
        ),
        # ncclep fails loudly instead of dropping tokens over the rank budget.
        dict(
            moe_expert_rank_capacity_factor=2.0,
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="ncclep",
        ),
    ],
)
def test_supported_settings_pass(overrides):
    assert moe_forest_errors(moe_config(**overrides)) == []


def test_no_experts_no_errors():
    assert moe_forest_errors(moe_config(num_moe_experts=None, moe_input_jitter_eps=0.01)) == []


def test_every_rejection_is_reported():
    config = moe_config(
        moe_input_jitter_eps=0.01, moe_enable_routing_replay=True, moe_expert_capacity_factor=1.0
    )
    assert len(moe_forest_errors(config)) == 3


def test_stock_routers_are_named(build_router):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    tree = build_router()
    modules = torch.nn.ModuleDict(
        {"tree": tree, "stock": TopKRouter(tree.config, get_default_pg_collection())}
    )
    (error,) = moe_router_errors(modules)
    assert error.startswith("stock is a TopKRouter") and "tree_moe_module_spec" in error
