"""Checkpoints of the loop, in megatron's distributed format, loadable at any parallel layout.

On disk a checkpoint follows megatron.training's layout::

    <dir>/latest_checkpointed_iteration.txt       the latest finished iteration (written last)
    <dir>/iter_0000010/                           megatron.core.dist_checkpointing (torch_dist):
                                                  metadata.json, common.pt, __<rank>_<n>.distcp
    <dir>/iter_0000010/shared_prefix_integrity.json   the integrity record (integrity.py)

Every tensor is saved as a piece of its full tensor (megatron's ``sharded_state_dict``: the
TP = PP = EP = 1 name, shape and this rank's offsets), so any layout can load it: a run at another
(TP, SP, PP, EP, CP, DP) reads the pieces it needs. The state uses megatron.training's keys where
they mean the same:

* ``model``: ``model.sharded_state_dict()``;
* ``optimizer``: AdamW's two moments of every parameter, placed like the parameter
  (``optimizer.state.exp_avg.<parameter>``), and the step count, shared by all parameters;
* ``opt_param_scheduler``, ``iteration``, ``checkpoint_version``, and ``args``: the run's flags of
  plain values, which megatron.training reads from a checkpoint (it takes one without
  ``hybrid_layer_pattern`` for a GPT checkpoint);
* ``rng_state``: every rank's torch RNG state, restored only at the layout that saved it (as
  megatron.training ignores RNG state saved at another tensor/pipeline layout);
* ``shared_prefix``: the model signature (the flags that shape the network, which must match on
  load), the saving layout and the consumed examples.

Saving refuses non-finite state (loss, gradient norm or any rank's parameters). Loading reads only
an iteration whose record matches its files (:func:`integrity.iteration_to_load`), and
:func:`read_header` lets the caller check the signature before any state changes. The earlier
single-file format (``iter_*/model_optim_rng.pt``, one process's whole model) stays loadable in a
single process.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megatron.shared_prefix.training.config import ConfigError
from megatron.shared_prefix.training.integrity import (
    TRACKER_NAME,
    CheckpointError,
    iteration_dir,
    write_atomically,
    write_integrity_record,
)

__all__ = [
    "TrainingPosition",
    "CheckpointHeader",
    "read_header",
    "save_checkpoint",
    "load_checkpoint",
    "NonFiniteStateError",
]

LEGACY_FILE = "model_optim_rng.pt"
_FORMAT = 1
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class NonFiniteStateError(RuntimeError):
    """Training state is not finite; nothing is saved."""


@dataclasses.dataclass(frozen=True)
class TrainingPosition:
    """Where training stands: optimizer steps done and original examples consumed."""

    iteration: int
    consumed_samples: int


@dataclasses.dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint says about itself, read before any state is built or changed.

    Attributes:
        directory: the checkpoint directory (``--load`` or ``--pretrained-checkpoint``).
        flag: the flag that named it, for messages.
        position: its iteration and consumed examples.
        signature: flag -> value of the flags that shaped its network.
        layout: the parallel sizes and world size that saved it (None: the single-file format of
            a single process).
    """

    directory: str
    flag: str
    position: TrainingPosition
    signature: dict
    layout: Optional[dict]

    @property
    def root(self) -> str:
        """The iteration's directory."""
        return iteration_dir(self.directory, self.position.iteration)

    @property
    def legacy(self) -> bool:
        """Whether it is in the earlier single-file format."""
        return self.layout is None


def _unreadable(flag: str, directory: str, path: str, exc: BaseException) -> CheckpointError:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(
        f"{flag} {directory}: {path} is not a checkpoint of this trainer "
        f"({type(exc).__name__}: {first_line})"
    )


def read_header(directory: str, iteration: int, flag: str = "--load") -> CheckpointHeader:
    """The header of ``iteration``'s checkpoint in ``directory`` (verified by
    integrity.iteration_to_load); reads the common state only, not the tensors.

    Raises:
        CheckpointError: when the files are not a checkpoint of this trainer.
    """
    root = iteration_dir(directory, iteration)
    legacy = os.path.join(root, LEGACY_FILE)
    if os.path.isfile(legacy):
        try:
            state = torch.load(legacy, map_location="cpu", weights_only=True)
            return CheckpointHeader(
                directory=directory,
                flag=flag,
                position=TrainingPosition(state["iteration"], state["consumed_samples"]),
                signature=_legacy_signature(state["signature"]),
                layout=None,
            )
        except (OSError, RuntimeError, EOFError, ValueError, KeyError) as exc:
            raise _unreadable(flag, directory, legacy, exc) from None
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(root)
        ours = common["shared_prefix"]
        if ours["format"] != _FORMAT:
            raise ValueError(f"format {ours['format']}, this version reads {_FORMAT}")
        return CheckpointHeader(
            directory=directory,
            flag=flag,
            position=TrainingPosition(common["iteration"], ours["consumed_samples"]),
            signature=dict(ours["signature"]),
            layout=dict(ours["layout"]),
        )
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise _unreadable(flag, directory, root, exc) from None


