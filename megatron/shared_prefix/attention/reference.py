"""Dense-mask oracles for tests: slow, obviously-correct references that fast tree paths are checked
against.

Nothing here is on a hot path; everything materialises [T, T] matrices.
"""

from __future__ import annotations

import numpy as np

from megatron.shared_prefix.layout import ForestLayout

__all__ = ["expand_row", "tree_attention_allow_mask"]


def tree_attention_allow_mask(layout: ForestLayout) -> np.ndarray:
    """Dense attention allow-mask of one packed row.

    Token ``i`` may attend token ``j`` iff ``j``'s segment is a strict ancestor of ``i``'s segment,
    or both are in the same segment and ``j <= i``. This is causal attention of every original
    sequence, read along its root path; padding (a root segment) attends causally to itself only.

    Returns:
        [T, T] bool array, ``mask[i, j]`` True where query ``i`` may attend key ``j``.
    """
    parents = layout.segment_parents
    num_segments = len(parents)
    # ancestor[a, b]: segment b is a strict ancestor of segment a.
    ancestor = np.zeros((num_segments, num_segments), dtype=bool)
    for seg in range(num_segments):
        parent = int(parents[seg])
        if parent >= 0:
            ancestor[seg] = ancestor[parent]
            ancestor[seg, parent] = True
    seg = layout.token_segment
    index = np.arange(layout.num_tokens)
    same_causal = (seg[:, None] == seg[None, :]) & (index[None, :] <= index[:, None])
    return ancestor[seg[:, None], seg[None, :]] | same_causal


def expand_row(layout: ForestLayout) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Dense re-expansion of a row: original sequence index -> (tokens [L], position_ids [L]).

    Reads each sequence back along its root path, so a test can run the dense model on exactly the
    sequences a row stands for.
    """
    expanded = {}
    for k, sequence in enumerate(layout.sequence_ids):
        path = layout.root_path(k)
        expanded[int(sequence)] = (layout.tokens[path], layout.position_ids[path])
    return expanded
