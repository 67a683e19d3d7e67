"""Validated training configuration, read once from the parsed command line.

Each dataclass groups the settings of one concern and checks them in ``__post_init__``; every
error is a ConfigError (a ValueError) naming the flag to change. :meth:`RunConfig.from_args` builds
them all from Megatron's namespace before any data is read or any model is built, so a bad flag
fails before any state changes. The model itself is configured by Megatron's ``TransformerConfig``
(model.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Callable, Optional

from megatron.shared_prefix.training.data import Dataset, builtin_dataset, load_jsonl_dataset
from megatron.shared_prefix.training.loss import LossNormalization
from megatron.shared_prefix.training.text_data import TextDataConfig, load_text_dataset
from megatron.shared_prefix.training.tokenizer import (
    TokenizerError,
    build_text_tokenizer,
    uses_text_tokenizer,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "BatchConfig",
    "ScheduleConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "RunConfig",
    "LOOP_UNSUPPORTED",
    "check_flags_before_megatron",
]


class ConfigError(ValueError):
    """A flag (or combination of flags) that cannot work; the message names the flag."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where examples come from.

    Attributes:
        data_paths: JSONL files (``--data-path``) consumed in order; empty: the built-in dataset.
        vocab_size: tokenizer vocabulary (``--vocab-size``); every token id must be below it.
        capacity: row capacity, the longest allowed sequence (``--shared-prefix-capacity``).
        drop_overlong: drop and count longer sequences instead of failing.
        seed: seed of the built-in dataset (``--seed``).
        text: tokenizer, supervision and cache of text records (a ``--tokenizer-type`` other than
            NullTokenizer; vocab_size is then the tokenizer's), or None for token ids only.
    """

    data_paths: tuple[str, ...]
    vocab_size: int
    capacity: int
    drop_overlong: bool
    seed: int
    text: Optional[TextDataConfig] = None

    def __post_init__(self):
        _require(self.vocab_size >= 1, f"--vocab-size must be >= 1, got {self.vocab_size}")
        _require(self.capacity >= 1, f"--shared-prefix-capacity must be >= 1, got {self.capacity}")

    def load(self, log: Callable[[str], None] = print) -> Dataset:
        """The dataset, every record checked (a bad one raises DataError naming file and line).

        ``log`` receives the text loader's progress lines (tokenizing, cache).
        """
        if self.data_paths and self.text is not None:
            return load_text_dataset(
                self.data_paths,
                self.text,
                capacity=self.capacity,
                drop_overlong=self.drop_overlong,
                log=log,
            )
        if self.data_paths:
            return load_jsonl_dataset(
                self.data_paths,
                vocab_size=self.vocab_size,
                capacity=self.capacity,
                drop_overlong=self.drop_overlong,
            )
        return builtin_dataset(seed=self.seed, vocab_size=self.vocab_size, capacity=self.capacity)


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How a global batch of examples becomes micro-batches.

    Attributes:
        global_batch_size: original examples per optimizer step (``--global-batch-size``).
        micro_batch_size: dense: examples per micro-batch; packed under megatron.training: sets
            the fixed number of rows per step, ``global / (micro x data-parallel)``
            (``--micro-batch-size``).
        packing: plan prefix forests (``--[no-]shared-prefix-packing``).
        capacity: tokens per packed row (``--shared-prefix-capacity``).
        normalization: loss normalization (``--shared-prefix-loss-normalization``).
        data_parallel_size: data-parallel replicas sharing each global batch.
        pad_multiple: every packed row's length is a multiple of it: the tensor-parallel size
            under ``--sequence-parallel`` times ``2 x --context-parallel-size`` (a row splits into
            equal chunks), the capacity for the allgather MoE dispatcher under expert parallelism
            (it stacks equal-length rows).
        num_workers: data-loader worker processes that plan the coming steps while the current one
            trains, under megatron.training (``--num-workers``); 0 plans each step in the training
            process when its first micro-batch is asked for.
    """

    global_batch_size: int
    micro_batch_size: int
    packing: bool
    capacity: int
    normalization: LossNormalization
    data_parallel_size: int = 1
    pad_multiple: int = 1
    num_workers: int = 0

    def __post_init__(self):
        _require(
            self.global_batch_size >= 1,
            f"--global-batch-size must be >= 1, got {self.global_batch_size}",
        )
        _require(
            self.micro_batch_size >= 1,
            f"--micro-batch-size must be >= 1, got {self.micro_batch_size}",
        )
        _require(self.capacity >= 1, f"--shared-prefix-capacity must be >= 1, got {self.capacity}")
        _require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _require(
            self.capacity % self.pad_multiple == 0,
            f"--shared-prefix-capacity {self.capacity} must be a multiple of "
            f"{self.pad_multiple} (the tensor-parallel size under --sequence-parallel times 2 x "
            "--context-parallel-size: every row splits into equal chunks)",
        )
        per_step = self.micro_batch_size * self.data_parallel_size
        _require(
            self.global_batch_size % per_step == 0,
            f"--global-batch-size {self.global_batch_size} must be a multiple of "
            f"--micro-batch-size {self.micro_batch_size} x data-parallel size "
            f"{self.data_parallel_size}",
        )

    @property
    def examples_per_rank(self) -> int:
        """Examples of each global batch that one data-parallel rank trains on."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def micro_batches_per_step(self) -> int:
        """Megatron's fixed micro-batch count per step and rank: global / (micro x dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Optimizer and learning-rate schedule of the single-process loop (Megatron's flags).

    Warmup, decay and weight-decay increments are counted in examples, as Megatron's
    OptimizerParamScheduler counts samples: ``iterations x global batch size``.
    """

    train_iters: int
    lr: float
    min_lr: float
    lr_warmup_init: float
    lr_warmup_iters: int
    lr_warmup_fraction: Optional[float]
    lr_decay_iters: Optional[int]
    lr_decay_style: str
    lr_wsd_decay_iters: Optional[int]
    lr_wsd_decay_style: str
    weight_decay: float
    start_weight_decay: float
    end_weight_decay: float
    weight_decay_incr_style: str
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float

    def __post_init__(self):
        _require(self.train_iters >= 0, f"--train-iters must be >= 0, got {self.train_iters}")
        _require(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _require(
            0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]"
        )
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(
            self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}"
        )
        if self.train_iters == 0:
            return  # the seed checkpoint: no schedule is built
        decay_iters = self.lr_decay_iters or self.train_iters
        _require(decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {self.lr_decay_iters}")
        _require(
            self.lr_warmup_fraction is not None or self.lr_warmup_iters < decay_iters,
            f"--lr-warmup-iters {self.lr_warmup_iters} must be below the decay length "
            f"{decay_iters} (--lr-decay-iters, default --train-iters)",
        )
        _require(
            self.lr_decay_style != "WSD" or self.lr_wsd_decay_iters is not None,
            "--lr-decay-style WSD needs --lr-wsd-decay-iters",
        )


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Progress output: a log line every ``log_interval`` steps, JSONL and TensorBoard each step."""

    log_interval: int
    metrics_jsonl: Optional[str]
    tensorboard_dir: Optional[str]

    def __post_init__(self):
        _require(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from (both trainers; megatron.training writes its own files).

    Attributes:
        save: directory to save to (``--save``), or None.
        load: directory to resume from (``--load``), or None. It must exist unless it is the
            ``--save`` directory (the auto-resume pattern: the first run starts from scratch).
        save_interval: save every this many iterations (``--save-interval``, which Megatron requires
            with ``--save``), and after the last iteration.
        check_finite: stop at a non-finite loss or gradient norm
            (``--[no-]check-for-nan-in-loss-and-grad``); saving always refuses non-finite state.
        ckpt_step: iteration to load instead of the tracker's (``--ckpt-step``), or None.
        pretrained: a checkpoint to start from when ``load`` holds none
            (``--pretrained-checkpoint``): its weights only, at iteration 0, as ``--finetune``.
        finetune: load the weights only and start at iteration 0 with a fresh optimizer and
            schedule (``--finetune``).
        load_optimizer: restore optimizer and schedule (off: ``--no-load-optim``).
        load_rng: restore the RNG state (off: ``--no-load-rng``).
        exit_interval: stop after an iteration that is a multiple of it, saving first when
            ``save`` is set (``--exit-interval``), or None.
    """

    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    check_finite: bool
    ckpt_step: Optional[int] = None
    pretrained: Optional[str] = None
    finetune: bool = False
    load_optimizer: bool = True
    load_rng: bool = True
    exit_interval: Optional[int] = None

    def __post_init__(self):
        _require(
            self.save_interval is None or self.save_interval >= 1,
            f"--save-interval must be >= 1, got {self.save_interval}",
        )
        _require(
            self.ckpt_step is None or self.load is not None or self.pretrained is not None,
            f"--ckpt-step {self.ckpt_step} needs --load (the directory to load it from)",
        )
        if self.load is not None and not os.path.isdir(self.load):
            _require(
                not os.path.exists(self.load),
                f"--load {self.load}: not a directory (give the checkpoint directory)",
            )
            _require(
                self.save is not None and os.path.abspath(self.save) == os.path.abspath(self.load),
                f"--load {self.load}: no such directory (to start from scratch, leave --load out; "
                "to resume automatically, give the same directory as --save)",
            )
        _require(
            self.pretrained is None or os.path.isdir(self.pretrained),
            f"--pretrained-checkpoint {self.pretrained}: no such directory",
        )
        _require(
            self.exit_interval is None or self.exit_interval >= 1,
            f"--exit-interval must be >= 1, got {self.exit_interval}",
        )


# Megatron flags whose non-default values the single-process loop cannot honour -> the value needed.
LOOP_UNSUPPORTED = {
    "fp16": False,
    "bf16": False,
    "optimizer": "adam",
    "train_samples": None,
    "lr_decay_samples": None,
    "lr_warmup_samples": 0,
    "lr_wsd_decay_samples": None,
    "rampup_batch_size": None,
    "decoupled_lr": None,
    "use_distributed_optimizer": False,
    "use_checkpoint_args": False,
    "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False,
    "ckpt_format": "torch_dist",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything the trainers read besides the model's TransformerConfig.

    ``schedule`` is None under megatron.training, which builds its own optimizer and scheduler.
    """

    trainer: str
    data: DataConfig
    batch: BatchConfig
    schedule: Optional[ScheduleConfig]
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    precompile: str = "off"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, trainer: str, data_parallel_size: int = 1
    ) -> "RunConfig":
        """Build and validate the configuration of ``trainer`` ('megatron' or 'loop') from args.

        Raises:
            ConfigError: naming the flag to change.
        """
        _check_script_invariants(args, trainer)
        _require(
            args.shared_prefix_output_chunk_tokens >= 0,
            f"--shared-prefix-output-chunk-tokens {args.shared_prefix_output_chunk_tokens}: "
            "must be >= 0 (0: the whole row at once)",
        )
        _require(
            not args.shared_prefix_output_chunk_tokens or args.shared_prefix_packing,
            "--shared-prefix-output-chunk-tokens with --no-shared-prefix-packing: dense "
            "micro-batches run megatron-core's own output layer and loss",
        )
        capacity = (
            args.shared_prefix_capacity
            if args.shared_prefix_capacity is not None
            else args.seq_length
        )
        _require(capacity is not None, "--shared-prefix-capacity (or --seq-length) is required")
        _require(
            args.position_embedding_type != "learned_absolute"
            or capacity <= args.max_position_embeddings,
            f"row capacity {capacity} (--shared-prefix-capacity, default --seq-length) exceeds "
            f"--max-position-embeddings {args.max_position_embeddings}: with "
            "--position-embedding-type learned_absolute no position may reach it; lower the "
            "capacity or raise --max-position-embeddings",
        )
        # Checked for megatron.training too, whose scheduler would only assert the same rules
        # after initialization (a sample-based schedule, with no --train-iters, is megatron's).
        schedule = (
            ScheduleConfig(
                train_iters=args.train_iters,
                lr=args.lr,
                min_lr=args.min_lr,
                lr_warmup_init=args.lr_warmup_init,
                lr_warmup_iters=args.lr_warmup_iters,
                lr_warmup_fraction=args.lr_warmup_fraction,
                lr_decay_iters=args.lr_decay_iters,
                lr_decay_style=args.lr_decay_style,
                lr_wsd_decay_iters=args.lr_wsd_decay_iters,
                lr_wsd_decay_style=args.lr_wsd_decay_style,
                weight_decay=args.weight_decay,
                start_weight_decay=args.start_weight_decay,
                end_weight_decay=args.end_weight_decay,
                weight_decay_incr_style=args.weight_decay_incr_style,
                adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2,
                adam_eps=args.adam_eps,
                clip_grad=args.clip_grad,
            )
            if trainer == "loop" or args.train_iters is not None
            else None
        )
        text = _text_config(args, data_parallel_size)
        return cls(
            trainer=trainer,
            data=DataConfig(
                data_paths=tuple(args.data_path or ()),
                vocab_size=text.tokenizer.vocab_size if text else args.vocab_size,
                capacity=capacity,
                drop_overlong=args.shared_prefix_drop_overlong,
                seed=args.seed,
                text=text,
            ),
            batch=BatchConfig(
                global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size,
                packing=args.shared_prefix_packing,
                capacity=capacity,
                normalization=LossNormalization(args.shared_prefix_loss_normalization),
                data_parallel_size=data_parallel_size,
                pad_multiple=row_pad_multiple(args, capacity),
                num_workers=args.num_workers,
            ),
            schedule=schedule if trainer == "loop" else None,
            logging=LoggingConfig(
                log_interval=args.log_interval,
                metrics_jsonl=args.shared_prefix_metrics_jsonl or None,
                tensorboard_dir=args.tensorboard_dir,
            ),
            checkpoint=CheckpointConfig(
                save=args.save,
                load=args.load,
                save_interval=args.save_interval,
                check_finite=args.check_for_nan_in_loss_and_grad,
                ckpt_step=args.ckpt_step,
                pretrained=args.pretrained_checkpoint,
                finetune=bool(args.finetune),
                load_optimizer=not args.no_load_optim,
                load_rng=not args.no_load_rng,
                exit_interval=args.exit_interval,
            ),
            precompile=_precompile_mode(args, trainer),
        )


