"""Training through ``megatron.training.pretrain``: providers, forward step and step metrics.

How a global batch maps onto Megatron's schedule. Megatron runs a fixed number of micro-batches per
step and rank, ``num_microbatches = global_batch_size / (micro_batch_size x data_parallel_size)``,
and its schedule cannot take a count that changes from step to step. So:

* each data-parallel rank takes its contiguous share of the global batch (``global / dp``
  examples) and, with packing, plans it into rows of at most ``--shared-prefix-capacity`` tokens;
* the rows are padded with empty rows (``batching.empty_row``: one token, no loss edge) to exactly
  ``num_microbatches``; a share that needs more rows is an error naming the flags. With
  ``--micro-batch-size 1`` (the default) that cannot happen, because every example fits a row; a
  larger micro-batch size cuts the number of empty rows once the data's packing ratio is known.
  An empty row costs one forward and backward of a single token per step, on every rank;
* without packing, each micro-batch is ``--micro-batch-size`` examples, dense and right-padded;
* every micro-batch's loss function returns ``(sum of coefficient x loss, units)``. With
  ``--calculate-per-token-loss`` (set by this script) Megatron sums the units over micro-batches
  and data-parallel ranks and divides the gradients by that total: the normalization of loss.py;
* the scheduler increment per step is ``num_microbatches x micro x dp = global batch size``: one
  optimizer step, one LR increment and one logged iteration per original global batch, and
  ``consumed samples`` counts original examples (a resumed run starts at that example).
* the steps are planned ahead in ``--num-workers`` DataLoader worker processes
  (:class:`StepBatches`), so that planning does not hold the training process at each step's start.

Checkpoints are Megatron's, with this package's integrity record (integrity.py) written into
every persistent save before Megatron's tracker names it (:func:`with_integrity_records`), and the
checkpoint ``--load`` names is verified before ``pretrain`` starts, on every rank for its share of
the files.

Step metrics (tokens, saving, tokens/s) are gathered by a :class:`StepMeter` that the data iterator
closes at each step boundary: it all-reduces the per-rank counts over the data-parallel group, and
the last rank writes the log line, JSONL record and TensorBoard scalars next to Megatron's own line.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import os
import pickle
import sys
import time
import warnings
from typing import Callable, Optional

import numpy as np
import torch

from megatron.shared_prefix.training.arguments import (
    apply_pipeline_defaults,
    extra_args_provider,
    megatron_argument_dump,
    parse_without_validation,
)
from megatron.shared_prefix.models.hybrid.hybrid_model import forest_tables
from megatron.shared_prefix.tensors import prepare_forest
from megatron.shared_prefix.training.batching import (
    PackedRow,
    StepBatch,
    build_step_batch,
    empty_row,
)
from megatron.shared_prefix.training.config import BatchConfig, ConfigError, RunConfig
from megatron.shared_prefix.training.data import Dataset, ExampleStream, repetition_warning
from megatron.shared_prefix.training.distributed import mamba_ssm_kernels, pin_triton_ptxas
from megatron.shared_prefix.training.integrity import (
    TRACKER_NAME,
    iteration_dir,
    iteration_to_load,
    write_integrity_record,
)
from megatron.shared_prefix.training.metrics import MetricsWriter, StepMetrics
from megatron.shared_prefix.training.model import (
    build_model,
    forward_micro_batch,
    micro_batch_units,
    mtp_loss_sum,
    precompile_kernels,
    record_mtp_metrics,
    weighted_loss_sum,
)

__all__ = [
    "pad_rows",
    "StepBatches",
    "step_batch_iterator",
    "RowIterator",
    "StepMeter",
    "MegatronSession",
    "with_integrity_records",
    "verify_load_directory",
    "pretrain_with_megatron",
]


def pad_rows(step: StepBatch, num_rows: int, batch: BatchConfig) -> StepBatch:
    """``step`` with empty rows appended up to ``num_rows`` micro-batches.

    Raises:
        ConfigError: when the step already needs more rows than that.
    """
    rows = step.micro_batches
    if len(rows) > num_rows:
        raise ConfigError(
            f"this rank's {step.num_examples} examples of the global batch pack into {len(rows)} "
            f"rows of {batch.capacity} tokens, more than the {num_rows} micro-batches per step "
            f"(--global-batch-size {batch.global_batch_size} / (--micro-batch-size "
            f"{batch.micro_batch_size} x data-parallel size {batch.data_parallel_size})); raise "
            "--shared-prefix-capacity or lower --micro-batch-size"
        )
    padding = tuple(empty_row(batch.pad_multiple) for _ in range(num_rows - len(rows)))
    return StepBatch(
        micro_batches=rows + padding,
        num_examples=step.num_examples,
        logical_tokens=step.logical_tokens,
        executed_tokens=step.executed_tokens + sum(row.num_tokens for row in padding),
        loss_tokens=step.loss_tokens,
        units=step.units,
    )


def rank_step_batch(global_batch, batch: BatchConfig, rank: int) -> StepBatch:
    """Data-parallel rank ``rank``'s share of ``global_batch`` (a list of examples) as its
    micro-batches: packed rows padded to the fixed count per step, or dense micro-batches."""
    share = batch.examples_per_rank
    step = build_step_batch(
        global_batch[rank * share : (rank + 1) * share],
        packing=batch.packing,
        capacity=batch.capacity,
        micro_batch_size=batch.micro_batch_size,
        normalization=batch.normalization,
        pad_multiple=batch.pad_multiple,
    )
    if batch.packing:
        step = pad_rows(step, batch.micro_batches_per_step, batch)
    return step


class StepMeter:
    """Collects one step's counts and loss on every rank; at the step's end, reduces and reports.

    Args:
        writer: where the last rank reports (None on the other ranks).
        train_iters: planned steps (for the log line).
        iteration: steps already done (resume).
        consumed_samples: examples already consumed.
        global_batch_size: examples per step.
        learning_rate: callable returning the learning rate after a step's scheduler increment
            (called once per step), or None.
        group: the data-parallel process group (None: no reduction, one process).
        device: device of the reduction buffer.
        context_group: the context-parallel group, whose ranks each hold part of a row's loss
            (None: no context parallelism).

    With MTP depths the step's ``mtp_k loss`` is reported too, as megatron.training's log computes
    it from MTPLossLoggingHelper (summed over context-parallel ranks, averaged over data-parallel
    ranks, divided by the micro-batches): the helper's values are read after the step's last
    micro-batch, before megatron.training's log clears them.
    """

    def __init__(
        self,
        *,
        writer,
        train_iters,
        iteration,
        consumed_samples,
        global_batch_size,
        learning_rate,
        group,
        device,
        context_group=None,
    ):
        self.writer = writer
        self.train_iters = train_iters
        self.iteration = iteration
        self.consumed_samples = consumed_samples
        self.global_batch_size = global_batch_size
        self.learning_rate = learning_rate
        self.group = group
        self.context_group = context_group
        self.device = device
        self._start = time.perf_counter()
        self._step: Optional[StepBatch] = None
        self._step_start = 0.0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._micro_batches_seen = 0
        self._mtp_values: Optional[torch.Tensor] = None

    @property
    def step(self) -> Optional[StepBatch]:
        """The step whose micro-batches are running (None before the first)."""
        return self._step

    def begin_step(self, step: StepBatch) -> None:
        """Close the running step (if any) and start timing ``step``."""
        self.finish()
        self._step = step
        self._step_start = time.perf_counter()
        self._loss_sum.zero_()
        self._micro_batches_seen = 0
        self._mtp_values = None

    def add_loss(self, loss_sum: torch.Tensor) -> None:
        """Add a micro-batch's weighted loss sum (detached) to the running step; after the step's
        last micro-batch, keep the step's MTP values (:class:`StepMeter`)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        self._loss_sum += loss_sum.detach().to(self._loss_sum.device, torch.float64)
        self._micro_batches_seen += 1
        values = MTPLossLoggingHelper.tracker.get("loss_values")
        if self._step is not None and self._micro_batches_seen == len(self._step.micro_batches):
            if values is not None:
                self._mtp_values = values.detach().to(self.device, torch.float64).clone()

    def _mtp_losses(self, micro_batches: int) -> tuple[float, ...]:
        """The step's ``mtp_k loss`` from the kept values (empty without MTP)."""
        if self._mtp_values is None:
            return ()
        values = self._mtp_values
        if self.context_group is not None and self.context_group.size() > 1:
            torch.distributed.all_reduce(values, group=self.context_group)
        if self.group is not None:
            torch.distributed.all_reduce(values, group=self.group)
            values = values / self.group.size()
        return tuple(float(v) / max(micro_batches, 1) for v in values.tolist())

    def finish(self) -> None:
        """Reduce and report the running step, if any (at the next step's start and at the end)."""
        if self._step is None:
            return
        step, self._step = self._step, None
        mtp_losses = self._mtp_losses(len(step.micro_batches))
        if self.context_group is not None and self.context_group.size() > 1:
            torch.distributed.all_reduce(self._loss_sum, group=self.context_group)
        totals = torch.stack(
            [
                self._loss_sum,
                *(
                    torch.tensor(float(v), dtype=torch.float64, device=self.device)
                    for v in (
                        step.units,
                        step.logical_tokens,
                        step.executed_tokens,
                        step.loss_tokens,
                        len(step.micro_batches),
                    )
                ),
            ]
        )
        if self.group is not None:
            torch.distributed.all_reduce(totals, group=self.group)
        loss_sum, units, logical, executed, loss_tokens, micro_batches = totals.tolist()
        self.iteration += 1
        self.consumed_samples += self.global_batch_size
        now = time.perf_counter()
        learning_rate = self.learning_rate() if self.learning_rate is not None else None
        if self.writer is not None:
            self.writer.write(
                StepMetrics(
                    iteration=self.iteration,
                    train_iters=self.train_iters,
                    consumed_samples=self.consumed_samples,
                    loss=loss_sum / max(units, 1.0),
                    grad_norm=None,
                    learning_rate=learning_rate,
                    logical_tokens=int(logical),
                    executed_tokens=int(executed),
                    loss_tokens=int(loss_tokens),
                    micro_batches=int(micro_batches),
                    step_time_s=now - self._step_start,
                    elapsed_s=now - self._start,
                    mtp_losses=mtp_losses,
                )
            )


