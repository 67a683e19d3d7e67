"""Device metadata of one packed forest row, built once per forward and read by tree-aware modules.

:class:`ForestTensors` holds everything the stack needs about a :class:`ForestLayout` on the model's
device. It is immutable; derived tables that only some backends need are computed on first use and
cached on the object, so nothing is rebuilt per layer.

The forest is published to the tree-aware submodules (core attention, Mamba mixer, MoE router)
through :func:`forest_scope`, a ``contextvars`` scope: megatron-core's layer call signatures stay
unchanged, and a module sees a forest only inside the forward (and backward, see
``megatron.shared_prefix.tensor_parallel.random``) of the model that published it.
"""

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

import numpy as np
import torch

from megatron.shared_prefix.layout import ForestLayout

_ACTIVE_FOREST: contextvars.ContextVar[Optional["ForestTensors"]] = contextvars.ContextVar(
    "shared_prefix_forest", default=None
)


def current_forest() -> Optional["ForestTensors"]:
    """The forest of the shared-prefix forward in progress, or None (dense behaviour)."""
    return _ACTIVE_FOREST.get()


@contextlib.contextmanager
def forest_scope(forest: Optional["ForestTensors"]) -> Iterator[Optional["ForestTensors"]]:
    """Publish ``forest`` to tree-aware modules for the duration of the block (None: dense)."""
    token = _ACTIVE_FOREST.set(forest)
    try:
        yield forest
    finally:
        _ACTIVE_FOREST.reset(token)


