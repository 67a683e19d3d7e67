"""Shared-prefix training for Megatron hybrid models.

Public API (docs/api.md). Names are resolved lazily so that the planner can be used without
importing torch or megatron-core.
"""

import importlib

_EXPORTS = {
    "plan_shared_prefix": "megatron.shared_prefix.planning",
    "SharedPrefixPlan": "megatron.shared_prefix.planning",
    "ForestLayout": "megatron.shared_prefix.layout",
    "SharedPrefixHybridModel": "megatron.shared_prefix.models.hybrid.hybrid_model",
    "hybrid_stack_spec": "megatron.shared_prefix.models.hybrid.hybrid_layer_specs",
    "enable_cpu": "megatron.shared_prefix.cpu",
    "context_parallel_edges": "megatron.shared_prefix.context_parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
