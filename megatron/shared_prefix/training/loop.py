"""The training loop: megatron.training's model, data and loss, without CUDA.

pretrain_hybrid.py uses it where megatron.training cannot run (no CUDA), or when asked to with
``--shared-prefix-trainer loop``. It runs as one process, or under torchrun with Megatron's
parallel flags (tensor, sequence, expert, data and pipeline parallelism on gloo; see
``parallel.py``). One iteration:

1. take the next global batch of examples (``ExampleStream``, positioned by consumed examples);
2. turn it into micro-batches: packed rows, or dense padded batches (``build_step_batch``);
3. for each micro-batch: forward, ``sum(coefficients * losses) / step units``, backward (gradients
   accumulate, so the summed gradient is the normalized loss's); with MTP depths, megatron's MTP
   loss (model.py) joins it with the same divisor, and its ``mtp_k loss`` is logged;
4. clip, one optimizer step, one LR-scheduler increment of ``global batch size`` examples, one
   metrics record; save a checkpoint at ``--save-interval``.

Optimizer and schedule follow Megatron's flags: AdamW (Megatron's ``adam``) without weight decay on
biases and norms, and megatron-core's OptimizerParamScheduler counted in examples.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Optional, Sequence

import torch

from megatron.shared_prefix.training.arguments import parse_arguments
from megatron.shared_prefix.training.batching import StepBatch, build_step_batch
from megatron.shared_prefix.training.checkpointing import (
    CheckpointHeader,
    TrainingPosition,
    check_signature,
    load_checkpoint,
    read_header,
    save_checkpoint,
)
from megatron.shared_prefix.training.config import ConfigError, RunConfig, ScheduleConfig
from megatron.shared_prefix.training.data import ExampleStream, repetition_warning
from megatron.shared_prefix.training.distributed import (
    init_single_process,
    mamba_ssm_kernels,
    shutdown_parallel,
)
from megatron.shared_prefix.training.integrity import iteration_to_load
from megatron.shared_prefix.training.metrics import MetricsWriter, StepMetrics, open_tensorboard
from megatron.shared_prefix.training.model import (
    build_model,
    forward_micro_batch,
    mtp_loss_sum,
    padded_vocab_size,
    precompile_kernels,
    record_mtp_metrics,
    report_mtp_losses,
    transformer_config,
    weighted_loss_sum,
)
from megatron.shared_prefix.training.parallel import (
    ParallelLayout,
    ParallelStepper,
    build_parallel_model,
)

__all__ = ["run", "train_step", "build_optimizer", "build_scheduler", "model_signature"]

# Megatron flags that shape the network (stored in checkpoints and checked on load).
_SIGNATURE_FLAGS = (
    "hybrid_layer_pattern",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "vocab_size",
    "padded_vocab_size",
    "position_embedding_type",
    "normalization",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "swiglu",
    "mtp_use_repeated_layer",
)


def model_signature(args) -> dict:
    """Flag -> value for every flag that shapes the network, independent of the parallel layout:
    the pattern without its pipeline-stage marks ``|``, and the vocabulary's padded size as built
    (``args.padded_vocab_size``, set by :func:`run`)."""
    signature = {"--" + name.replace("_", "-"): getattr(args, name) for name in _SIGNATURE_FLAGS}
    signature["--hybrid-layer-pattern"] = args.hybrid_layer_pattern.replace("|", "")
    return signature


def _checkpoint_to_load(checkpoint) -> Optional[CheckpointHeader]:
    """The header of what the run starts from, verified: ``--load``'s checkpoint, or when that
    directory holds none (or is not given), ``--pretrained-checkpoint``'s, as in Megatron.

    Raises:
        CheckpointError: naming the damaged file and the way forward.
        ConfigError: when ``--pretrained-checkpoint`` holds no checkpoint.
    """
    if checkpoint.load:
        iteration = iteration_to_load(checkpoint.load, checkpoint.ckpt_step)
        if iteration is not None:
            return read_header(checkpoint.load, iteration)
    if not checkpoint.pretrained:
        return None
    flag = "--pretrained-checkpoint"
    iteration = iteration_to_load(checkpoint.pretrained, checkpoint.ckpt_step, flag=flag)
    if iteration is None:
        raise ConfigError(
            f"{flag} {checkpoint.pretrained}: no checkpoint there (no "
            "latest_checkpointed_iteration.txt; name an iteration with --ckpt-step)"
        )
    return read_header(checkpoint.pretrained, iteration, flag)


def _match_vocabulary(args, header: CheckpointHeader, log: Callable[[str], None]) -> None:
    """Build the checkpoint's padded vocabulary when it differs from this layout's padding but is
    divisible by the TP size (megatron pads the vocabulary to a multiple of
    ``--make-vocab-size-divisible-by`` x TP, so loading at another TP size would otherwise change
    the embedding's rows).

    Raises:
        ConfigError: when the checkpoint's rows cannot be split over this TP size.
    """
    saved = header.signature.get("--padded-vocab-size")
    if saved is None or saved == args.padded_vocab_size:
        return
    tensor = args.tensor_model_parallel_size
    if saved % tensor:
        raise ConfigError(
            f"{header.flag} {header.directory}: its padded vocabulary of {saved} rows cannot be "
            f"split over --tensor-model-parallel-size {tensor}; load it at a TP size that "
            f"divides {saved}"
        )
    log(
        f"[shared-prefix] {header.flag} {header.directory}: keeping its padded vocabulary of "
        f"{saved} rows (--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} at "
        f"TP {tensor} would pad to {args.padded_vocab_size})"
    )
    args.padded_vocab_size = saved


def build_optimizer(model: torch.nn.Module, schedule: ScheduleConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only (``wd_mult`` 0 on biases and norms, as in Megatron)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    groups = [
        {"params": decay, "wd_mult": 1.0, "default_config": True},
        {"params": no_decay, "wd_mult": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=schedule.lr,
        betas=(schedule.adam_beta1, schedule.adam_beta2),
        eps=schedule.adam_eps,
        weight_decay=schedule.weight_decay,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: ScheduleConfig, global_batch_size: int
):
    """megatron-core's OptimizerParamScheduler, counted in examples as Megatron counts samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = (schedule.lr_decay_iters or schedule.train_iters) * global_batch_size
    if schedule.lr_warmup_fraction is not None:
        warmup_steps = schedule.lr_warmup_fraction * decay_steps
    else:
        warmup_steps = schedule.lr_warmup_iters * global_batch_size
    wsd_steps = None
    if schedule.lr_wsd_decay_iters is not None:
        wsd_steps = schedule.lr_wsd_decay_iters * global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.lr_warmup_init,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.lr_decay_style,
        start_wd=schedule.start_weight_decay,
        end_wd=schedule.end_weight_decay,
        wd_incr_steps=schedule.train_iters * global_batch_size,
        wd_incr_style=schedule.weight_decay_incr_style,
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=schedule.lr_wsd_decay_style,
    )


