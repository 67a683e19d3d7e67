"""Training steps of the loop in a torchrun world: tensor, sequence, expert, data and pipeline
parallelism without megatron.training (gloo on CPU, NCCL on CUDA).

megatron.training needs CUDA; this is the same recipe on megatron-core alone, so that the parallel
paths also train on a machine without GPUs (and are tested there):

* the model is built at the layout of the command line on top of :func:`init_parallel`; its
  initial weights are the shards of the TP = PP = EP = 1 model of the same ``--seed``
  (:func:`build_parallel_model`), so every layout starts from the same network;
* megatron's DDP wraps it; each data-parallel rank plans its share of the global batch into the
  fixed number of rows per step that megatron.training uses (``pad_rows``);
* megatron's forward-backward schedule runs the rows (pipelined for PP > 1, variable row lengths)
  with the per-token loss of ``--calculate-per-token-loss``, then ``finalize_model_grads``
  reduces gradients over data-parallel, sequence-parallel and embedding groups and divides them by
  the step's units;
* the gradient norm is the norm of the full model's gradient (each shard counted once), and the
  loop clips and steps its optimizer on this rank's parameters.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist

from megatron.shared_prefix.training.config import BatchConfig
from megatron.shared_prefix.training.megatron_integration import rank_step_batch
from megatron.shared_prefix.training.model import (
    build_model,
    forward_micro_batch,
    micro_batch_units,
    mtp_loss_sum,
    padded_vocab_size,
    record_mtp_metrics,
    transformer_config,
    weighted_loss_sum,
)

__all__ = ["ParallelLayout", "build_parallel_model", "ParallelStepper"]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of a run, from Megatron's flags."""

    tensor: int
    pipeline: int
    expert: int
    expert_tensor: int | None
    sequence_parallel: bool
    context: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelLayout":
        """The layout of ``--tensor-model-parallel-size`` and the other parallel flags."""
        return cls(
            tensor=args.tensor_model_parallel_size,
            pipeline=args.pipeline_model_parallel_size,
            expert=args.expert_model_parallel_size,
            expert_tensor=args.expert_tensor_parallel_size,
            sequence_parallel=args.sequence_parallel,
            context=args.context_parallel_size,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel replicas of this layout in a world of ``world_size`` processes."""
        return world_size // (self.tensor * self.pipeline * self.context)

    def init(self, seed: int) -> torch.device:
        """Initialize megatron's parallel state for this layout; the rank's device."""
        from megatron.shared_prefix.training.distributed import init_parallel

        return init_parallel(
            tensor_model_parallel_size=self.tensor,
            pipeline_model_parallel_size=self.pipeline,
            expert_model_parallel_size=self.expert,
            expert_tensor_parallel_size=self.expert_tensor,
            context_parallel_size=self.context,
            seed=seed,
        )


def _unsharded_args(args: argparse.Namespace, vocab_rows: int) -> argparse.Namespace:
    """``args`` of the same network at TP = PP = EP = 1 (the same padded vocabulary)."""
    full = copy.copy(args)
    full.tensor_model_parallel_size = full.pipeline_model_parallel_size = 1
    full.expert_model_parallel_size, full.expert_tensor_parallel_size = 1, 1
    full.sequence_parallel = False
    full.context_parallel_size = 1
    full.variable_seq_lengths = False
    full.hybrid_layer_pattern = args.hybrid_layer_pattern.replace("|", "")
    full.padded_vocab_size = vocab_rows
    return full


def build_parallel_model(args: argparse.Namespace, layout: ParallelLayout):
    """(this rank's model at ``layout``, its device), initialized from the unsharded model.

    Every rank first builds the TP = PP = EP = 1 model from ``--seed`` (megatron's parallel state
    at TP = 1, the rank a data-parallel replica) and then loads its shard of those weights into the
    model of its stage, so the network is the same at every layout (and the same as a
    single-process run of the same padded vocabulary). The unsharded model is held once per rank
    while the run starts.
    """
    from megatron.core import parallel_state

    from megatron.shared_prefix.tensor_parallel.full_tensors import load_full_tensors
    from megatron.shared_prefix.training.distributed import init_parallel

    vocab_rows = padded_vocab_size(args)
    init_parallel(seed=args.seed)
    full_args = _unsharded_args(args, vocab_rows)
    torch.manual_seed(args.seed)
    full = build_model(full_args, transformer_config(full_args, portable=True))
    weights = {name: param.detach() for name, param in full.named_parameters()}
    del full
    device = layout.init(args.seed)
    sharded = copy.copy(args)
    sharded.padded_vocab_size = vocab_rows
    torch.manual_seed(args.seed)
    model = build_model(
        sharded,
        transformer_config(sharded, portable=True),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    ).to(device)
    load_full_tensors(model, weights)
    return model, device


def _counts_in_norm(name: str, param: torch.nn.Parameter, model) -> bool:
    """Whether this rank's copy of ``param`` is the one counted in the full gradient norm: each
    shard once (data- and context-parallel rank 0; tensor-parallel rank 0 for a replicated
    parameter; not the last stage's copy of a tied embedding)."""
    from megatron.core import parallel_state

    expert = not getattr(param, "allreduce", True)
    if expert:
        replica = parallel_state.get_expert_data_parallel_rank()
        tensor_rank = parallel_state.get_expert_tensor_parallel_rank()
    else:
        replica = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if replica != 0:
        return False
    if not getattr(param, "tensor_model_parallel", False) and tensor_rank != 0:
        return False
    tied_copy = (
        name == "output_layer.weight" and model.share_embeddings_and_output_weights
    ) and not model.pre_process
    return not tied_copy


def clip_full_gradient(model, max_norm: float) -> float:
    """The L2 norm of the full model's gradient (``main_grad``, after finalize_model_grads), all
    ranks together; scales every gradient by ``max_norm / norm`` when the norm exceeds it (as
    megatron's optimizer clips). Returns the norm before clipping."""
    squares = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if _counts_in_norm(name, param, model):
            squares += param.main_grad.double().square().sum()
    dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if 0 < max_norm < norm:
        scale = max_norm / (norm + 1e-6)
        for param in model.parameters():
            param.main_grad.mul_(scale)
    return norm


class ParallelStepper:
    """Forward-backward of one global batch on this rank, through megatron's schedule.

    Args:
        model: this rank's model (:func:`build_parallel_model`).
        batch: the run's batch configuration (its ``data_parallel_size`` is the layout's).
        device: the rank's device.
    """

    def __init__(self, model, batch: BatchConfig, device: torch.device):
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        self.model = model
        self.ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
        )
        self.batch = batch
        self.device = device
        self.data_parallel_rank = parallel_state.get_data_parallel_rank()
        self.data_parallel_group = parallel_state.get_data_parallel_group()
        self.context_parallel_group = parallel_state.get_context_parallel_group()

    def step(self, examples, clip_grad: float) -> tuple[dict, float]:
        """Gradients of one global batch in every parameter's ``.grad`` (clipped).

        Returns:
            (the step's totals over data-parallel ranks: loss, logical/executed/loss tokens and
            micro-batches, identical on every rank of the last stage, and this rank's micro-batch
            count; the gradient norm before clipping).
        """
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        step = rank_step_batch(examples, self.batch, self.data_parallel_rank)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

        cp_group = self.context_parallel_group
        config = self.model.config
        mtp_scale = config.mtp_loss_scaling_factor if config.mtp_num_layers else 0.0

        def loss_func(micro_batch, losses):
            nonlocal loss_sum
            contribution = weighted_loss_sum(losses, micro_batch, cp_group)
            loss_sum = loss_sum + contribution.detach().double()
            record_mtp_metrics(losses, micro_batch, step, cp_group, self.data_parallel_group)
            units = micro_batch_units(micro_batch, cp_group)
            units = torch.tensor(units, dtype=torch.int, device=self.device)
            return (
                contribution + mtp_loss_sum(losses, micro_batch, mtp_scale),
                units,
                {"lm loss": torch.stack([contribution.detach(), units])},
            )

        def forward_step(data_iterator, chunk):
            micro_batch = next(data_iterator)
            output = forward_micro_batch(chunk, micro_batch, self.device)
            return output, functools.partial(loss_func, micro_batch)

        self.ddp.zero_grad_buffer()
        for param in self.model.parameters():
            param.grad = None
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(step.micro_batches),
            model=[self.ddp],
            num_microbatches=len(step.micro_batches),
            seq_length=max(row.num_tokens for row in step.micro_batches),
            micro_batch_size=1,
            forward_only=False,
        )
        # Context-parallel ranks hold parts of one row's loss, and the same row counts.
        dist.all_reduce(loss_sum, group=cp_group)
        totals = torch.tensor(
            [
                float(loss_sum),
                step.units,
                step.logical_tokens,
                step.executed_tokens,
                step.loss_tokens,
                len(step.micro_batches),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(totals, group=self.data_parallel_group)
        # finalize_model_grads sums this rank's units over data x context parallel ranks.
        units = sum(micro_batch_units(row, cp_group) for row in step.micro_batches)
        units = torch.tensor(units, dtype=torch.int, device=self.device)
        finalize_model_grads([self.ddp], num_tokens=units)
        grad_norm = clip_full_gradient(self.model, clip_grad)
        for param in self.model.parameters():
            param.grad = param.main_grad
        loss, units, logical, executed, loss_tokens, micro_batches = totals.tolist()
        return (
            {
                "loss": loss / max(units, 1.0),
                "logical_tokens": int(logical),
                "executed_tokens": int(executed),
                "loss_tokens": int(loss_tokens),
                "micro_batches": int(micro_batches),
                "micro_batches_per_rank": len(step.micro_batches),
            },
            grad_norm,
        )
