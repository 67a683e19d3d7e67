"""MoE router settings that a forest forward cannot reproduce exactly.

A packed token of multiplicity ``m`` stands for ``m`` dense tokens that, in dense training, would be
routed independently. Multiplicity weights reproduce every statistic that is a sum over tokens
(counts, load-balancing and z losses), but not an operation that treats the copies of a token
differently or depends on how many packed tokens a row has.
"""

from megatron.core.transformer.moe.router import Router


def _load_balancing_types(config) -> list[str]:
    routing_type = config.moe_router_load_balancing_type
    return [routing_type] if isinstance(routing_type, str) else list(routing_type)


def moe_forest_errors(config) -> list[str]:
    """Reasons why the MoE layers of ``config`` cannot run exactly on a prefix forest (empty: they
    can).

    Args:
        config: the model's TransformerConfig.

    Returns:
        One message per unsupported setting, naming it and saying why; [] when the config has no
        routed experts or every MoE setting is supported.
    """
    if not config.num_moe_experts:
        return []
    errors = []
    balancing = _load_balancing_types(config)
    if "sinkhorn" in balancing:
        errors.append(
            "moe_router_load_balancing_type='sinkhorn' (Sinkhorn normalises the routing scores "
            "over the packed tokens of the row jointly, so a shared token cannot stand for its "
            "dense copies)"
        )
    if "quantile_balancing" in balancing:
        errors.append(
            "moe_router_load_balancing_type='quantile_balancing' (the expert quantiles are taken "
            "over the packed tokens, where a shared token counts once instead of once per "
            "sequence)"
        )
    if config.moe_expert_capacity_factor is not None:
        errors.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (capacity-factor "
            "token dropping drops by the packed per-expert load; the dense batch would drop other "
            "tokens and each copy of a shared token separately)"
        )
    if config.moe_pad_expert_input_to_capacity:
        errors.append(
            "moe_pad_expert_input_to_capacity=True (expert capacity is computed from the packed "
            "token count, not the dense one)"
        )
    if (
        config.moe_expert_rank_capacity_factor is not None
        and config.moe_flex_dispatcher_backend == "hybridep"
    ):
        errors.append(
            f"moe_expert_rank_capacity_factor={config.moe_expert_rank_capacity_factor} with "
            "moe_flex_dispatcher_backend='hybridep' (tokens over a rank's budget are dropped, and "
            "the packed row drops other tokens than the dense batch would)"
        )
    if config.moe_enable_routing_replay:
        errors.append(
            "moe_enable_routing_replay=True (recorded routing decisions are replayed by token "
            "position, and packed positions differ from dense ones)"
        )
    if config.moe_input_jitter_eps is not None:
        errors.append(
            f"moe_input_jitter_eps={config.moe_input_jitter_eps} (random input jitter: a shared "
            "token would get one draw where its dense copies get one each)"
        )
    if config.moe_router_force_load_balancing:
        errors.append(
            "moe_router_force_load_balancing=True (random router logits per packed token, not per "
            "dense token)"
        )
    if config.moe_router_force_biased is not None:
        errors.append(
            f"moe_router_force_biased={config.moe_router_force_biased} (draws random router logits "
            "per packed token, not per dense token)"
        )
    return errors


def moe_router_errors(model) -> list[str]:
    """One message per MoE router of ``model`` that is not a TreeTopKRouter (empty: all are).

    A stock router on a forest would count each packed token once in its statistics, silently; a
    spec built without ``tree_moe_module_spec`` is the usual cause.
    """
    # router.py imports this module for its own checks, so import the class here.
    # pylint: disable-next=import-outside-toplevel
    from megatron.shared_prefix.moe.router import TreeTopKRouter

    return [
        f"{name} is a {type(module).__name__}, not a TreeTopKRouter (build the MoE spec with "
        "tree_moe_module_spec, as hybrid_stack_spec does)"
        for name, module in model.named_modules()
        if isinstance(module, Router) and not isinstance(module, TreeTopKRouter)
    ]