def train_step(
    model: torch.nn.Module, step: StepBatch, *, clip_grad: float, device: torch.device
) -> tuple[float, float]:
    """Forward and backward over every micro-batch of ``step``, then clip; no optimizer step.

    With MTP depths the MTP loss joins each micro-batch's (model.py) and its metrics go to
    MTPLossLoggingHelper (``report_mtp_losses`` reads them).

    Returns:
        (loss, gradient norm before clipping). Gradients are left in ``.grad``.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    divisor = max(step.units, 1)
    mtp_scale = model.config.mtp_loss_scaling_factor if model.config.mtp_num_layers else 0.0
    # A dense micro-batch attaches megatron's MTP loss to its output, scaled in the backward pass
    # by this; megatron.training sets it to 1 and divides every gradient by the step's units.
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / divisor, device=device))
    loss = 0.0
    for micro_batch in step.micro_batches:
        losses = forward_micro_batch(model, micro_batch, device)
        contribution = weighted_loss_sum(losses, micro_batch) / divisor
        (contribution + mtp_loss_sum(losses, micro_batch, mtp_scale) / divisor).backward()
        record_mtp_metrics(losses, micro_batch, step, None, None)
        loss += float(contribution.detach())
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = clip_grad if clip_grad > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return loss, grad_norm


def run(argv: Sequence[str], log: Callable[[str], None] = print) -> list[StepMetrics]:
    """Parse ``argv``, train with the loop (one process or a torchrun world), return the metrics
    of every step run.

    Everything that can be rejected (flags, data records, the checkpoint's integrity and
    signature) is checked before the first optimizer step and before any file is written.
    """
    args = parse_arguments(argv)
    layout = ParallelLayout.from_args(args)
    config = RunConfig.from_args(
        args, trainer="loop", data_parallel_size=layout.data_parallel_size(args.world_size)
    )
    if args.rank != args.world_size - 1:
        log = _quiet
    dataset = config.data.load(log)
    header = _checkpoint_to_load(config.checkpoint)
    args.padded_vocab_size = padded_vocab_size(args)
    if header is not None:
        _match_vocabulary(args, header, log)
        check_signature(header, model_signature(args))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    where = device.type
    if device.type == "cpu":
        # Small models gain nothing from splitting kernels across threads, and OpenMP threads that
        # spin-wait for cores shared with other processes make steps several times slower.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        where = (
            f"cpu, {torch.get_num_threads()} thread(s) (OMP_NUM_THREADS sets it; "
            "megatron.training needs CUDA)"
        )
    processes = "single-process loop"
    if args.world_size > 1:
        processes = (
            f"loop of {args.world_size} processes (TP {layout.tensor}"
            f"{' + SP' if layout.sequence_parallel else ''}, PP {layout.pipeline}, EP "
            f"{layout.expert}, CP {layout.context}, DP {config.batch.data_parallel_size})"
        )
    log(
        f"[shared-prefix] trainer: {processes} on {where}"
        f" | packing: {'on' if config.batch.packing else 'off (dense)'}"
        f" | loss normalization: {config.batch.normalization.value}"
        f" | Mamba kernels: {mamba_ssm_kernels()}"
    )
    log(f"[shared-prefix] data: {dataset.summary()}")
    for note in dataset.notes:
        log(f"[shared-prefix] data: {note}")
    warning = repetition_warning(dataset, config.batch.global_batch_size)
    if warning:
        log(warning)
    # A torchrun world this run joins is this run's to tear down (shutdown_parallel says why).
    owns_world = args.world_size > 1 and not torch.distributed.is_initialized()
    finished = False
    try:
        trainer = _Trainer(args, config, device, log)
        metrics = trainer.train(ExampleStream(dataset, config.batch.global_batch_size), header)
        finished = True
        return metrics
    finally:
        torch.set_num_threads(threads)
        if owns_world:
            shutdown_parallel(synchronize=finished)


def _quiet(_line: str) -> None:
    """The log of every rank but the last: the last one reports for the world."""


class _Trainer:
    """Model, optimizer and scheduler of one run, and the loop over its global batches."""

    def __init__(self, args, config: RunConfig, device: torch.device, log: Callable[[str], None]):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        # megatron-core's MTP metrics are process-global, sized by the first model that records:
        # this run's model is that model.
        MTPLossLoggingHelper.tracker.clear()
        self.stepper = None
        # The last rank (last pipeline stage) reports for the world.
        self.reporting = args.rank == args.world_size - 1
        layout = ParallelLayout.from_args(args)
        if args.world_size > 1:
            self.model, device = build_parallel_model(args, layout)
            self.stepper = ParallelStepper(self.model, config.batch, device)
        else:
            init_single_process(device, args.seed)
            torch.manual_seed(args.seed)
            self.model = build_model(args, transformer_config(args, portable=True)).to(device)
        self.layout = {**dataclasses.asdict(layout), "world_size": args.world_size}
        self.optimizer = build_optimizer(self.model, config.schedule)
        # --train-iters 0 only writes the seed checkpoint: there is no schedule to build.
        self.scheduler = (
            build_scheduler(self.optimizer, config.schedule, config.batch.global_batch_size)
            if config.schedule.train_iters
            else None
        )
        self.signature = model_signature(args)
        self.args = args
        self.config = config
        self.device = device
        self.log = log
        log(
            f"[shared-prefix] model: pattern {args.hybrid_layer_pattern}, hidden {args.hidden_size}"
            f", {sum(p.numel() for p in self.model.parameters()):,} parameters | global batch "
            f"{config.batch.global_batch_size} examples, row capacity {config.batch.capacity} "
            "tokens"
        )
        precompile_kernels(self.model, config, device, log)

    def _resume(self, header: Optional[CheckpointHeader]) -> TrainingPosition:
        """Restore what ``header`` describes (signature checked) and return the position to start
        from; the beginning when ``header`` is None (no ``--load``, or nothing saved in it yet).

        ``--finetune`` and ``--pretrained-checkpoint`` load the weights only and start at
        iteration 0; ``--no-load-optim`` keeps the position but starts a fresh optimizer and
        schedule, and ``--no-load-rng`` the RNG, as in megatron.training. The seed checkpoint
        (iteration 0) holds weights only, which is the whole state at iteration 0.
        """
        checkpoint = self.config.checkpoint
        if header is None:
            if checkpoint.load:
                self.log(
                    f"[shared-prefix] --load {checkpoint.load}: no checkpoint yet, starting from "
                    "scratch"
                )
            return TrainingPosition(iteration=0, consumed_samples=0)
        weights_only = (
            checkpoint.finetune
            or header.flag == "--pretrained-checkpoint"
            or header.position.iteration == 0
        )
        restore_optimizer = not weights_only and checkpoint.load_optimizer
        note = load_checkpoint(
            header,
            model=self.model,
            optimizer=self.optimizer if restore_optimizer else None,
            scheduler=self.scheduler if restore_optimizer else None,
            layout=self.layout,
            load_rng=not weights_only and checkpoint.load_rng,
        )
        if note:
            self.log(f"[shared-prefix] {header.flag} {header.directory}: {note}")
        if weights_only:
            self.log(
                f"[shared-prefix] started from the weights of {header.directory} iteration "
                f"{header.position.iteration} (fresh optimizer and schedule, iteration 0)"
            )
            return TrainingPosition(iteration=0, consumed_samples=0)
        self.log(
            f"[shared-prefix] resumed from {header.directory} at iteration "
            f"{header.position.iteration}"
            + ("" if restore_optimizer else " (fresh optimizer and schedule: --no-load-optim)")
        )
        return header.position

    def train(
        self, stream: ExampleStream, header: Optional[CheckpointHeader] = None
    ) -> list[StepMetrics]:
        """Start from the checkpoint ``header`` describes (verified) if given, run to
        ``--train-iters`` (or ``--exit-interval``); save at ``--save-interval`` and after the last
        step. ``--train-iters 0`` saves the seed checkpoint of iteration 0 and returns."""
        position = self._resume(header)
        if self.config.schedule.train_iters == 0:
            self._save(position, loss=0.0, grad_norm=0.0)
            return []
        logging = self.config.logging
        writer = MetricsWriter(
            log_interval=logging.log_interval,
            jsonl_path=logging.metrics_jsonl if self.reporting else None,
            resume_iteration=position.iteration,
            tensorboard=(
                open_tensorboard(logging.tensorboard_dir, self.log) if self.reporting else None
            ),
            log=self.log,
        )
        history: list[StepMetrics] = []
        start = time.perf_counter()
        self.model.train()
        try:
            for iteration in range(position.iteration + 1, self.config.schedule.train_iters + 1):
                step_start = time.perf_counter()
                examples = stream.global_batch(position.consumed_samples)
                totals, grad_norm = self._step(iteration, examples)
                position = TrainingPosition(iteration, position.consumed_samples + len(examples))
                now = time.perf_counter()
                metrics = StepMetrics(
                    iteration=iteration,
                    train_iters=self.config.schedule.train_iters,
                    consumed_samples=position.consumed_samples,
                    grad_norm=grad_norm,
                    learning_rate=self.optimizer.param_groups[0]["lr"],
                    step_time_s=now - step_start,
                    elapsed_s=now - start,
                    **totals,
                )
                writer.write(metrics)
                history.append(metrics)
                exit_interval = self.config.checkpoint.exit_interval
                stop = bool(exit_interval) and iteration % exit_interval == 0
                self._maybe_save(position, metrics, stop)
                if stop:
                    self.log(
                        f"[shared-prefix] exiting after iteration {iteration} (--exit-interval)"
                    )
                    break
        finally:
            writer.close()
        return history

    def _step(self, iteration: int, examples) -> tuple[dict, float]:
        """One optimizer step and scheduler increment on one global batch of examples.

        Returns:
            (the step's loss and token counts, as StepMetrics fields; the gradient norm before
            clipping).
        """
        batch = self.config.batch
        if self.stepper is not None:
            totals, grad_norm = self.stepper.step(examples, self.config.schedule.clip_grad)
        else:
            totals, grad_norm = self._single_process_step(examples)
        totals["mtp_losses"] = report_mtp_losses(
            self.model.config.mtp_num_layers, totals["micro_batches_per_rank"], iteration
        )
        del totals["micro_batches_per_rank"]
        loss = totals["loss"]
        if self.config.checkpoint.check_finite and not math.isfinite(loss + grad_norm):
            raise FloatingPointError(
                f"iteration {iteration}: lm loss {loss}, grad norm {grad_norm} is not finite; "
                "stopped before the optimizer step (the last checkpoint, if any, is intact)"
            )
        self.optimizer.step()
        self.scheduler.step(increment=batch.global_batch_size)
        return totals, grad_norm

    def _single_process_step(self, examples) -> tuple[dict, float]:
        batch = self.config.batch
        step = build_step_batch(
            examples,
            packing=batch.packing,
            capacity=batch.capacity,
            micro_batch_size=batch.micro_batch_size,
            normalization=batch.normalization,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss, grad_norm = train_step(
            self.model, step, clip_grad=self.config.schedule.clip_grad, device=self.device
        )
        totals = {
            "loss": loss,
            "logical_tokens": step.logical_tokens,
            "executed_tokens": step.executed_tokens,
            "loss_tokens": step.loss_tokens,
            "micro_batches": len(step.micro_batches),
            "micro_batches_per_rank": len(step.micro_batches),
        }
        return totals, grad_norm

    def _maybe_save(self, position: TrainingPosition, metrics: StepMetrics, stop: bool) -> None:
        """Save at every ``--save-interval`` iterations, after the last one, and before an exit
        (``stop``)."""
        checkpoint = self.config.checkpoint
        last = position.iteration == metrics.train_iters
        due = position.iteration % checkpoint.save_interval == 0 if checkpoint.save else False
        if checkpoint.save and (due or last or stop):
            self._save(position, loss=metrics.loss, grad_norm=metrics.grad_norm)

    def _save(self, position: TrainingPosition, *, loss: float, grad_norm: float) -> None:
        path = save_checkpoint(
            self.config.checkpoint.save,
            position,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            signature=self.signature,
            layout=self.layout,
            args=self.args,
            loss=loss,
            grad_norm=grad_norm,
        )
        self.log(f"[shared-prefix] saved checkpoint at iteration {position.iteration} to {path}")