class StepBatches(torch.utils.data.IterableDataset):
    """Data-parallel rank ``rank``'s :class:`StepBatch` of every step from ``consumed_samples`` on
    (endless: the stream repeats its epochs).

    Iterated in a DataLoader of N workers, worker ``w`` plans steps ``w, w + N, ...``; the loader
    takes one item from each worker in turn, so the steps arrive in order. A step is a function of
    the consumed-sample count alone, so a resumed run gets the same steps either way.

    With ``forest_tables`` (the model's ``hybrid_model.forest_tables``), every packed row also
    gets its ForestTensors built on the CPU with those tables (``PackedRow.forest``): in a worker,
    that is host work the training process no longer does inside the forward.
    """

    def __init__(
        self,
        stream: ExampleStream,
        batch: BatchConfig,
        *,
        rank: int,
        consumed_samples: int,
        forest_tables: tuple = (),
    ):
        super().__init__()
        self.stream = stream
        self.batch = batch
        self.rank = rank
        self.consumed_samples = consumed_samples
        self.forest_tables = forest_tables

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        step, stride = (0, 1) if worker is None else (worker.id, worker.num_workers)
        while True:
            consumed = self.consumed_samples + step * self.batch.global_batch_size
            planned = rank_step_batch(self.stream.global_batch(consumed), self.batch, self.rank)
            yield with_prepared_forests(planned, self.forest_tables)
            step += stride


