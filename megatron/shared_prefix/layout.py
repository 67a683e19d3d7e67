"""One packed row of a shared-prefix batch: a forest of prefix trees in DFS order.

Upstream target: ``megatron/rl/tree_layout.py``.

A :class:`ForestLayout` is host-side (numpy only, no torch) and immutable. It is produced by
:func:`megatron.shared_prefix.planning.plan_shared_prefix` and consumed by the device metadata
builder and the model. Terminology used throughout:

* *token*: one packed position ``t`` in ``[0, T)``; the model runs once per token.
* *segment*: a maximal unbranched chain of trie tokens, stored contiguously; segments are numbered
  in DFS (pre-)order, so a parent's index is smaller than its children's and every subtree occupies
  a contiguous range of segment indices (and therefore of tokens).
* *root path* of a sequence: the packed tokens of its ancestors' segments followed by its own
  segment up to ``sequence_last_index``; reading ``tokens`` along it gives the original sequence
  back.
* *edge*: one supervised target ``(sequence, j)``; the model's output at ``edge_source`` (the packed
  token holding position ``j - 1`` on that sequence's root path) predicts ``edge_target``.
* *padding*: an optional trailing root segment (token id 0, positions ``0..p-1``, multiplicity 0)
  that rounds the row up to the planner's ``pad_multiple``; it is never an edge source.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ForestLayout"]


def _frozen_int64(value, name: str) -> np.ndarray:
    """A read-only 1-D int64 view of ``value`` (no copy when it already is int64)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"ForestLayout.{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"ForestLayout.{name} must hold integers, got dtype {arr.dtype}")
    view = arr.astype(np.int64, copy=False).view()
    view.flags.writeable = False
    return view


