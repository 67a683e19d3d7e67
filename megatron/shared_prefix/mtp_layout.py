"""The rows multi-token prediction (MTP) runs on, built from a forest row (host side, numpy only).

Upstream target: ``megatron/core/models/hybrid/shared_prefix/mtp_layout.py``, next to layout.py.

Dense MTP (megatron-core's ``MultiTokenPredictionBlock``) on a sequence ``x_0 .. x_{L-1}``:
depth ``d`` (1-based) at position ``t`` combines the previous depth's output at ``t`` (the main
model's for ``d = 1``) with the embedding of ``x_{t+d}`` -- token 0 at position id 0 where
``t + d >= L``, since ``roll_tensor`` fills the rolled-in ids with zeros -- runs the depth's layers
causally over the ``L`` positions, and at ``t`` predicts ``x_{t+d+1}`` (the target of position
``t + d``, masked as that position is).

The state of depth ``d`` at position ``t`` is therefore a function of ``x_0 .. x_{t+d}`` (with
zeros past the end), so two sequences share it exactly when they share those ``t + d + 1`` tokens,
and the row of depth ``d`` is the forest of these keys. Write ``X`` for the main forest with a
chain of ``D`` end markers ``⊥`` hung below every distinct sequence end (the last token of one or
more sequences; identical sequences share it). A node of ``X`` at position ``p`` is a prefix
``x_0 .. x_p`` (``⊥`` past the end); the depth-``d`` forest is

    F_d = { nodes n of X with position(n) >= d and at most d markers on their root path },

node ``n`` standing for depth ``d`` at position ``t = position(n) - d`` of every sequence through
it. docs/architecture.md ("Multi-token prediction on forests") proves that ``F_d`` is exactly the
dense computation; what follows from it:

* the tokens of ``F_d`` are X's nodes in X's depth-first order (the main row's order, markers
  right after their sequence end), so ``F_d`` is a forest row like any other: tree attention, the
  Mamba fork and MoE multiplicities run on it unchanged. Its roots are the nodes at position
  ``d``: the main row's first ``d`` positions drop out, a segment whose children differ within
  ``d`` tokens reaches each child in that child's copy of it, and a segment shorter than ``d``
  leaves copies along every distinct ``d``-token path below it;
* node ``n``'s embedding input is its own token (``0`` for a marker), at position id
  ``position(n)`` (``0`` for a marker), and its state input is the previous depth's state at
  ``n``'s parent in ``X`` (the main row's token before ``n`` for ``d = 1``), a node of
  ``F_{d-1}`` standing for the same position ``t``;
* a main edge ``(s, j)`` has a depth-``d`` target iff ``j >= d + 1``; it is read at the main
  edge's own source node (position ``j - 1``, i.e. ``t = j - 1 - d``), with the same target;
* the markers are the dense positions ``t >= L - d`` (whose inputs are zero ids): they lead to no
  target, but MoE layers route them, with multiplicity the number of sequences ending there.

``F_d`` has one node per node of ``X`` at positions ``>= d``, about as many as the main row has
tokens (plus ``d`` markers per distinct sequence end): a prefix shared by ``G`` sequences is
computed once per depth, as in the main model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron.shared_prefix.layout import ForestLayout

__all__ = ["MTPForest", "mtp_forests"]


@dataclasses.dataclass(frozen=True, eq=False)
class MTPForest:
    """The row of one MTP depth.

    ``T_d`` tokens (padding included), ``E_d`` edges.

    Attributes:
        depth: the depth ``d`` (1-based).
        layout: the depth's forest row. ``tokens`` are the embedding inputs (``x_{t+d}``, 0 at a
            sequence end marker), ``position_ids`` the positions ``t`` (rotary embeddings of the
            depth's attention layers), ``token_multiplicity`` the sequences through each token;
            its sequences are the main row's, each read along its root path as
            ``x_d .. x_{L-1}`` followed by ``d`` zeros, and its edges are the main edges with a
            depth-``d`` target, edge ``(s, j)`` at ``edge_position`` ``j - d`` (so ``validate()``
            holds: the edge's target is the token at that position of the path).
        embedding_position_ids: [T_d] position ids of the embedding inputs (``t + d``, 0 at a
            marker and at padding), as megatron-core rolls them.
        input_index: [T_d] packed index, in the previous depth's row (the main row for depth 1),
            of the state each token starts from (0 at padding, whose result nothing reads).
        edge_index: [E_d] index of each edge among the main row's edges.
        main_edge_slot: [E] index among this depth's edges of each main edge, -1 for an edge
            without a depth-``d`` target (``edge_position <= d``).
    """

    depth: int
    layout: ForestLayout
    embedding_position_ids: np.ndarray
    input_index: np.ndarray
    edge_index: np.ndarray
    main_edge_slot: np.ndarray


@dataclasses.dataclass(frozen=True)
class _ExtendedForest:
    """X: the row's real tokens with ``D`` end markers after every distinct sequence end, in
    depth-first order. Arrays are [N], N = real tokens + D x distinct ends."""

    position: np.ndarray
    token: np.ndarray
    multiplicity: np.ndarray
    markers: np.ndarray  # end markers on the root path up to the node (0 for a real token)
    parent: np.ndarray  # the node before it on its root path, -1 for a root
    main_index: np.ndarray  # packed index in the main row, -1 for a marker
    node_of_token: np.ndarray  # [T real] node of each main-row token


def _main_predecessors(layout: ForestLayout, num_real: int) -> np.ndarray:
    """[num_real] packed index of the token before each token on its root path (-1 at roots)."""
    predecessor = np.arange(-1, num_real - 1, dtype=np.int64)
    starts, lengths, parents = layout.segment_starts, layout.segment_lengths, layout.segment_parents
    real = starts < num_real
    starts, parents = starts[real], parents[real]
    parent_last = np.where(
        parents >= 0,
        layout.segment_starts[np.maximum(parents, 0)] + lengths[np.maximum(parents, 0)] - 1,
        -1,
    )
    predecessor[starts] = parent_last
    return predecessor


def _extended_forest(layout: ForestLayout, num_depths: int) -> _ExtendedForest:
    num_real = layout.num_tokens - layout.num_padding
    ends, sequences_ending = np.unique(layout.sequence_last_index, return_counts=True)
    is_end = np.zeros(num_real, dtype=bool)
    is_end[ends] = True
    ends_before = np.cumsum(is_end) - is_end
    node_of_token = np.arange(num_real, dtype=np.int64) + num_depths * ends_before
    size = num_real + num_depths * len(ends)

    position = np.empty(size, dtype=np.int64)
    token = np.zeros(size, dtype=np.int64)
    multiplicity = np.empty(size, dtype=np.int64)
    markers = np.zeros(size, dtype=np.int64)
    parent = np.empty(size, dtype=np.int64)
    main_index = np.full(size, -1, dtype=np.int64)

    predecessor = _main_predecessors(layout, num_real)
    position[node_of_token] = layout.position_ids[:num_real]
    token[node_of_token] = layout.tokens[:num_real]
    multiplicity[node_of_token] = layout.token_multiplicity[:num_real]
    parent[node_of_token] = np.where(
        predecessor >= 0, node_of_token[np.maximum(predecessor, 0)], -1
    )
    main_index[node_of_token] = np.arange(num_real, dtype=np.int64)
    end_nodes = node_of_token[ends]
    for count in range(1, num_depths + 1):
        nodes = end_nodes + count
        position[nodes] = layout.position_ids[ends] + count
        multiplicity[nodes] = sequences_ending
        markers[nodes] = count
        parent[nodes] = nodes - 1
    return _ExtendedForest(
        position, token, multiplicity, markers, parent, main_index, node_of_token
    )


def _segments(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments of a forest given in depth-first order by each node's parent (-1 for a root).

    A node continues the previous node's segment when that node is its parent and has no other
    child. Returns (segment starts, lengths, parent segments).
    """
    count = len(parent)
    children = np.bincount(parent[parent >= 0], minlength=count)
    previous = np.arange(-1, count - 1, dtype=np.int64)
    only_child = (parent >= 0) & (children[np.maximum(parent, 0)] == 1)
    starts_new = ~(only_child & (parent == previous))
    starts = np.flatnonzero(starts_new).astype(np.int64)
    lengths = np.diff(np.append(starts, count)).astype(np.int64)
    segment_of_node = np.cumsum(starts_new) - 1
    first_parent = parent[starts]
    parents = np.where(first_parent >= 0, segment_of_node[np.maximum(first_parent, 0)], -1)
    return starts, lengths, parents.astype(np.int64)


def _padded(values: np.ndarray, padding: int, fill) -> np.ndarray:
    if not padding:
        return values
    if isinstance(fill, np.ndarray):
        return np.concatenate([values, fill])
    return np.concatenate([values, np.full(padding, fill, dtype=np.int64)])


def mtp_forests(
    layout: ForestLayout, num_depths: int, pad_multiple: int = 1
) -> tuple[MTPForest, ...]:
    """The rows of MTP depths ``1 .. num_depths`` of ``layout`` (see the module docstring).

    Args:
        layout: the main row.
        num_depths: MTP depths (``mtp_num_layers``), at least 1.
        pad_multiple: round every depth's row up to a multiple of this (one trailing padding
            segment), as the main row is under sequence and context parallelism.

    Returns:
        One :class:`MTPForest` per depth, depth 1 first.
    """
    if num_depths < 1:
        raise ValueError(f"mtp_forests: num_depths must be >= 1, got {num_depths}")
    if pad_multiple < 1:
        raise ValueError(f"mtp_forests: pad_multiple must be >= 1, got {pad_multiple}")
    extended = _extended_forest(layout, num_depths)
    num_edges = len(layout.edge_source)
    edge_node = extended.node_of_token[layout.edge_source]
    last_node = extended.node_of_token[layout.sequence_last_index]
    previous_index = extended.main_index  # depth 0: the main row, indexed by node
    forests = []
    for depth in range(1, num_depths + 1):
        keep = (extended.position >= depth) & (extended.markers <= depth)
        nodes = np.flatnonzero(keep)
        index_of_node = np.full(len(keep), -1, dtype=np.int64)
        index_of_node[nodes] = np.arange(len(nodes), dtype=np.int64)
        parent_node = extended.parent[nodes]
        parent = np.where(parent_node >= 0, index_of_node[np.maximum(parent_node, 0)], -1)
        starts, lengths, segment_parents = _segments(parent)
        input_index = previous_index[parent_node]
        assert np.all(input_index >= 0), "every node's parent is a node of the previous depth"

        real = len(nodes)
        padding = -real % pad_multiple
        if padding:
            starts = np.append(starts, real)
            lengths = np.append(lengths, padding)
            segment_parents = np.append(segment_parents, -1)
        pad_positions = np.arange(padding, dtype=np.int64)
        has_target = layout.edge_position >= depth + 1
        edge_index = np.flatnonzero(has_target).astype(np.int64)
        main_edge_slot = np.full(num_edges, -1, dtype=np.int64)
        main_edge_slot[edge_index] = np.arange(len(edge_index), dtype=np.int64)
        depth_layout = ForestLayout(
            tokens=_padded(extended.token[nodes], padding, 0),
            position_ids=_padded(extended.position[nodes] - depth, padding, pad_positions),
            segment_starts=starts,
            segment_lengths=lengths,
            segment_parents=segment_parents,
            token_multiplicity=_padded(extended.multiplicity[nodes], padding, 0),
            edge_source=index_of_node[edge_node[edge_index]],
            edge_target=layout.edge_target[edge_index],
            edge_sequence=layout.edge_sequence[edge_index],
            edge_position=layout.edge_position[edge_index] - depth,
            sequence_ids=layout.sequence_ids,
            sequence_last_index=index_of_node[last_node + depth],
        )
        embedding_positions = np.where(extended.markers[nodes] == 0, extended.position[nodes], 0)
        forests.append(
            MTPForest(
                depth=depth,
                layout=depth_layout,
                embedding_position_ids=_frozen(_padded(embedding_positions, padding, 0)),
                input_index=_frozen(_padded(input_index, padding, 0)),
                edge_index=_frozen(edge_index),
                main_edge_slot=_frozen(main_edge_slot),
            )
        )
        previous_index = index_of_node
    return tuple(forests)


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array, dtype=np.int64)
    array.flags.writeable = False
    return array
