"""Checkpoints of the single-process loop (megatron.training saves and loads its own).

Layout follows Megatron's: ``<dir>/iter_0000010/model_optim_rng.pt`` and
``<dir>/latest_checkpointed_iteration.txt``, plus the integrity record of integrity.py (a
checksum of the file, written after it and before the tracker). A checkpoint holds the model, the
optimizer, the LR scheduler, the torch RNG state, the training position (iteration and consumed
examples) and the model signature (the flags that shape the network), which must match on load.
Saving refuses
non-finite state: a checkpoint is never written after a non-finite loss or gradient norm, or with
non-finite parameters. Loading reads only an iteration whose record matches its file
(:func:`integrity.iteration_to_load` checks it before any state changes).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

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
    "save_checkpoint",
    "load_checkpoint",
    "NonFiniteStateError",
]

_FILE = "model_optim_rng.pt"


class NonFiniteStateError(RuntimeError):
    """Training state is not finite; nothing is saved."""


@dataclasses.dataclass(frozen=True)
class TrainingPosition:
    """Where training stands: optimizer steps done and original examples consumed."""

    iteration: int
    consumed_samples: int


def save_checkpoint(
    directory: str,
    position: TrainingPosition,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    signature: dict,
    loss: float,
    grad_norm: float,
) -> str:
    """Write a checkpoint of the state after ``position.iteration`` steps; return its file.

    ``loss`` and ``grad_norm`` are the last step's. The file is written under a temporary name,
    synced and renamed; then the integrity record; the tracker is updated last. A save interrupted
    at any point leaves the tracker at the previous checkpoint, and the unfinished iteration
    without a record.

    Raises:
        NonFiniteStateError: when the loss, the gradient norm or a parameter is not finite.
    """
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
    if problems:
        raise NonFiniteStateError(
            f"refusing to save a checkpoint at iteration {position.iteration} to {directory}: "
            + "; ".join(problems)
        )
    target = iteration_dir(directory, position.iteration)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, _FILE)
    state = {
        "iteration": position.iteration,
        "consumed_samples": position.consumed_samples,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "signature": signature,
    }
    with open(path + ".tmp", "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)
    write_integrity_record(target, position.iteration)
    write_atomically(os.path.join(directory, TRACKER_NAME), str(position.iteration))
    return path


def load_checkpoint(
    directory: str,
    iteration: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    signature: dict,
) -> TrainingPosition:
    """Restore the checkpoint of ``iteration`` (verified by integrity.iteration_to_load).

    Returns:
        The restored position.

    Raises:
        CheckpointError: when the file cannot be read as a checkpoint of this loop.
        ConfigError: when the checkpoint was made for a different network (names the flags).
    """
    path = os.path.join(iteration_dir(directory, iteration), _FILE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"--load {directory}: {path} is not a checkpoint of this trainer "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    differing = sorted(
        key
        for key in set(signature) | set(state["signature"])
        if signature.get(key) != state["signature"].get(key)
    )
    if differing:
        details = ", ".join(
            f"{key}: checkpoint {state['signature'].get(key)!r} vs now {signature.get(key)!r}"
            for key in differing
        )
        raise ConfigError(f"--load {directory}: checkpoint of a different model ({details})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
    torch.set_rng_state(state["rng"])
    return TrainingPosition(
        iteration=state["iteration"], consumed_samples=state["consumed_samples"]
    )
