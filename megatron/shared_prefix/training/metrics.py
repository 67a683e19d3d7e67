"""Per-step metrics: Megatron-style log lines, a JSONL file and TensorBoard scalars.

The same :class:`StepMetrics` is produced by both trainers (the loop measures it directly; under
megatron.training the step meter of megatron_integration.py reduces it across data-parallel ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from datetime import datetime
from typing import Callable, Optional

__all__ = ["StepMetrics", "format_log_line", "MetricsWriter", "open_tensorboard"]


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step did (global batch, all data-parallel ranks).

    Attributes:
        iteration: 1-based optimizer step.
        train_iters: planned number of steps.
        consumed_samples: original examples consumed, this step included.
        loss: normalized loss of the global batch (loss.py).
        grad_norm: L2 norm of the gradient before clipping (None where the trainer does not see it).
        learning_rate: learning rate after this step's scheduler increment (what Megatron logs).
        logical_tokens: tokens of the original sequences.
        executed_tokens: tokens the micro-batches ran (padding and empty rows included).
        loss_tokens: supervised targets.
        micro_batches: packed rows (or dense micro-batches) run, summed over ranks.
        step_time_s: wall time of the step.
        elapsed_s: wall time since training started.
        mtp_losses: ``mtp_k loss`` of each MTP depth ``k`` as megatron logs it (empty without MTP).
    """

    iteration: int
    train_iters: int
    consumed_samples: int
    loss: float
    grad_norm: Optional[float]
    learning_rate: Optional[float]
    logical_tokens: int
    executed_tokens: int
    loss_tokens: int
    micro_batches: int
    step_time_s: float
    elapsed_s: float
    mtp_losses: tuple[float, ...] = ()

    @property
    def saving(self) -> float:
        """logical / executed tokens: how many times less work than dense."""
        return self.logical_tokens / max(self.executed_tokens, 1)

    @property
    def logical_tokens_per_s(self) -> float:
        """Original-sequence tokens per second of the step."""
        return self.logical_tokens / max(self.step_time_s, 1e-9)

    @property
    def executed_tokens_per_s(self) -> float:
        """Computed tokens per second of the step."""
        return self.executed_tokens / max(self.step_time_s, 1e-9)

    def as_dict(self) -> dict:
        """The fields plus the derived rates, JSON-ready."""
        record = dataclasses.asdict(self)
        record.update(
            saving=self.saving,
            logical_tokens_per_s=self.logical_tokens_per_s,
            executed_tokens_per_s=self.executed_tokens_per_s,
        )
        return record


def format_log_line(m: StepMetrics) -> str:
    """A Megatron-style progress line for ``m``."""
    parts = [
        f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        f" iteration {m.iteration:8d}/{m.train_iters:8d}",
        f"consumed samples: {m.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {m.step_time_s * 1000.0:.1f}",
    ]
    if m.learning_rate is not None:
        parts.append(f"learning rate: {m.learning_rate:.6E}")
    parts.append(f"lm loss: {m.loss:.6E}")
    parts += [f"mtp_{k + 1} loss: {loss:.6E}" for k, loss in enumerate(m.mtp_losses)]
    if m.grad_norm is not None:
        parts.append(f"grad norm: {m.grad_norm:.3f}")
    parts += [
        f"logical tokens: {m.logical_tokens:d}",
        f"executed tokens: {m.executed_tokens:d}",
        f"loss tokens: {m.loss_tokens:d}",
        f"saving (logical/executed): {m.saving:.2f}x",
        f"logical tokens/s: {m.logical_tokens_per_s:.1f}",
        f"executed tokens/s: {m.executed_tokens_per_s:.1f}",
        f"micro-batches: {m.micro_batches:d}",
        f"elapsed time (s): {m.elapsed_s:.1f}",
    ]
    return " | ".join(parts) + " |"


def open_tensorboard(directory: Optional[str], log: Callable[[str], None] = print):
    """A SummaryWriter for ``directory``, or None (no directory, or tensorboard not installed)."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log(
            f"[shared-prefix] --tensorboard-dir {directory}: the tensorboard package is not "
            "installed (pip install tensorboard); TensorBoard logging is skipped, the JSONL "
            "metrics are still written"
        )
        return None
    return SummaryWriter(log_dir=directory)


_TENSORBOARD_SCALARS = (
    "loss",
    "grad_norm",
    "learning_rate",
    "logical_tokens",
    "executed_tokens",
    "loss_tokens",
    "saving",
    "logical_tokens_per_s",
    "executed_tokens_per_s",
)


class MetricsWriter:
    """Sends every step's metrics to the JSONL file and TensorBoard, and a log line every
    ``log_interval`` steps (and at the first and last step).

    Args:
        log_interval: steps between log lines.
        jsonl_path: JSONL file (parent directories are created), or None.
        resume_iteration: iterations already done (0 for a fresh run). An existing JSONL file
            keeps its records up to this iteration and loses every later one (a resumed run
            writes them again), so no iteration is recorded twice; a fresh run truncates it.
        tensorboard: a SummaryWriter-like object (``add_scalar``), or None.
        log: where log lines go.
    """

    def __init__(
        self,
        *,
        log_interval: int,
        jsonl_path: Optional[str],
        resume_iteration: int,
        tensorboard=None,
        log: Callable[[str], None] = print,
    ):
        self.log_interval = log_interval
        self.tensorboard = tensorboard
        self.log = log
        self.jsonl_path = jsonl_path
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            _truncate_jsonl(jsonl_path, resume_iteration)

    def write(self, m: StepMetrics) -> None:
        """Record one step."""
        record = m.as_dict()
        if self.jsonl_path:
            with open(self.jsonl_path, "a", encoding="utf-8") as jsonl:
                jsonl.write(json.dumps(_json_ready(record)) + "\n")
        if self.tensorboard is not None:
            for name in _TENSORBOARD_SCALARS:
                if record[name] is not None:
                    self.tensorboard.add_scalar(f"shared-prefix/{name}", record[name], m.iteration)
            for k, loss in enumerate(m.mtp_losses):
                self.tensorboard.add_scalar(f"mtp_{k + 1} loss", loss, m.iteration)
        if m.iteration % self.log_interval == 0 or m.iteration in (1, m.train_iters):
            self.log(format_log_line(m))

    def close(self) -> None:
        """Flush TensorBoard (the JSONL file is closed after every record)."""
        if self.tensorboard is not None:
            self.tensorboard.flush()


def _truncate_jsonl(path: str, iteration: int) -> None:
    """Keep the records of ``path`` up to ``iteration``; later records and lines that are not
    records (a line cut short when a run was killed) are removed. The file is rewritten through a
    temporary file and a rename."""
    kept = []
    if iteration > 0 and os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as jsonl:
            for line in jsonl:
                try:
                    record = json.loads(line)
                    done = isinstance(record, dict) and int(record["iteration"]) <= iteration
                except (ValueError, KeyError, TypeError):
                    done = False
                if done:
                    kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as jsonl:
        jsonl.writelines(kept)
    os.replace(path + ".tmp", path)


def _json_ready(record: dict) -> dict:
    """Non-finite floats as strings ("nan", "inf"): JSON has no literal for them."""

    def ready(value):
        if isinstance(value, (tuple, list)):
            return [ready(v) for v in value]
        return str(value) if isinstance(value, float) and not math.isfinite(value) else value

    return {k: ready(v) for k, v in record.items()}
