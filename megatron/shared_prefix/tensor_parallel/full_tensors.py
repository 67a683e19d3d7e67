"""Full (layout-independent) parameter tensors from a model sharded by megatron's parallelism, and
back (upstream: megatron/core/tensor_parallel/utils.py).

A parameter of a model built at some (TP, PP, EP) layout is a shard of a *full* tensor, the one a
TP = PP = EP = 1 model holds under the same name:

* tensor parallelism splits it along ``partition_dim`` (megatron's parameter attributes), in one
  contiguous block per rank, or, when ``partition_sizes`` lists several packed components (Mamba's
  ``in_proj`` packs z, x, B, C, dt), one block of every component per rank;
* expert parameters are split over the expert tensor-parallel group, and expert parallelism gives
  rank ``r`` the experts ``r * E_local ..`` under local names ``local_experts.0 ..``;
* pipeline parallelism gives each stage some layers under local names ``layers.0 ..``; the last
  stage of a model with tied embeddings holds a copy of the word embedding as
  ``output_layer.weight``.

:func:`load_full_tensors` copies each rank's shard out of full tensors (e.g. of a TP = 1 model, so
that runs at different layouts start from the same weights); :func:`gather_full_tensors`
reassembles full tensors (e.g. gradients) on every rank, for comparison with a TP = 1 run.
"""

import re
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def _tensor_parallel_group(param: torch.nn.Parameter):
    if _is_expert(param):
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def full_parameter_name(model: torch.nn.Module, name: str) -> str:
    """The name that ``name`` (a parameter of this rank's ``model``) has in the TP = PP = EP = 1
    model."""
    layer = _LAYER.match(name)
    if layer:
        global_index = model.decoder.layers[int(layer.group(1))].layer_number - 1
        name = f"decoder.layers.{global_index}." + name[layer.end() :]
    expert = _EXPERT.search(name)
    if expert:
        local_experts = (
            model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        )
        global_index = parallel_state.get_expert_model_parallel_rank() * local_experts
        global_index += int(expert.group(1))
        name = (
            f"{name[: expert.start()]}.experts.local_experts.{global_index}.{name[expert.end():]}"
        )
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def _blocks(param: torch.nn.Parameter) -> list[int]:
    """Local block sizes along the partition dimension (one block unless components are packed)."""
    return list(getattr(param, "partition_sizes", None) or [param.shape[param.partition_dim]])


def local_shard(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for ``param`` (``full`` itself for a replicated parameter)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = _tensor_parallel_group(param)
    size, rank, dim = group.size(), group.rank(), param.partition_dim
    pieces = full.split([block * size for block in _blocks(param)], dim=dim)
    return torch.cat(
        [piece.narrow(dim, rank * block, block) for piece, block in zip(pieces, _blocks(param))],
        dim=dim,
    )


def _full_from_shards(param: torch.nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return shard
    group = _tensor_parallel_group(param)
    dim = param.partition_dim
    shards = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(shards, shard.contiguous(), group=group)
    per_rank = [s.split(_blocks(param), dim=dim) for s in shards]
    return torch.cat(
        [
            torch.cat([pieces[k] for pieces in per_rank], dim=dim)
            for k in range(len(_blocks(param)))
        ],
        dim=dim,
    )


def load_full_tensors(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every full tensor into ``model``'s parameters.

    Raises KeyError naming a parameter whose full name is missing from ``full``.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            full_name = full_parameter_name(model, name)
            if full_name not in full:
                raise KeyError(f"no full tensor {full_name!r} for parameter {name!r}")
            param.copy_(local_shard(param, full[full_name].to(param.device, param.dtype)))


def gather_full_tensors(
    model: torch.nn.Module, tensors: dict[str, Optional[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from every rank's ``tensors`` (by local parameter name, shaped like
    the parameters, e.g. their gradients; None counts as zeros); a collective over the world.

    Returns, on every rank, full name -> full tensor (on the CPU) for every parameter of every
    pipeline stage and expert rank. Where several ranks hold the same full tensor (data-parallel
    replicas, a tied embedding's two copies) the first rank's is kept.
    """
    mine = {}
    for name, param in model.named_parameters():
        value = tensors.get(name)
        value = torch.zeros_like(param) if value is None else value
        mine[full_parameter_name(model, name)] = _full_from_shards(param, value).cpu()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for rank_tensors in everyone:
        for name, value in rank_tensors.items():
            merged.setdefault(name, value)
    return merged
