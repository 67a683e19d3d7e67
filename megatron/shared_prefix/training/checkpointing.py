"""Checkpoints of the single-process loop (megatron.training saves and loads its own).

Layout follows Megatron's: ``<dir>/iter_0000010/model_optim_rng.pt`` and
``<dir>/latest_checkpointed_iteration.txt``. A checkpoint holds the model, the optimizer, the LR
scheduler, the torch RNG state, the training position (iteration and consumed examples) and the
model signature (the flags that shape the network), which must match on load. Saving refuses
non-finite state: a checkpoint is never written after a non-finite loss or gradient norm, or with
non-finite parameters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch

from megatron.shared_prefix.training.config import ConfigError

__all__ = [
    "TrainingPosition",
    "save_checkpoint",
    "load_checkpoint",
    "latest_iteration",
    "NonFiniteStateError",
]

_TRACKER = "latest_checkpointed_iteration.txt"
_FILE = "model_optim_rng.pt"


class NonFiniteStateError(RuntimeError):
    """Training state is not finite; nothing is saved."""


@dataclasses.dataclass(frozen=True)
class TrainingPosition:
    """Where training stands: optimizer steps done and original examples consumed."""

    iteration: int
    consumed_samples: int


def _iteration_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration recorded in ``directory``'s tracker file, or None when there is none."""
    tracker = os.path.join(directory, _TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {directory}: {_TRACKER} holds {text!r}, not an iteration number")
    return int(text)


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

    ``loss`` and ``grad_norm`` are the last step's. The file is written under a temporary name and
    renamed, and the tracker is updated last, so an interrupted save never leaves a readable half.

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
    target = _iteration_dir(directory, position.iteration)
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
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    with open(os.path.join(directory, _TRACKER) + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(str(position.iteration))
    os.replace(os.path.join(directory, _TRACKER) + ".tmp", os.path.join(directory, _TRACKER))
    return path


def load_checkpoint(
    directory: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    signature: dict,
) -> Optional[TrainingPosition]:
    """Restore the latest checkpoint of ``directory`` into the given objects.

    Returns:
        The restored position, or None when ``directory`` holds no checkpoint (training starts
        fresh, as Megatron does).

    Raises:
        ConfigError: when the checkpoint was made for a different network (names the flags).
    """
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    path = os.path.join(_iteration_dir(directory, iteration), _FILE)
    state = torch.load(path, map_location="cpu", weights_only=True)
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