def cumsum_over_tokens(values: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum of [T, ...] ``values`` along the token dimension (dim 0).

    Computed along a contiguous last dimension: CUDA scans along a strided outer dimension run about
    one thread per column, so ``cumsum(dim=0)`` of a [T, heads] tensor takes milliseconds where the
    same scan over [heads, T] takes microseconds (measured on an H200, docs/benchmarks.md).
    """
    return values.movedim(0, -1).contiguous().cumsum(-1).movedim(-1, 0)


def _subtree_token_end(layout: ForestLayout) -> np.ndarray:
    """[S] exclusive end token index of each segment's subtree (DFS order makes it contiguous)."""
    starts, lengths, parents = layout.segment_starts, layout.segment_lengths, layout.segment_parents
    end = starts + lengths
    # Children come after their parent in DFS order, so a reverse sweep sees every descendant first.
    for segment in range(len(parents) - 1, -1, -1):
        parent = parents[segment]
        if parent >= 0 and end[segment] > end[parent]:
            end[parent] = end[segment]
    return end


@dataclasses.dataclass(frozen=True, eq=False)
class ForestTensors:
    """One forest row on a device.

    Attributes:
        layout: the host-side layout this was built from.
        input_ids: [1, T] packed token ids.
        position_ids: [1, T] position of each token in its original sequence(s).
        token_segment: [T] segment index of each token.
        token_subtree_end: [T] exclusive end of the subtree of the token's segment. Token ``q`` may
            attend token ``k`` iff ``k <= q < token_subtree_end[k]`` (the tree mask).
        segment_starts, segment_lengths, segment_parents: [S] the layout's segments.
        token_multiplicity: [T] number of original sequences through each token (0 for padding).
        edge_unique_source: [U] distinct loss-edge source tokens, ascending.
        edge_source_slot: [E] index into ``edge_unique_source`` of each edge's source.
        edge_target: [E] target token id of each edge.

    Tables that only some backends need are built on first request and kept in ``_derived`` (per
    object, so they are freed with the forest).
    """

    layout: ForestLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_segment: torch.Tensor
    token_subtree_end: torch.Tensor
    segment_starts: torch.Tensor
    segment_lengths: torch.Tensor
    segment_parents: torch.Tensor
    token_multiplicity: torch.Tensor
    edge_unique_source: torch.Tensor
    edge_source_slot: torch.Tensor
    edge_target: torch.Tensor
    _derived: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_layout(cls, layout: ForestLayout, device: torch.device | str) -> "ForestTensors":
        """Copy the layout and its derived tables to ``device`` (one host-to-device copy each)."""
        unique_source, source_slot = np.unique(layout.edge_source, return_inverse=True)
        subtree_end = _subtree_token_end(layout)

        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(array, dtype=np.int64)).to(device)

        return cls(
            layout=layout,
            input_ids=on_device(layout.tokens).unsqueeze(0),
            position_ids=on_device(layout.position_ids).unsqueeze(0),
            token_segment=on_device(layout.token_segment),
            token_subtree_end=on_device(subtree_end[layout.token_segment]),
            segment_starts=on_device(layout.segment_starts),
            segment_lengths=on_device(layout.segment_lengths),
            segment_parents=on_device(layout.segment_parents),
            token_multiplicity=on_device(layout.token_multiplicity),
            edge_unique_source=on_device(unique_source),
            edge_source_slot=on_device(source_slot.reshape(-1)),
            edge_target=on_device(layout.edge_target),
        )

    @property
    def num_tokens(self) -> int:
        """T, the packed row length (padding included)."""
        return int(self.input_ids.shape[1])

    @property
    def device(self) -> torch.device:
        """Device of every tensor of this forest."""
        return self.input_ids.device

    def derive(self, key, build):
        """Return the table cached under ``key``, building it with ``build()`` on first request."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def sequence_parallel_tokens(self, size: int, rank: int) -> slice:
        """The tokens that sequence-parallel rank ``rank`` of ``size`` holds: its ``T / size``.

        megatron splits the sequence dimension into ``size`` equal contiguous chunks outside
        attention and Mamba; a forest row is split the same way (``T`` must be a multiple of
        ``size``, which the planner's ``pad_multiple`` provides).
        """
        if self.num_tokens % size:
            raise ValueError(
                f"a forest row of {self.num_tokens} tokens cannot be split over {size} "
                "sequence-parallel ranks (plan with pad_multiple a multiple of the tensor "
                "parallel size)"
            )
        chunk = self.num_tokens // size
        return slice(rank * chunk, (rank + 1) * chunk)

    def edge_projection(self, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which hidden states a sequence-parallel rank projects to the vocabulary, and where each
        edge finds its logits.

        Every rank holds ``T / size`` tokens and selects its own distinct edge sources, padded to
        the largest count ``U_max`` of any rank (with its first token, whose logits no edge
        reads), so that the output layer's sequence-parallel all-gather stacks ``size`` equal
        blocks: rank ``q``'s ``k``-th source lands at row ``q * U_max + k``.

        Returns:
            ([U_max] int64 local token index of this rank's sources, [E] int64 row of each edge's
            source in the gathered ``[size * U_max]`` block). With ``size`` 1: the distinct
            sources and ``edge_source_slot``.
        """
        return self.derive(("edge_projection", size, rank), lambda: self._projection(size, rank))

    def _projection(self, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if size == 1:
            return self.edge_unique_source, self.edge_source_slot
        chunk = self.sequence_parallel_tokens(size, 0).stop
        sources = self.edge_unique_source.cpu().numpy()
        owner = sources // chunk
        counts = np.bincount(owner, minlength=size)
        width = max(int(counts.max(initial=0)), 1)
        position = np.arange(len(sources)) - np.concatenate([[0], np.cumsum(counts)[:-1]])[owner]
        slot_of_source = owner * width + position
        local = np.zeros(width, dtype=np.int64)
        mine = owner == rank
        local[: int(mine.sum())] = sources[mine] - rank * chunk
        slots = slot_of_source[self.edge_source_slot.cpu().numpy()]
        return (
            torch.as_tensor(local, device=self.device),
            torch.as_tensor(slots, dtype=torch.int64, device=self.device),
        )

    def attention_key_blocks(self, block_size: int) -> tuple[torch.Tensor, ...]:
        """Keys visible to each block of ``block_size`` consecutive queries.

        Returns one ascending [K_b] index tensor per query block ``b``: the tokens ``k`` with
        ``k < block_end`` and ``token_subtree_end[k] > block_start``, i.e. every key that at least
        one
        query of the block may attend. Attention over these keys with the tree mask costs
        O(block_size * K_b) memory instead of O(T * T).
        """
        return self.derive(
            ("attention_key_blocks", block_size), lambda: self._key_blocks(block_size)
        )

    def _key_blocks(self, block_size: int) -> tuple[torch.Tensor, ...]:
        subtree_end = self.token_subtree_end.cpu().numpy()
        blocks = []
        for start in range(0, self.num_tokens, block_size):
            end = min(start + block_size, self.num_tokens)
            visible = np.flatnonzero(subtree_end[:end] > start)
            blocks.append(torch.as_tensor(visible, dtype=torch.int64, device=self.device))
        return tuple(blocks)

    def root_path_predecessors(self, window: int) -> torch.Tensor:
        """[T, window] packed index of the 1st..window-th previous token on each token's root path.

        Column ``j`` holds the token ``j + 1`` steps back along the path (parent segments included);
        -1 where the path is shorter. Used by the tree causal convolution.
        """
        return self.derive(("root_path_predecessors", window), lambda: self._predecessors(window))

    def _predecessors(self, window: int) -> torch.Tensor:
        layout = self.layout
        predecessor = np.arange(-1, self.num_tokens - 1, dtype=np.int64)
        first_tokens = layout.segment_starts
        parents = layout.segment_parents
        parent_last = np.where(
            parents >= 0,
            layout.segment_starts[np.maximum(parents, 0)]
            + layout.segment_lengths[np.maximum(parents, 0)]
            - 1,
            -1,
        )
        predecessor[first_tokens] = parent_last
        table = np.empty((self.num_tokens, window), dtype=np.int64)
        current = np.arange(self.num_tokens, dtype=np.int64)
        for step in range(window):
            current = np.where(current >= 0, predecessor[np.maximum(current, 0)], -1)
            table[:, step] = current
        return torch.as_tensor(table, device=self.device)