def _precompile_mode(args: argparse.Namespace, trainer: str) -> str:
    """``--shared-prefix-precompile``, refused where there is no kernel to compile (dense
    micro-batches, or no CUDA)."""
    mode = args.shared_prefix_precompile
    if mode == "off":
        return mode
    flag = f"--shared-prefix-precompile {mode}"
    _require(
        args.shared_prefix_packing,
        f"{flag} with --no-shared-prefix-packing: dense micro-batches run no tree kernels",
    )
    import torch

    _require(
        trainer == "megatron" or torch.cuda.is_available(),
        f"{flag} needs CUDA: the tree attention (FlexAttention) and Mamba (Triton) kernels "
        "compile only there (the CPU runs the torch backends, nothing to compile)",
    )
    return mode


def row_pad_multiple(args: argparse.Namespace, capacity: int) -> int:
    """The multiple every packed row's length is rounded to (BatchConfig.pad_multiple).

    Under ``--shared-prefix-precompile`` it is also a multiple of 16 where the capacity allows:
    a row then pads at most 15 tokens (never a loss source), and its length and the strides
    derived from it fall in one class of Triton's integer specialization per chunk count, so the
    Mamba warm-up runs one row per chunk count instead of five (``scan_warmup_lengths``).
    """
    if args.num_experts and args.expert_model_parallel_size > 1:
        if args.moe_token_dispatcher_type == "allgather":
            return capacity
    multiple = 2 * args.context_parallel_size if args.context_parallel_size > 1 else 1
    if args.sequence_parallel and args.tensor_model_parallel_size > 1:
        multiple *= args.tensor_model_parallel_size
    if args.shared_prefix_precompile != "off" and capacity % math.lcm(multiple, 16) == 0:
        multiple = math.lcm(multiple, 16)
    return multiple