def _legacy_signature(signature: dict) -> dict:
    """The single-file format's signature as the current one reads: that version recorded
    ``--padded-vocab-size`` None when the vocabulary was padded at TP = 1 from
    ``--make-vocab-size-divisible-by``."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    signature = dict(signature)
    divisible_by = signature.pop("--make-vocab-size-divisible-by", None)
    if signature.get("--padded-vocab-size") is None:
        signature["--padded-vocab-size"] = calculate_padded_vocab_size(
            signature["--vocab-size"], divisible_by, 1, logging_enabled=False
        )
    return signature


def _non_finite_state(model: torch.nn.Module, loss: float, grad_norm: float) -> list[str]:
    """What is not finite, over all ranks (every rank gets the same list)."""
    problems = [
        f"{name} is {value}"
        for name, value in (("loss", loss), ("gradient norm", grad_norm))
        if not math.isfinite(value)
    ]
    problems += [
        f"parameter {name} is not finite"
        for name, p in model.named_parameters()
        if not torch.isfinite(p).all()
    ][:3]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    merged = []
    for rank_problems in gathered:
        merged += [p for p in rank_problems if p not in merged]
    return merged


def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state as its first step would create it (step 0, zero
    moments), so that a fresh optimizer has tensors to save into or load into."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for name in _ADAM_MOMENTS:
                    state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _placements(optimizer: torch.optim.Optimizer, model_sharded: dict) -> list:
    """(parameter, its entry in ``model_sharded``) for every parameter of ``optimizer``."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    params = [p for group in optimizer.param_groups for p in group["params"]]
    placement = get_param_id_to_sharded_param_map(model_sharded, params)
    missing = [index for index in range(len(params)) if index not in placement]
    if missing:
        raise RuntimeError(f"{len(missing)} optimizer parameters are not in the model's state")
    return [(param, placement[index]) for index, param in enumerate(params)]


