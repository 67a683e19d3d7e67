"""Keep the forest in scope while activation recompute re-runs the forward in the backward pass.

(upstream: megatron/core/tensor_parallel/random.py, where CheckpointFunction would capture and
restore the forest scope itself.) megatron-core's CheckpointFunction re-runs checkpointed layers
from
inside ``backward``, after the model's forward has returned and its forest scope has closed. The two
identity functions below bracket the stack in the autograd graph: the one at the stack's output
re-opens the scope when the backward pass reaches it (before any layer's backward), and the one at
the
stack's input closes it once every layer's backward, recomputes included, has run.
"""

import contextvars

import torch

from megatron.shared_prefix.tensors import _ACTIVE_FOREST, ForestTensors


class _ForestScopeState:
    """The forest and the scope token shared by the two brackets of one forward."""

    def __init__(self, forest: ForestTensors):
        self.forest = forest
        self.token: contextvars.Token | None = None


class _CloseScopeInBackward(torch.autograd.Function):
    """Identity at the stack's input; its backward runs after every layer's backward."""

    @staticmethod
    def forward(ctx, hidden_states, _anchor, state):  # pylint: disable=arguments-differ
        ctx.state = state
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        state = ctx.state
        if state.token is not None:
            _ACTIVE_FOREST.reset(state.token)
            state.token = None
        return grad, None, None


class _OpenScopeInBackward(torch.autograd.Function):
    """Identity at the stack's output; its backward runs before any layer's backward."""

    @staticmethod
    def forward(ctx, hidden_states, state):  # pylint: disable=arguments-differ
        ctx.state = state
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        state = ctx.state
        if state.token is None:
            state.token = _ACTIVE_FOREST.set(state.forest)
        return grad, None


def bracket_for_recompute(forest: ForestTensors, device: torch.device):
    """Return ``(enter, leave)``: wrap the stack's input with ``enter`` and its output with
    ``leave``.

    ``enter`` ties a grad-requiring anchor into the graph so that its backward (which closes the
    scope)
    runs even when the stack input needs no gradient.
    """
    state = _ForestScopeState(forest)
    anchor = torch.empty(0, device=device, requires_grad=True)

    def enter(hidden_states: torch.Tensor) -> torch.Tensor:
        return _CloseScopeInBackward.apply(hidden_states, anchor, state)

    def leave(hidden_states: torch.Tensor) -> torch.Tensor:
        return _OpenScopeInBackward.apply(hidden_states, state)

    return enter, leave
