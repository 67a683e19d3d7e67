"""Routed experts that take their per-expert token counts on the device (upstream:
megatron/core/transformer/moe/experts.py).

megatron-core's SequentialMLP runs one MLP per expert and splits its input by
``tokens_per_expert.tolist()``: a device-to-host copy that waits for the GPU to finish every kernel
queued before it. The GPU then idles until the host has queued the rest of the step again, which on
a forest row (a few thousand tokens, host-heavy Mamba layers) never happens before the step ends.

:class:`ForestSequentialMLP` keeps SequentialMLP's parameters, checkpoints and dense behaviour, and
on a forest runs all experts as two grouped GEMMs whose group boundaries are read on the device
(``torch.nn.functional.grouped_mm``): nothing waits for the GPU. Per token it computes what the
expert's MLP computes (fc1, activation or gated linear unit, the routing probability, fc2, in the
same order and dtypes); only the GEMM kernel differs.

The grouped GEMM needs the experts' weights stacked into one [E, out, in] tensor. Autograd through
``torch.stack`` would keep that copy until the backward (all local experts' fc1 and fc2 weights, per
MoE layer and micro-batch); :class:`StackedExpertsLinear` stacks them again in the backward instead.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron.shared_prefix.tensors import current_forest

# torch.nn.functional.grouped_mm is the public name from PyTorch 2.10; torch._grouped_mm before.
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_experts_errors(config, experts: SequentialMLP) -> list[str]:
    """Why ``experts`` cannot run as grouped GEMMs (empty: they can).

    The grouped path reproduces megatron-core's unfused MLP of local linear layers without biases;
    every other setting keeps SequentialMLP's own loop.
    """
    errors = []
    if config.fp8 or config.fp4:
        errors.append("fp8/fp4 expert GEMMs")
    if config.add_bias_linear:
        errors.append("expert biases (add_bias_linear=True)")
    if config.bias_activation_fusion or config.use_te_activation_func:
        errors.append("a fused or Transformer Engine activation")
    if config.moe_apply_probs_on_input:
        errors.append("moe_apply_probs_on_input=True")
    if config.delay_wgrad_compute:
        errors.append("delay_wgrad_compute=True")
    for expert in experts.local_experts:
        if type(expert.linear_fc1) is not ColumnParallelLinear or (
            type(expert.linear_fc2) is not RowParallelLinear
        ):
            errors.append("expert linear layers other than megatron-core's local ones")
            break
    return errors


def grouped_mm_supports(x: torch.Tensor) -> bool:
    """Whether PyTorch's grouped GEMM runs ``x``: any float on CPU, bfloat16 on CUDA GPUs of compute
    capability 8.0 and newer."""
    if x.device.type == "cpu":
        return x.is_floating_point()
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


class StackedExpertsLinear(torch.autograd.Function):
    """``x @ weights[e].T`` for the rows of each expert ``e``, as one grouped GEMM that keeps no
    stacked copy of the weights for the backward.

    Forward: ``x`` [N, in] sorted by expert, ``offsets`` [E] int32 (the end row of each expert's
    group), one weight [out, in] per expert; returns [N, out]. The weights are stacked for the GEMM
    and the stack is freed with the forward; the backward stacks them again (one copy of E x out x
    in elements) rather than holding it from forward to backward.

    The gradients are those autograd gives ``grouped_mm(x, torch.stack(weights).transpose(1, 2),
    offs=offsets)``: the same grouped GEMMs on operands of the same layouts (PyTorch's derivative
    of a grouped GEMM picks its operands by the inputs' strides), so the two agree bitwise.
    """

    @staticmethod
    def forward(ctx, x, offsets, *weights):  # pylint: disable=arguments-differ
        x = x.contiguous()  # row-major: the layout whose input gradient is grad @ W
        ctx.save_for_backward(x, offsets, *weights)
        return grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad_output):  # pylint: disable=arguments-differ
        x, offsets, *weights = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_output, torch.stack(weights), offs=offsets)
        if any(ctx.needs_input_grad[2:]):
            # [E, out, in]: each expert's rows of grad_output^T @ x.
            grad_weights = grouped_mm(grad_output.t(), x, offs=offsets).unbind(0)
        else:
            grad_weights = (None,) * len(weights)
        return grad_x, None, *grad_weights


class ForestSequentialMLP(SequentialMLP):
    """SequentialMLP that, on a forest, runs its experts as grouped GEMMs without a host sync.

    Without a forest in scope, or with a setting :func:`grouped_experts_errors` names, the forward
    is SequentialMLP's. Parameters stay the experts' own (``local_experts.<i>.linear_fc1.weight``
    [ffn, hidden], ``linear_fc2.weight`` [hidden, ffn]): they are stacked per call
    (:class:`StackedExpertsLinear`), so state dicts, distributed checkpoints and optimizer state are
    SequentialMLP's.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__(num_local_experts, config, submodules, pg_collection, name)
        self.grouped_errors = grouped_experts_errors(self.config, self)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """Expert outputs [N, hidden] for the permuted tokens [N, hidden] (sorted by expert,
        ``tokens_per_expert`` [E] of them each, on the device or the host) and their routing
        probabilities [N]; the bias output is None, as SequentialMLP's."""
        x = permuted_local_hidden_states
        if current_forest() is None or self.grouped_errors or not grouped_mm_supports(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        offsets = tokens_per_expert.to(x.device, non_blocking=True).cumsum(0).to(torch.int32)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        intermediate = StackedExpertsLinear.apply(x, offsets, *fc1)  # [N, ffn (x2 if gated)]
        intermediate = self._activation(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return StackedExpertsLinear.apply(intermediate, offsets, *fc2), None

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """The expert MLP's unfused activation (megatron-core's MLP.forward without fusion)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(intermediate)
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)
