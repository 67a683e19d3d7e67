"""Dense reference of forest forwards: each sequence run alone through megatron-core's HybridModel path."""

import contextlib

import numpy as np
import torch

# docs/api.md, exactness contract: float32 on CPU, relative L2 error of the per-edge losses and of every gradient.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4


def dense_token_losses(model, sequence):
    """[len(sequence)] dense loss: entry j is -log p(sequence[j] | sequence[:j]) (entry 0 is NaN)."""
    device = next(model.parameters()).device
    tokens = torch.as_tensor(np.asarray(sequence), dtype=torch.long, device=device).unsqueeze(0)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0)
    labels = torch.roll(tokens, shifts=-1, dims=1)
    loss = model(tokens, positions, None, labels=labels)[0]
    nan = torch.full((1,), float("nan"), dtype=loss.dtype, device=device)
    return torch.cat([nan, loss[:-1]])


def dense_edge_losses(model, sequences, layout):
    """[E] dense losses in ``layout``'s edge order, one dense forward per sequence of the row."""
    per_sequence = {
        int(s): dense_token_losses(model, sequences[int(s)]) for s in layout.sequence_ids
    }
    return torch.stack(
        [per_sequence[int(s)][int(j)] for s, j in zip(layout.edge_sequence, layout.edge_position)]
    )


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| (relative L2, docs/api.md)."""
    actual, expected = actual.detach(), expected.detach()
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


def gradients(model):
    """Copies of every parameter gradient by name (None where a parameter got none)."""
    return {
        name: (param.grad.detach().clone() if param.grad is not None else None)
        for name, param in model.named_parameters()
    }


def assert_forest_matches_dense(model, sequences, plan, seed=0):
    """Per-edge losses and the gradients of sum(w * loss) over all rows equal the dense ones."""
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad()
    tree_losses, weights = [], []
    for layout in plan.rows:
        loss = model(None, None, None, shared_prefix_layout=layout)
        assert loss.dtype == torch.float32 and loss.shape == (len(layout.edge_source),)
        w = torch.rand(loss.shape, generator=generator) + 0.5
        (loss * w).sum().backward()
        tree_losses.append(loss.detach())
        weights.append(w)
    tree_grads = gradients(model)

    model.zero_grad()
    dense_losses = []
    for layout, w in zip(plan.rows, weights):
        dense = dense_edge_losses(model, sequences, layout)
        (dense * w).sum().backward()
        dense_losses.append(dense.detach())
    dense_grads = gradients(model)

    assert relative_error(torch.cat(tree_losses), torch.cat(dense_losses)) <= LOSS_TOLERANCE
    assert tree_grads.keys() == dense_grads.keys()
    for name, expected in dense_grads.items():
        assert (tree_grads[name] is None) == (expected is None), name
        if expected is not None and expected.abs().max() > 0:
            assert relative_error(tree_grads[name], expected) <= GRAD_TOLERANCE, name


@contextlib.contextmanager
def without_megatron_mtp_gradient():
    """Within the block (forward and backward), megatron-core's own MTP loss adds no gradient:
    MTPLossAutoScaler, which HybridModel's MTP loss goes through, reads its scale in the
    backward pass, and the scale is 0 here. A test then backpropagates the weighting of the
    captured per-token MTP losses (``dense_mtp_losses``) it wants."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = MTPLossAutoScaler.main_loss_backward_scale
    MTPLossAutoScaler.set_loss_scale(torch.zeros(1))
    try:
        yield
    finally:
        MTPLossAutoScaler.set_loss_scale(scale)


@contextlib.contextmanager
def dense_mtp_losses(model):
    """Within the block, the model's dense forwards append their per-token MTP losses to the
    yielded list (one [b, S] tensor per depth and forward, depth 1 first), read where
    HybridModel.forward computes them: ``process_mtp_loss`` calls ``compute_language_model_loss``
    once per depth, then the forward calls it once for the main loss."""
    losses, calls = [], []
    compute = model.compute_language_model_loss
    depths = model.config.mtp_num_layers or 0

    def capture(labels, logits):
        loss = compute(labels, logits)
        calls.append(loss)
        if len(calls) <= depths:
            losses.append(loss)
        if len(calls) == depths + 1:
            calls.clear()
        return loss

    model.compute_language_model_loss = capture
    try:
        yield losses
    finally:
        del model.compute_language_model_loss


def dense_token_losses_with_mtp(model, sequence):
    """([L] main, [D, L] MTP) dense losses of one sequence: entry ``j`` is the loss whose target
    is ``sequence[j]`` (NaN where there is none); MTP depth ``d + 1`` predicts it from position
    ``j - 2 - d``. Backpropagate them inside ``without_megatron_mtp_gradient``."""
    depths = model.config.mtp_num_layers or 0
    with dense_mtp_losses(model) as captured:
        main = dense_token_losses(model, sequence)
    length = len(sequence)
    rows = []
    for index, loss in enumerate(captured):
        shift = index + 2
        nan = torch.full((min(shift, length),), float("nan"), dtype=loss.dtype, device=loss.device)
        rows.append(torch.cat([nan, loss[0, : max(length - shift, 0)]]))
    assert len(rows) == depths
    return main, torch.stack(rows)


def dense_edge_losses_with_mtp(model, sequences, layout):
    """([E] main, [D, E] MTP) dense losses in ``layout``'s edge order, one dense forward per
    sequence of the row; NaN where an edge has no target at a depth."""
    per_sequence = {
        int(s): dense_token_losses_with_mtp(model, sequences[int(s)]) for s in layout.sequence_ids
    }
    pairs = list(zip(layout.edge_sequence.tolist(), layout.edge_position.tolist()))
    main = torch.stack([per_sequence[s][0][j] for s, j in pairs])
    mtp = torch.stack([per_sequence[s][1][:, j] for s, j in pairs], dim=1)
    return main, mtp
