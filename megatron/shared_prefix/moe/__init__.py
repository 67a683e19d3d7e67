"""Mixture-of-experts layers on prefix forests: a packed token stands for ``multiplicity`` dense
tokens.

* :class:`TreeTopKRouter` (router.py): multiplicity-weighted expert-bias counts and load-balancing /
  z losses, and packing-invariant gating;
* :func:`tree_moe_module_spec`: megatron-core's MoE spec with that router;
* :func:`moe_forest_errors`, :func:`moe_router_errors` (validation.py): router settings a forest
  cannot reproduce, and routers that would not weight by multiplicity;
* statistics.py: the exact (int64) weighted counts and per-forest index tables;
* reference.py: a readable dense-expansion oracle of the same statistics, for tests.
"""

from megatron.shared_prefix.moe.moe_module_specs import tree_moe_module_spec
from megatron.shared_prefix.moe.router import ROW_BLOCK_SIZE, TreeTopKRouter
from megatron.shared_prefix.moe.statistics import weighted_expert_counts
from megatron.shared_prefix.moe.validation import moe_forest_errors, moe_router_errors

__all__ = [
    "ROW_BLOCK_SIZE",
    "TreeTopKRouter",
    "moe_forest_errors",
    "moe_router_errors",
    "tree_moe_module_spec",
    "weighted_expert_counts",
]
