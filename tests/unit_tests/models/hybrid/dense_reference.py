"""Dense reference of forest forwards: each sequence run alone through megatron-core's HybridModel path."""

import numpy as np
import torch


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
    per_sequence = {int(s): dense_token_losses(model, sequences[int(s)]) for s in layout.sequence_ids}
    return torch.stack(
        [per_sequence[int(s)][int(j)] for s, j in zip(layout.edge_sequence, layout.edge_position)]
    )


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| (relative L2, DESIGN.md §3)."""
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


def gradients(model):
    """Copies of every parameter gradient by name (None where a parameter got none)."""
    return {
        name: (param.grad.detach().clone() if param.grad is not None else None)
        for name, param in model.named_parameters()
    }