def check_flags_before_megatron(args: argparse.Namespace) -> None:
    """Flag values that Megatron's ``validate_args`` rejects with a bare assert (no message).

    Run on the parsed namespace before ``validate_args``, so the error names the flag.

    Raises:
        ConfigError: naming the flag.
    """
    _require(
        args.micro_batch_size is not None,
        "--micro-batch-size is required (1 fits every packed row; see docs/training.md)",
    )
    for name in ("global_batch_size", "micro_batch_size"):
        value = getattr(args, name)
        _require(value is None or value >= 1, f"{_flag(name)} must be >= 1, got {value}")
    _require(
        args.train_iters is None or args.train_iters >= 0,
        f"--train-iters must be >= 0, got {args.train_iters}",
    )
    _require(
        not args.num_experts or args.num_experts % args.expert_model_parallel_size == 0,
        f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
        f"{args.expert_model_parallel_size} (every expert rank holds the same number of experts)",
    )
    _require(
        args.save_interval is None or args.save_interval >= 1,
        f"--save-interval must be >= 1, got {args.save_interval}",
    )
    _require(
        args.save is None or args.save_interval is not None,
        f"--save {args.save} needs --save-interval N (save every N iterations; the loop also "
        "saves after the last one)",
    )
    _require(
        args.ckpt_step is None or args.ckpt_step >= 0,
        f"--ckpt-step must be >= 0, got {args.ckpt_step}",
    )
    if args.mtp_num_layers:
        pattern = args.hybrid_layer_pattern or ""
        depths = len(pattern.split("/")) - 1 if "/" in pattern else 0
        _require(
            depths == args.mtp_num_layers,
            f"--mtp-num-layers {args.mtp_num_layers} with --hybrid-layer-pattern {pattern!r}, "
            f"which has {depths} MTP depths: megatron-core builds a hybrid model's MTP layers "
            "from the pattern, one '/<layers>' per depth (e.g. "
            f"{(pattern.split('/')[0] or 'M*') + '/*E' * args.mtp_num_layers!r})",
        )