@dataclasses.dataclass(frozen=True, eq=False)
class ForestLayout:
    """One packed row: token, segment, multiplicity and loss-edge arrays (all int64, read-only).

    Shapes: ``T`` tokens (padding included), ``S`` segments, ``E`` edges, ``n`` sequences.

    Attributes:
        tokens: [T] packed token ids in DFS order (0 for padding).
        position_ids: [T] position of each token in its original sequence(s); padding counts 0..p-1.
        segment_starts: [S] first token of each segment; segments tile ``[0, T)`` in order.
        segment_lengths: [S] number of tokens of each segment (>= 1).
        segment_parents: [S] parent segment, -1 for a root; ``parent < child``, subtrees contiguous,
            and a child's first position is its parent's last position + 1.
        token_multiplicity: [T] number of the row's sequences whose root path contains the token
            (0 exactly for padding).
        edge_source: [E] packed token whose output predicts the target.
        edge_target: [E] target token id.
        edge_sequence: [E] index of the edge's sequence in the planner's ``sequences`` argument.
        edge_position: [E] position ``j >= 1`` of the target in that sequence.
        sequence_ids: [n] original indices of the sequences packed in this row, in row (DFS) order.
        sequence_last_index: [n] packed index of the last token of each of those sequences.
        token_segment: [T] segment of each token (derived).
        segment_depth: [S] number of ancestors of each segment (derived).
        num_padding: trailing padding tokens (derived; 0 without a padding segment).

    Edges are ordered by (row order of their sequence, edge_position). The constructor checks shapes
    and parent indices only (what the derived fields need); :meth:`validate` checks every invariant.
    """

    tokens: np.ndarray
    position_ids: np.ndarray
    segment_starts: np.ndarray
    segment_lengths: np.ndarray
    segment_parents: np.ndarray
    token_multiplicity: np.ndarray
    edge_source: np.ndarray
    edge_target: np.ndarray
    edge_sequence: np.ndarray
    edge_position: np.ndarray
    sequence_ids: np.ndarray
    sequence_last_index: np.ndarray
    token_segment: np.ndarray = dataclasses.field(init=False)
    segment_depth: np.ndarray = dataclasses.field(init=False)
    num_padding: int = dataclasses.field(init=False)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.init:
                object.__setattr__(
                    self, field.name, _frozen_int64(getattr(self, field.name), field.name)
                )
        groups = {
            "T": ("tokens", "position_ids", "token_multiplicity"),
            "S": ("segment_starts", "segment_lengths", "segment_parents"),
            "E": ("edge_source", "edge_target", "edge_sequence", "edge_position"),
            "n": ("sequence_ids", "sequence_last_index"),
        }
        for dim, names in groups.items():
            sizes = {name: len(getattr(self, name)) for name in names}
            if len(set(sizes.values())) != 1:
                raise ValueError(
                    f"ForestLayout arrays sharing dimension {dim} differ in length: {sizes}"
                )
        lengths, parents = self.segment_lengths, self.segment_parents
        num_segments = len(lengths)
        if num_segments and (lengths.min() < 1 or lengths.sum() != len(self.tokens)):
            raise ValueError(
                "ForestLayout.segment_lengths must be >= 1 and sum to the number of tokens"
            )
        if num_segments == 0 and len(self.tokens):
            raise ValueError("ForestLayout has tokens but no segments")
        if np.any((parents < -1) | (parents >= np.arange(num_segments))):
            raise ValueError("ForestLayout.segment_parents must be -1 or a smaller segment index")

        token_segment = np.repeat(np.arange(num_segments, dtype=np.int64), lengths)
        # List ranking by pointer jumping: O(S log depth) numpy work instead of a per-segment loop.
        depth = (parents >= 0).astype(np.int64)
        jump = parents.copy()
        while True:
            active = np.flatnonzero(jump >= 0)
            if active.size == 0:
                break
            target = jump[active]
            depth[active] += depth[target]
            jump[active] = jump[target]
        # Padding: one trailing root segment of multiplicity 0 (real tokens have >= 1).
        num_padding = 0
        if num_segments and self.token_multiplicity[self.segment_starts[-1]] == 0:
            num_padding = int(lengths[-1])
        for name, value in (("token_segment", token_segment), ("segment_depth", depth)):
            value.flags.writeable = False
            object.__setattr__(self, name, value)
        object.__setattr__(self, "num_padding", num_padding)

    def __setstate__(self, state: dict) -> None:
        """Unpickling (a layout planned in a data-loader worker): the arrays come back writeable
        copies; they are made read-only again, as the constructor leaves them."""
        for value in state.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        self.__dict__.update(state)

    @property
    def num_tokens(self) -> int:
        """T: executed tokens of the row, padding included."""
        return len(self.tokens)

    def __repr__(self) -> str:
        return (
            f"ForestLayout(num_tokens={self.num_tokens}, num_segments={len(self.segment_starts)}, "
            f"num_edges={len(self.edge_source)}, sequences={self.sequence_ids.tolist()}, "
            f"num_padding={self.num_padding})"
        )

    def root_path(self, k: int) -> np.ndarray:
        """Packed indices [len] of the row's ``k``-th sequence (``sequence_ids[k]``), in order.

        ``tokens[root_path(k)]`` is the original sequence and ``position_ids[root_path(k)]`` is
        ``0..len-1``: this is the dense re-expansion of the row.
        """
        if not -len(self.sequence_ids) <= k < len(self.sequence_ids):
            raise IndexError(f"row has {len(self.sequence_ids)} sequences, got k={k}")
        last = int(self.sequence_last_index[k])
        seg = int(self.token_segment[last])
        parts = [np.arange(self.segment_starts[seg], last + 1, dtype=np.int64)]
        seg = int(self.segment_parents[seg])
        while seg >= 0:
            start = int(self.segment_starts[seg])
            parts.append(np.arange(start, start + int(self.segment_lengths[seg]), dtype=np.int64))
            seg = int(self.segment_parents[seg])
        return np.concatenate(parts[::-1])

    def validate(self) -> None:
        """Check every layout invariant; raise ValueError naming the first one violated.

        Costs O(T + sum of sequence lengths + E) with per-segment Python loops: meant for tests and
        debugging, not for the training hot path.
        """
        T, S = self.num_tokens, len(self.segment_starts)
        starts, lengths, parents = self.segment_starts, self.segment_lengths, self.segment_parents
        if S == 0:
            raise ValueError("layout has no segments")
        expected_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        if not np.array_equal(starts, expected_starts):
            raise ValueError("segments must tile the tokens contiguously in order")

        # DFS preorder, contiguous subtrees <=> every parent is on the root path of segment i-1.
        path: list[int] = []
        for i in range(S):
            p = int(parents[i])
            while path and path[-1] != p:
                path.pop()
            if p >= 0 and not path:
                raise ValueError(
                    f"segment {i}: parent {p} is not on the current DFS path "
                    "(subtree not contiguous)"
                )
            path.append(i)

        pos = self.position_ids
        offset_in_segment = np.arange(T) - np.repeat(starts, lengths)
        first_pos = pos[starts]
        expected_first = np.where(parents >= 0, pos[starts[parents] + lengths[parents] - 1] + 1, 0)
        if not np.array_equal(first_pos, expected_first):
            bad = int(np.flatnonzero(first_pos != expected_first)[0])
            raise ValueError(
                f"segment {bad}: first position {first_pos[bad]} should be {expected_first[bad]}"
            )
        if not np.array_equal(pos, np.repeat(first_pos, lengths) + offset_in_segment):
            raise ValueError("positions must increase by one inside each segment")

        pad = self.num_padding
        mult = self.token_multiplicity
        real = T - pad
        if pad:
            if parents[-1] != -1 or np.any(self.tokens[real:] != 0) or np.any(mult[real:] != 0):
                raise ValueError(
                    "padding must be one trailing root segment of token 0 with multiplicity 0"
                )
        if np.any(mult[:real] < 1):
            raise ValueError("every non-padding token must belong to at least one sequence")
        if np.any(self.tokens < 0):
            raise ValueError("token ids must be non-negative")

        n = len(self.sequence_ids)
        if len(np.unique(self.sequence_ids)) != n or np.any(self.sequence_ids < 0):
            raise ValueError("sequence_ids must be distinct non-negative indices")
        if np.any((self.sequence_last_index < 0) | (self.sequence_last_index >= real)):
            raise ValueError("sequence_last_index must point at non-padding tokens")
        paths = [self.root_path(k) for k in range(n)]
        counts = np.bincount(np.concatenate(paths), minlength=T) if n else np.zeros(T, np.int64)
        if not np.array_equal(counts, mult):
            raise ValueError("token_multiplicity must count the root paths through each token")
        for k, p in enumerate(paths):
            if not np.array_equal(pos[p], np.arange(len(p))):
                raise ValueError(f"row sequence {k}: root path does not start at position 0")

        # Edges: by row sequence order, then position; each source on its sequence's path.
        rank = {int(sid): k for k, sid in enumerate(self.sequence_ids)}
        if not set(self.edge_sequence.tolist()) <= rank.keys():
            raise ValueError("edge_sequence must name sequences of this row")
        edge_rank = np.array([rank[int(s)] for s in self.edge_sequence], dtype=np.int64)
        order_key = edge_rank * (T + 1) + self.edge_position
        if np.any(np.diff(order_key) <= 0):
            raise ValueError(
                "edges must be ordered by (row sequence order, edge_position) without repeats"
            )
        for k, p in enumerate(paths):
            sel = edge_rank == k
            j = self.edge_position[sel]
            if np.any((j < 1) | (j >= len(p))):
                raise ValueError(f"row sequence {k}: edge position outside 1..len-1")
            if not np.array_equal(self.edge_source[sel], p[j - 1]):
                raise ValueError(
                    f"row sequence {k}: edge source is not the token before the target"
                )
            if not np.array_equal(self.edge_target[sel], self.tokens[p[j]]):
                raise ValueError(f"row sequence {k}: edge target is not the sequence's token")
