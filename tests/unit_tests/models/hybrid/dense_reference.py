"""Dense reference of forest forwards: each sequence run alone through megatron-core's HybridModel path."""

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