def _text_config(args: argparse.Namespace, data_parallel_size: int) -> Optional[TextDataConfig]:
    """The text-record settings when ``--tokenizer-type`` names a text tokenizer, else None."""
    if not uses_text_tokenizer(args):
        _require(
            args.shared_prefix_supervise == "all-assistant",
            f"--shared-prefix-supervise {args.shared_prefix_supervise}: applies to records read "
            "with a text tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)",
        )
        return None
    _require(
        bool(args.data_path) or args.shared_prefix_supervise == "all-assistant",
        f"--shared-prefix-supervise {args.shared_prefix_supervise}: applies to --data-path records "
        "(the built-in dataset supervises every assistant turn)",
    )
    try:
        tokenizer = build_text_tokenizer(args)
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from None
    return TextDataConfig(
        tokenizer=tokenizer,
        supervise=args.shared_prefix_supervise,
        cache_dir=args.data_cache_path,
        sample_examples=max(1, args.global_batch_size // data_parallel_size),
        rank=args.rank,
        world_size=args.world_size,
    )


def _check_script_invariants(args: argparse.Namespace, trainer: str) -> None:
    """Settings this script's data path and the forest forward rely on."""
    _require(
        args.vocab_size is not None or uses_text_tokenizer(args),
        "--vocab-size is required with --tokenizer-type NullTokenizer (token-id records)",
    )
    _require(args.train_iters is not None or trainer == "megatron", "--train-iters is required")
    _require(
        args.dataloader_type == "external",
        "--dataloader-type must be 'external' (rows come from this script)",
    )
    _require(
        args.calculate_per_token_loss,
        "--calculate-per-token-loss is required (the loss returns sum and units)",
    )
    _require(
        not args.eval_iters,
        f"--eval-iters {args.eval_iters}: validation data is not supported; use 0",
    )
    _require(
        not args.mtp_num_layers or args.shared_prefix_loss_normalization == "token",
        f"--mtp-num-layers {args.mtp_num_layers} with --shared-prefix-loss-normalization "
        "sequence: megatron's MTP loss is a mean per loss token, which the per-sequence "
        "normalization of the main loss would rescale differently in dense and packed "
        "micro-batches; use token normalization",
    )
    _require(
        args.shared_prefix_packing or args.context_parallel_size == 1,
        f"--context-parallel-size {args.context_parallel_size} with --no-shared-prefix-packing: "
        "dense rows under context parallelism need Transformer Engine's attention, which this "
        "script's local spec does not use",
    )
    if args.shared_prefix_packing:
        for name in ("attention_dropout", "hidden_dropout"):
            _require(
                getattr(args, name) == 0,
                f"{_flag(name)} {getattr(args, name)}: must be 0 with --shared-prefix-packing "
                "(sequences sharing a packed token would share its dropout mask)",
            )
        _require(
            not (args.num_experts and args.tensor_model_parallel_size > 1)
            or args.sequence_parallel,
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} with MoE layers "
            "needs --sequence-parallel (as megatron-core requires)",
        )
        mtp_layers = "".join((args.hybrid_layer_pattern or "").split("/")[1:])
        _require(
            "E" not in mtp_layers
            or args.expert_model_parallel_size == 1
            or args.moe_token_dispatcher_type != "allgather",
            f"--expert-model-parallel-size {args.expert_model_parallel_size} with "
            "--moe-token-dispatcher-type allgather and MoE layers in the MTP depths of "
            f"--hybrid-layer-pattern {args.hybrid_layer_pattern!r}: the dispatcher stacks "
            "equal-length rows and the MTP depths' rows differ in length; use alltoall",
        )
        _require(
            args.pipeline_model_parallel_size == 1 or args.moe_token_dispatcher_type != "allgather",
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} with "
            "--moe-token-dispatcher-type allgather: megatron's allgather dispatcher does not "
            "support the variable row lengths a pipeline of forest rows needs; use alltoall",
        )
    if trainer == "loop":
        _require(
            args.train_iters != 0 or args.save is not None,
            "--train-iters 0 without --save does nothing (with --save it writes the seed "
            "checkpoint of iteration 0: the initial weights, loadable at any layout)",
        )
        for name, needed in LOOP_UNSUPPORTED.items():
            value = getattr(args, name)
            _require(
                value == needed,
                f"{_flag(name)} {value}: not supported by the single-process loop "
                "(train through megatron.training on CUDA: --shared-prefix-trainer megatron)",
            )
    else:
        _require(
            args.save is None or args.check_for_nan_in_loss_and_grad,
            "--no-check-for-nan-in-loss-and-grad with --save would let megatron.training save "
            "non-finite weights; keep the check on",
        )
        _require(
            args.save is None or not args.async_save,
            "--async-save with --save: the integrity record of a checkpoint is written after its "
            "files, which an asynchronous save finishes later; save synchronously",
        )