def _optimizer_sharded_state(optimizer: torch.optim.Optimizer, model_sharded: dict) -> dict:
    """AdamW's moments as sharded tensors placed like their parameters, in the optimizer's
    parameter order (the order is local; the files key each piece by its full name and offset),
    and the step count, which all parameters share."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    _ensure_adam_state(optimizer)
    moments, steps = [], set()
    for param, placed in _placements(optimizer, model_sharded):
        state = optimizer.state[param]
        steps.add(float(state["step"]))
        moments.append(
            {
                name: make_sharded_optimizer_tensor(
                    placed, state[name], prefix=f"optimizer.state.{name}"
                )
                for name in _ADAM_MOMENTS
            }
        )
    if len(steps) != 1:
        raise RuntimeError(f"AdamW's parameters are at different steps {sorted(steps)}")
    return {"state": moments, "step": steps.pop()}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Copy the loaded moments (in the optimizer's parameter order) and the step into AdamW's
    state (already holding tensors of the right shapes: :func:`_ensure_adam_state`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param, moments in zip(params, loaded["state"], strict=True):
        state = optimizer.state[param]
        state["step"] = torch.tensor(loaded["step"], dtype=torch.float32)
        for name in _ADAM_MOMENTS:
            state[name].copy_(moments[name])


def checkpoint_args(args: argparse.Namespace, consumed_samples: int) -> argparse.Namespace:
    """The flags megatron.training stores as a checkpoint's ``args``: those of plain values (what
    ``torch.load(weights_only=True)`` reads), with the consumed samples of this checkpoint."""
    plain = (bool, int, float, str, type(None))
    kept = {
        name: value
        for name, value in vars(args).items()
        if isinstance(value, plain)
        or (isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value))
    }
    kept["consumed_train_samples"] = consumed_samples
    kept["skipped_train_samples"] = 0
    return argparse.Namespace(**kept)


def _rng_sharded_state():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "shared_prefix.rng_state",
        torch.get_rng_state(),
        (dist.get_world_size(),),
        (dist.get_rank(),),
        replica_id=0,
    )


def save_checkpoint(
    directory: str,
    position: TrainingPosition,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    signature: dict,
    layout: dict,
    args: Optional[argparse.Namespace] = None,
    loss: float,
    grad_norm: float,
) -> str:
    """Write the checkpoint of the state after ``position.iteration`` steps; return its directory.

    Every rank of the world calls it. The iteration's directory is emptied and written by
    megatron's distributed save, then the integrity record is written, and the tracker last: a
    save interrupted at any point leaves the tracker at the previous checkpoint and the unfinished
    iteration without a record.

    Args:
        scheduler: the LR scheduler, or None for the seed checkpoint of iteration 0 (the state
            then is the weights; loading starts a fresh optimizer and schedule).
        layout: the parallel sizes and world size of this run (stored; RNG state is restored only
            at the same layout).
        args: the run's flags, stored for megatron.training (:func:`checkpoint_args`).
        loss, grad_norm: the last step's.

    Raises:
        NonFiniteStateError: when the loss, the gradient norm or a parameter is not finite.
    """
    from megatron.core import dist_checkpointing

    problems = _non_finite_state(model, loss, grad_norm)
    if problems:
        raise NonFiniteStateError(
            f"refusing to save a checkpoint at iteration {position.iteration} to {directory}: "
            + "; ".join(problems)
        )
    target = iteration_dir(directory, position.iteration)
    first = dist.get_rank() == 0
    if first:
        # What is there is an unfinished save of this iteration, or one this run replaces.
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
    dist.barrier()
    model_sharded = model.sharded_state_dict()
    state = {
        "model": model_sharded,
        "optimizer": _optimizer_sharded_state(optimizer, model_sharded),
        "rng_state": _rng_sharded_state(),
        "iteration": position.iteration,
        "checkpoint_version": 3.0,
        "shared_prefix": {
            "format": _FORMAT,
            "signature": dict(signature),
            "layout": dict(layout),
            "consumed_samples": position.consumed_samples,
        },
    }
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if args is not None:
        state["args"] = checkpoint_args(args, position.consumed_samples)
    dist_checkpointing.save(state, target)
    dist.barrier()
    if first:
        write_integrity_record(target, position.iteration)
        write_atomically(os.path.join(directory, TRACKER_NAME), str(position.iteration))
    dist.barrier()
    return target


def load_checkpoint(
    header: CheckpointHeader,
    *,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    scheduler,
    layout: dict,
    load_rng: bool = True,
) -> Optional[str]:
    """Restore the checkpoint ``header`` describes into this rank's ``model`` (any layout).

    Args:
        header: from :func:`read_header`, whose signature the caller has checked.
        optimizer, scheduler: restored too unless None (``--finetune``, ``--no-load-optim``).
        layout: this run's parallel sizes and world size.
        load_rng: restore the RNG state (``--no-load-rng`` turns it off); it is restored only when
            ``layout`` is the saving layout.

    Returns:
        A note for the log when RNG state was not restored although asked for, else None.

    Raises:
        CheckpointError: when the files cannot be read, or a single-file checkpoint is loaded by
            several processes.
    """
    if header.legacy:
        _load_legacy(header, model, optimizer, scheduler, load_rng)
        return None
    from megatron.core import dist_checkpointing

    same_layout = header.layout == layout
    sharded = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded_state(optimizer, sharded["model"])
    if load_rng and same_layout:
        sharded["rng_state"] = _rng_sharded_state()
    try:
        loaded = dist_checkpointing.load(sharded, header.root)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        raise _unreadable(header.flag, header.directory, header.root, exc) from None
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        _load_optimizer_state(optimizer, loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng and same_layout:
        torch.set_rng_state(loaded["rng_state"])
    if load_rng and not same_layout:
        return (
            f"RNG state not restored: saved at layout {header.layout}, loaded at {layout} "
            "(as megatron.training does after a layout change)"
        )
    return None


def _load_legacy(header, model, optimizer, scheduler, load_rng) -> None:
    """Restore a checkpoint of the earlier single-file format (one process's whole model)."""
    if dist.get_world_size() > 1:
        raise CheckpointError(
            f"{header.flag} {header.directory}: iteration {header.position.iteration} is in the "
            f"single-file format of earlier versions ({LEGACY_FILE}), which holds one process's "
            "whole model; load it in a single process and save it again (it is then written in "
            "the distributed format, loadable at any layout)"
        )
    path = os.path.join(header.root, LEGACY_FILE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise _unreadable(header.flag, header.directory, path, exc) from None
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
    if load_rng:
        torch.set_rng_state(state["rng"])


def check_signature(header: CheckpointHeader, signature: dict) -> None:
    """Refuse a checkpoint made for a different network, naming every differing flag of
    ``signature`` (this run's).

    Raises:
        ConfigError: naming the flags and both values.
    """
    differing = sorted(key for key in signature if signature[key] != header.signature.get(key))
    if differing:
        details = ", ".join(
            f"{key}: checkpoint {header.signature.get(key)!r} vs now {signature.get(key)!r}"
            for key in differing
        )
        raise ConfigError(
            f"{header.flag} {header.directory}: checkpoint of a different model ({details})"
        )
