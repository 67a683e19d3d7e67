"""Random prefix forests and their dense padded batches, shared by the MoE tests."""

import numpy as np
import torch

from megatron.shared_prefix import plan_shared_prefix


def random_sequences(
    rng: np.random.Generator, *, num_sequences=6, vocab_size=64, min_len=3, max_len=20
):
    """Sequences that share prefixes at random depths (3..20 tokens by default).

    Each new sequence copies a random prefix of an earlier one (or starts a new tree) and appends
    random tokens, so forests have several levels, single-token segments, sequences that are
    prefixes of others, and now and then an exact duplicate.
    """
    sequences = []
    for _ in range(num_sequences):
        if not sequences or rng.random() < 0.25:
            prefix = []
        else:
            parent = sequences[rng.integers(len(sequences))]
            prefix = parent[: rng.integers(1, min(len(parent), max_len - 1) + 1)]
        if prefix and rng.random() < 0.1:
            sequences.append(list(prefix) if len(prefix) >= min_len else list(parent))
            continue
        length = int(rng.integers(max(min_len, len(prefix) + 1), max_len + 1))
        suffix = rng.integers(1, vocab_size, size=length - len(prefix)).tolist()
        sequences.append(list(prefix) + suffix)
    return sequences


def random_rows(seed, *, capacity=512, pad_multiple=8, **kwargs):
    """(sequences, plan rows) of a random batch."""
    sequences = random_sequences(np.random.default_rng(seed), **kwargs)
    plan = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=pad_multiple)
    return sequences, plan.rows


def root_paths(layout):
    """[len(sequence)] int64 packed indices of each sequence of the row, in row order."""
    return [torch.as_tensor(layout.root_path(k)) for k in range(len(layout.sequence_ids))]


def dense_gather_index(layout):
    """([S_max, n] packed index of each dense position (0 at padding), [S_max, n] bool padding mask).

    Column ``i`` is the row's ``i``-th sequence, right-padded: the layout's dense re-expansion as
    one padded micro-batch.
    """
    paths = root_paths(layout)
    max_len = max(len(p) for p in paths)
    index = torch.zeros(max_len, len(paths), dtype=torch.long)
    padding = torch.ones(max_len, len(paths), dtype=torch.bool)
    for i, path in enumerate(paths):
        index[: len(path), i] = path
        padding[: len(path), i] = False
    return index, padding


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| (relative L2, docs/api.md)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


def shared_padded_row(seed, **kwargs):
    """(sequences, layout) of the first random batch from ``seed`` on that packs into one row with
    padding and at least one shared token (the planner decides row shapes, so search for one)."""
    for attempt in range(seed, seed + 100):
        sequences, rows = random_rows(attempt, **kwargs)
        if len(rows) == 1 and rows[0].num_padding and rows[0].token_multiplicity.max() > 1:
            return sequences, rows[0]
    raise AssertionError(f"no single padded row with sharing among seeds {seed}..{seed + 99}")