def with_prepared_forests(step: StepBatch, tables: tuple) -> StepBatch:
    """``step`` with every packed row's ForestTensors built on the CPU with ``tables``
    (``tensors.prepare_forest``); ``step`` itself when there are no tables."""
    if not tables:
        return step
    micro_batches = tuple(
        dataclasses.replace(row, forest=prepare_forest(row.layout, tables))
        if isinstance(row, PackedRow)
        else row
        for row in step.micro_batches
    )
    return dataclasses.replace(step, micro_batches=micro_batches)


def _tensor_from_array(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array`` (read-only when it is a view of the shared step: nothing
    writes the tables of a prepared forest)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class _ArraysOutOfBand(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays, whose bytes protocol 5 hands out of band (a tensor's
    own pickle carries its bytes in the stream)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _tensor_from_array, (obj.numpy(),)
        return NotImplemented


@dataclasses.dataclass(frozen=True)
class _SharedStep:
    """A StepBatch on its way from a DataLoader worker: its pickle, with every array's bytes
    out of band in one shared-memory tensor.

    By value, a step's arrays would cross the worker's pipe in 64 KiB writes that the training
    process reads one by one: 15-28 ms for a step of 1.2M tokens on a 2-core host, as long as
    planning it. A tensor crosses as one shared-memory handle, and the arrays come back as views
    of it.
    """

    data: bytes
    arrays: torch.Tensor
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, step: StepBatch) -> "_SharedStep":
        """(The DataLoader's collate function, run in the worker.)"""
        buffers = []
        stream = io.BytesIO()
        _ArraysOutOfBand(stream, protocol=5, buffer_callback=buffers.append).dump(step)
        data = stream.getvalue()
        raw = [np.frombuffer(buffer.raw(), dtype=np.uint8) for buffer in buffers]
        arrays = torch.from_numpy(np.concatenate(raw) if raw else np.zeros(0, dtype=np.uint8))
        return cls(data, arrays, tuple(len(r) for r in raw))

    def step(self) -> StepBatch:
        """The StepBatch, its arrays read-only views of the shared tensor."""
        flat = self.arrays.numpy()
        ends = np.cumsum(self.sizes, dtype=np.int64)
        return pickle.loads(
            self.data, buffers=[flat[end - size : end] for size, end in zip(self.sizes, ends)]
        )


def step_batch_iterator(steps: StepBatches, num_workers: int):
    """Iterator over ``steps``: planned in ``num_workers`` DataLoader worker processes (forked, as
    Megatron's own data loaders are), each planning up to two steps ahead; in this process, each
    step when it is asked for, with ``num_workers`` 0."""
    if num_workers == 0:
        return iter(steps)
    loader = torch.utils.data.DataLoader(
        steps,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_SharedStep.of,
        prefetch_factor=2,
        persistent_workers=True,
    )
    return (shared.step() for shared in loader)


class RowIterator:
    """Yields exactly ``batch.micro_batches_per_step`` micro-batches per step of this rank's share.

    Megatron calls ``next`` once per micro-batch, so step ``k``'s micro-batches are consumed before
    step ``k + 1``'s first one is taken; that first ``next`` also closes step ``k`` in the meter.
    With ``batch.num_workers`` > 0 the steps are planned ahead in DataLoader worker processes
    (:func:`step_batch_iterator`): the host work of planning leaves the training process, where it
    would run at the start of every step while the GPU waits (the optimizer step before it
    synchronizes). The workers then also build each row's ``forest_tables`` (the model's
    ``hybrid_model.forest_tables``), which the forward would otherwise build while the GPU waits.
    """

    def __init__(
        self,
        stream: ExampleStream,
        batch: BatchConfig,
        *,
        rank: int,
        consumed_samples: int,
        meter: StepMeter,
        forest_tables: tuple = (),
    ):
        self.stream = stream
        self.batch = batch
        self.rank = rank
        self.consumed_samples = consumed_samples
        self.meter = meter
        self.forest_tables = forest_tables
        self._pending: collections.deque = collections.deque()
        self._steps = None

    def __iter__(self):
        return self

    def __next__(self):
        if not self._pending:
            self._pending.extend(self._next_step().micro_batches)
        return self._pending.popleft()

    def _next_step(self) -> StepBatch:
        """This rank's micro-batches of the next global batch (padded to the fixed count)."""
        if self._steps is None:
            steps = StepBatches(
                self.stream,
                self.batch,
                rank=self.rank,
                consumed_samples=self.consumed_samples,
                # Built in this process, tables would only move host work around.
                forest_tables=self.forest_tables if self.batch.num_workers else (),
            )
            self._steps = step_batch_iterator(steps, self.batch.num_workers)
        step = next(self._steps)
        self.consumed_samples += self.batch.global_batch_size
        self.meter.begin_step(step)
        return step


class _LearningRateProbe:
    """Stand-in optimizer of a second scheduler that Megatron builds from the same arguments, so
    that the JSONL records carry the learning rate Megatron logs (its optimizer is not reachable
    from the providers). It counts every step; only fp16 loss-scale overflows skip one."""

    def __init__(self):
        self.param_groups = [{"default_config": True}]


class MegatronSession:
    """The providers and forward step handed to ``megatron.training.pretrain``, sharing one config,
    dataset and step meter.

    Args:
        config: validated run configuration.
        dataset: the loaded examples (checked before pretrain starts).
        device: device of the micro-batches' tensors (default: the current CUDA device, read when
            first needed, after Megatron has set it).
    """

    def __init__(self, config: RunConfig, dataset: Dataset, device: Optional[torch.device] = None):
        self.config = config
        self.dataset = dataset
        self._device = device
        self.meter: Optional[StepMeter] = None
        self._precompiled = False
        self.forest_tables: tuple = ()

    @property
    def device(self) -> torch.device:
        """Device of this rank's micro-batches."""
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def model_provider(
        self, pre_process=True, post_process=True, config=None, pg_collection=None, vp_stage=None
    ):
        """Megatron model provider: the SharedPrefixHybridModel of the command line."""
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        model = build_model(
            args,
            config if config is not None else core_transformer_config_from_args(args),
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        # Every chunk's tables (virtual pipeline stages build the model a chunk at a time).
        self.forest_tables = tuple(
            dict.fromkeys(self.forest_tables + forest_tables(model, self.device))
        )
        if not self._precompiled:
            # Once per process: a model of virtual pipeline stages is built a chunk at a time.
            from megatron.training.utils import print_rank_0

            precompile_kernels(model, self.config, self.device, print_rank_0)
            self._precompiled = True
        return model

    def datasets_provider(self, _num_samples):
        """Megatron datasets provider: the row iterator for training, no validation or test data.

        The iterator is endless (epochs repeat), so Megatron's sample counts are not needed.
        """
        from megatron.core import parallel_state
        from megatron.training import get_args, get_tensorboard_writer
        from megatron.training.training import get_optimizer_param_scheduler

        args = get_args()
        last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        probe = _LearningRateProbe()
        shadow = get_optimizer_param_scheduler(probe)
        shadow.step(increment=args.consumed_train_samples)

        def learning_rate():
            shadow.step(increment=self.config.batch.global_batch_size)
            return probe.param_groups[0]["lr"]

        writer = None
        if last_rank:
            writer = MetricsWriter(
                log_interval=self.config.logging.log_interval,
                jsonl_path=self.config.logging.metrics_jsonl,
                resume_iteration=args.iteration,
                tensorboard=get_tensorboard_writer(),
            )
        self.meter = StepMeter(
            writer=writer,
            train_iters=args.train_iters,
            iteration=args.iteration,
            consumed_samples=args.consumed_train_samples,
            global_batch_size=self.config.batch.global_batch_size,
            learning_rate=learning_rate,
            group=parallel_state.get_data_parallel_group(),
            context_group=parallel_state.get_context_parallel_group(),
            device=self.device,
        )
        rows = RowIterator(
            ExampleStream(self.dataset, self.config.batch.global_batch_size),
            self.config.batch,
            rank=parallel_state.get_data_parallel_rank(),
            consumed_samples=args.consumed_train_samples,
            meter=self.meter,
            forest_tables=self.forest_tables,
        )
        return rows, None, None

    def distributed_datasets_provider(self):
        """``datasets_provider`` marked ``is_distributed``: megatron.training then builds the
        iterator on every rank, not only on tensor-parallel rank 0, since every tensor-parallel
        rank and pipeline stage needs the row's layout."""

        def provider(num_samples):
            return self.datasets_provider(num_samples)

        provider.is_distributed = True
        return provider

    def forward_step(self, data_iterator, model):
        """Megatron forward step: one micro-batch's per-target losses and its loss function."""
        micro_batch = next(data_iterator)
        losses = forward_micro_batch(model, micro_batch, self.device)
        config = model.config
        mtp_scale = config.mtp_loss_scaling_factor if config.mtp_num_layers else None
        return losses, functools.partial(self.loss_func, micro_batch, mtp_scale=mtp_scale)

    def loss_func(self, micro_batch, losses, *, mtp_scale: Optional[float] = None):
        """(loss sum, units, {'lm loss': [sum, units]}), the ``--calculate-per-token-loss`` form.

        With MTP depths (``mtp_scale``, the model's ``mtp_loss_scaling_factor``) a packed row's
        MTP loss joins the returned sum (model.py) and its metrics go to MTPLossLoggingHelper,
        which megatron.training's log reports as ``mtp_k loss``; the ``lm loss`` report is the
        main loss alone.
        """
        from megatron.core import parallel_state
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        cp_group = parallel_state.get_context_parallel_group()
        loss_sum = weighted_loss_sum(losses, micro_batch, cp_group)
        objective = loss_sum
        if mtp_scale is not None:
            record_mtp_metrics(
                losses,
                micro_batch,
                self.meter.step,
                cp_group,
                parallel_state.get_data_parallel_group(),
            )
            objective = loss_sum + mtp_loss_sum(losses, micro_batch, mtp_scale)
        if self.config.checkpoint.check_finite:
            machine = get_rerun_state_machine()
            machine.validate_result(
                result=objective,
                rejection_func=torch.isnan,
                message="found NaN in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
            machine.validate_result(
                result=objective,
                rejection_func=torch.isinf,
                message="found Inf in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
        units = torch.tensor(
            micro_batch_units(micro_batch, cp_group), dtype=torch.int, device=loss_sum.device
        )
        self.meter.add_loss(loss_sum)
        report = torch.stack([loss_sum.detach().float(), units.float()])
        return objective, units, {"lm loss": report}


def _use_prebuilt_dataset_helpers() -> None:
    """Let megatron.training's start-up ``make`` succeed on a megatron-core wheel.

    ``initialize_megatron`` always runs ``make -C megatron/core/datasets`` to build the C++ dataset
    helpers. The megatron-core 0.19.2 wheel ships them prebuilt (``helpers_cpp``) but not the
    Makefile, so that ``make`` fails and training exits. When the prebuilt module imports and the
    Makefile is absent, GNU make's ``MAKEFILES`` variable points the call at a makefile whose only
    goal does nothing; megatron-core's files are not touched. A source checkout (Makefile present)
    is left to build as usual.
    """
    import importlib.util
    import tempfile

    from megatron.core import datasets

    if os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile")):
        return
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return
    path = os.path.join(tempfile.gettempdir(), "megatron_shared_prefix_prebuilt_helpers.mk")
    with open(path, "w", encoding="utf-8") as makefile:
        makefile.write(".DEFAULT_GOAL := prebuilt\nprebuilt: ;\n")
    os.environ["MAKEFILES"] = path


def with_integrity_records(save_checkpoint: Callable, checkpointing) -> Callable:
    """Megatron's ``save_checkpoint`` with this package's integrity record written before the
    tracker, so that the tracker never names an iteration without a record.

    Megatron's synchronous save (``--async-save`` is refused with ``--save``) writes every rank's
    files, waits at a barrier, and then, on rank 0, calls
    ``checkpointing.get_checkpoint_tracker_filename`` and writes the tracker. During the save that
    function is wrapped so that its first call on rank 0 first records every file of the
    iteration's ``iter_XXXXXXX/``. Should a Megatron version not call it, rank 0 records the files
    after the save instead (then a kill between tracker and record leaves an iteration that
    ``--load`` reports as unfinished). Non-persistent and release saves get no record (``--load``
    does not read them).

    Args:
        save_checkpoint: ``megatron.training.training.save_checkpoint``.
        checkpointing: the module whose ``get_checkpoint_tracker_filename`` Megatron's save calls
            (``megatron.training.checkpointing``).
    """
    tracker_filename = checkpointing.get_checkpoint_tracker_filename

    def rank_0() -> bool:
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    @functools.wraps(save_checkpoint)
    def save(iteration, *args, non_persistent_ckpt=False, release=False, **kwargs):
        if non_persistent_ckpt or release:
            save_checkpoint(
                iteration, *args, non_persistent_ckpt=non_persistent_ckpt, release=release, **kwargs
            )
            return
        recorded = []

        def record_then_tracker(checkpoints_path):
            if rank_0() and not recorded:
                write_integrity_record(iteration_dir(checkpoints_path, iteration), iteration)
                recorded.append(checkpoints_path)
            return tracker_filename(checkpoints_path)

        checkpointing.get_checkpoint_tracker_filename = record_then_tracker
        try:
            save_checkpoint(iteration, *args, non_persistent_ckpt=False, release=False, **kwargs)
        finally:
            checkpointing.get_checkpoint_tracker_filename = tracker_filename
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if rank_0() and not recorded:
            from megatron.training import get_args

            write_integrity_record(iteration_dir(get_args().save, iteration), iteration)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    return save


def verify_load_directory(args) -> Optional[int]:
    """Verify the checkpoint that Megatron will load: ``--load``'s (tracker or ``--ckpt-step``),
    or when that holds none, ``--pretrained-checkpoint``'s (which Megatron then loads as
    ``--finetune``).

    Called before ``pretrain``: each rank (``RANK`` of ``WORLD_SIZE``) hashes its share of the
    files and checks the size of all of them.

    Returns:
        The iteration that will be loaded, or None (nothing to load: training from scratch).

    Raises:
        CheckpointError: naming the bad file, the newest intact iteration and how to load it.
        ConfigError: when ``--pretrained-checkpoint`` is needed and holds no checkpoint.
    """
    shard = (int(os.getenv("RANK", "0")), int(os.getenv("WORLD_SIZE", "1")))
    if args.load:
        iteration = iteration_to_load(args.load, args.ckpt_step, shard=shard)
        if iteration is not None:
            return iteration
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if not pretrained:
        return None
    flag = "--pretrained-checkpoint"
    iteration = iteration_to_load(pretrained, args.ckpt_step, shard=shard, flag=flag)
    if iteration is None:
        raise ConfigError(f"{flag} {pretrained}: no checkpoint there (no {TRACKER_NAME})")
    return iteration


def pretrain_with_megatron() -> None:
    """Parse sys.argv with Megatron's parser and ours, check flags, data and the checkpoint to
    load, then run ``pretrain`` with integrity records after every save."""
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing as megatron_checkpointing
    from megatron.training import pretrain
    from megatron.training import training as megatron_training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.utils import print_rank_0

    pin_triton_ptxas()
    verbose = parse_without_validation(sys.argv[1:]).shared_prefix_verbose
    with megatron_argument_dump(verbose):
        args = parse_and_validate_args(extra_args_provider=extra_args_provider(sys.argv[1:]))
    apply_pipeline_defaults(args)
    config = RunConfig.from_args(
        args, trainer="megatron", data_parallel_size=args.data_parallel_size
    )
    dataset = config.data.load()
    verify_load_directory(args)
    print_rank_0(
        f"[shared-prefix] trainer: megatron.training.pretrain on {args.world_size} GPU(s) "
        f"| packing: {'on' if config.batch.packing else 'off (dense)'} "
        f"| loss normalization: {config.batch.normalization.value} "
        f"| {config.batch.micro_batches_per_step} micro-batches per step and rank "
        f"| Mamba kernels: {mamba_ssm_kernels()}"
    )
    print_rank_0(f"[shared-prefix] data: {dataset.summary()}")
    for note in dataset.notes:
        print_rank_0(f"[shared-prefix] data: {note}")
    warning = repetition_warning(dataset, config.batch.global_batch_size)
    if warning:
        print_rank_0(warning)
    session = MegatronSession(config, dataset)
    _use_prebuilt_dataset_helpers()
    megatron_training.save_checkpoint = with_integrity_records(
        megatron_training.save_checkpoint, megatron_checkpointing
    )
    pretrain(
        pretrain_cfg_container_from_args(args),
        session.distributed_datasets_provider(),
        ModelType.encoder_or_decoder,
        session.forward_step,
        model_provider=session.model_provider,
    )
    if session.meter is not None:
        session.meter.finish()
        if session.meter.writer is not None:
            session.meter.writer.close()
