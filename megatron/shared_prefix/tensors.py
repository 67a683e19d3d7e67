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
import copy
import contextvars
import dataclasses
import functools
from typing import Callable, Iterator, Optional

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


def rank_split(config, tp_group, cp_group) -> tuple[int, int, int, int]:
    """``(cp_size, cp_rank, sp_size, sp_rank)``: how a forest row is split to reach this rank
    outside attention and Mamba (the arguments of ``ForestTensors.local_tokens``)."""
    sequence_parallel = config.sequence_parallel and tp_group.size() > 1
    return (
        cp_group.size(),
        cp_group.rank(),
        tp_group.size() if sequence_parallel else 1,
        tp_group.rank() if sequence_parallel else 0,
    )


def cumsum_over_tokens(values: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum of [T, ...] ``values`` along the token dimension (dim 0).

    Computed along a contiguous last dimension: CUDA scans along a strided outer dimension run about
    one thread per column, so ``cumsum(dim=0)`` of a [T, heads] tensor takes milliseconds where the
    same scan over [heads, T] takes microseconds (measured on an H200, docs/benchmarks.md).
    """
    return values.movedim(0, -1).contiguous().cumsum(-1).movedim(-1, 0)


def host_to_device(array, device: torch.device | str) -> torch.Tensor:
    """A copy of the host array ``array`` on ``device`` (same dtype) that does not stall the host
    (``hosts_to_device`` of one array)."""
    return hosts_to_device([array], device)[0]


_STAGING_ALIGNMENT = 16  # bytes: every array's offset in the staging buffer, so any dtype can view it


def hosts_to_device(arrays, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Copies of the host arrays ``arrays`` on ``device`` (each its dtype and shape), in one
    transfer that does not stall the host.

    A copy from pageable host memory to a GPU first waits for all work queued on the stream; the
    tables built inside a forward (the first layer of each kind builds its own) would each drain
    the queue. The arrays are packed into one pinned staging buffer (PyTorch's caching host
    allocator, which keeps it until the copy has run) and copied without blocking; the results are
    views of that one device buffer. One transfer rather than one per table: each costs the host
    tens of microseconds, and a forest's tables are built while the GPU waits for the forward.
    """
    arrays = [np.ascontiguousarray(array) for array in arrays]
    cuda = torch.device(device).type == "cuda"
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // _STAGING_ALIGNMENT) * _STAGING_ALIGNMENT
    staging = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda)
    host = staging.numpy()
    for array, offset in zip(arrays, offsets):
        host[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    buffer = staging.to(device, non_blocking=cuda)
    return tuple(
        buffer[offset : offset + array.nbytes].view(_torch_dtype(array.dtype)).view(array.shape)
        for array, offset in zip(arrays, offsets)
    )


@functools.lru_cache(maxsize=None)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy ``dtype`` (from an array of its own: a read-only table would make
    ``torch.from_numpy`` warn)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


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


def _distinct_sources(edge_source: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """([U] distinct source tokens, ascending; [E] index of each edge's source among them): what
    ``np.unique(edge_source, return_inverse=True)`` gives, from a presence table over the row's
    tokens instead of a sort (0.07-0.09 against 0.27-0.28 ms on 16K edges, CPU)."""
    present = np.zeros(num_tokens, dtype=bool)
    present[edge_source] = True
    slot = np.cumsum(present) - 1
    return np.flatnonzero(present), slot[edge_source]


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
        """Copy the layout and its derived tables to ``device`` (one host-to-device transfer)."""
        unique_source, source_slot = _distinct_sources(layout.edge_source, layout.num_tokens)
        token_subtree_end = _subtree_token_end(layout)[layout.token_segment]
        tables = {
            "input_ids": layout.tokens,
            "position_ids": layout.position_ids,
            "token_segment": layout.token_segment,
            "token_subtree_end": token_subtree_end,
            "segment_starts": layout.segment_starts,
            "segment_lengths": layout.segment_lengths,
            "segment_parents": layout.segment_parents,
            "token_multiplicity": layout.token_multiplicity,
            "edge_unique_source": unique_source,
            "edge_source_slot": source_slot,
            "edge_target": layout.edge_target,
        }
        on_device = hosts_to_device(
            [np.asarray(array, dtype=np.int64) for array in tables.values()], device
        )
        fields = dict(zip(tables, on_device))
        fields["input_ids"] = fields["input_ids"].unsqueeze(0)
        fields["position_ids"] = fields["position_ids"].unsqueeze(0)
        forest = cls(layout=layout, **fields)
        # ``host_subtree_end``, which host-built tables read: the same array, not computed again.
        forest._derived["host_subtree_end"] = token_subtree_end
        return forest

    def to(self, device: torch.device | str) -> "ForestTensors":
        """This forest, built on the host, on ``device``: every field and every table derived so
        far, in one host-to-device transfer (``hosts_to_device``).

        A DataLoader worker builds a row's tables ahead on the CPU (:func:`prepare_forest`); the
        training process then only copies them, instead of building them inside the forward while
        the GPU waits. Derived tables must be tensors, numpy arrays, Python scalars or strings, or
        tuples, lists, dicts and dataclasses of them (and of forests); nested structures keep
        their sharing (a table that holds a field of the forest holds the moved field).
        """
        device = torch.device(device)
        if self.device == device:
            return self
        if self.device.type != "cpu":
            raise ValueError(
                f"ForestTensors.to moves a forest built on the CPU, not on {self.device}"
            )
        found: dict[int, torch.Tensor] = {}
        _visit(self, found.setdefault)
        moved = hosts_to_device([tensor.numpy() for tensor in found.values()], device)
        replacement = {key: tensor.view(found[key].shape) for key, tensor in zip(found, moved)}
        return _rebuilt(self, replacement, {})

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

    def local_tokens(
        self, cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, sp_rank: int = 0
    ) -> torch.Tensor:
        """[T / (cp * sp)] int64 packed indices of the tokens one rank holds, in its local order.

        Context parallelism gives the rank its share of the row (``context_parallel_tokens``:
        chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``); sequence parallelism then splits that
        local sequence into ``sp`` equal contiguous chunks outside attention and Mamba, as megatron
        splits a sequence. Raises ValueError when the row does not split evenly (the planner's
        ``pad_multiple`` provides the multiple).
        """
        return self.derive(
            ("local_tokens", cp_size, cp_rank, sp_size, sp_rank),
            lambda: self._local_tokens(cp_size, cp_rank, sp_size, sp_rank),
        )

    def _local_tokens(self, cp_size, cp_rank, sp_size, sp_rank) -> torch.Tensor:
        from megatron.shared_prefix.context_parallel import context_parallel_tokens

        held = context_parallel_tokens(self.num_tokens, cp_size, cp_rank)
        if len(held) % sp_size:
            raise ValueError(
                f"a forest row of {self.num_tokens} tokens cannot be split over {sp_size} "
                f"sequence-parallel ranks{' per context-parallel rank' if cp_size > 1 else ''} "
                "(plan with pad_multiple a multiple of the tensor-parallel size"
                f"{' x 2 x context_parallel_size' if cp_size > 1 else ''})"
            )
        chunk = len(held) // sp_size
        return host_to_device(
            np.asarray(held[sp_rank * chunk : (sp_rank + 1) * chunk], dtype=np.int64), self.device
        )

    def edge_projection(
        self, cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, sp_rank: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Which of a rank's hidden states are projected to the vocabulary, and where each of its
        edges finds its logits.

        A context-parallel rank owns the edges whose source it holds. Within it, every
        sequence-parallel rank selects its own distinct sources, padded to the largest count
        ``U_max`` of the group (with its first token, whose logits no edge reads), so that the
        output layer's sequence-parallel all-gather stacks equal blocks: SP rank ``q``'s ``k``-th
        source lands at row ``q * U_max + k``.

        Returns:
            ([U_max] int64 index into this rank's local hidden states, [E_own] int64 row of each
            owned edge's source in the gathered ``[sp * U_max]`` block, [E_own] int64 ascending
            owned edge indices or None when every edge is owned (context-parallel size 1)).
            With one rank: the distinct sources, ``edge_source_slot`` and None.
        """
        return self.derive(
            ("edge_projection", cp_size, cp_rank, sp_size, sp_rank),
            lambda: self._projection(cp_size, cp_rank, sp_size, sp_rank),
        )

    def _projection(self, cp_size, cp_rank, sp_size, sp_rank):
        if cp_size == sp_size == 1:
            return self.edge_unique_source, self.edge_source_slot, None
        local, slots, owned, _ = self._host_projection(cp_size, cp_rank, sp_size, sp_rank)
        tables = [local, slots] + ([owned] if cp_size > 1 else [])
        local, slots, *owned = hosts_to_device(
            [np.asarray(table, dtype=np.int64) for table in tables], self.device
        )
        return local, slots, (owned[0] if owned else None)

    def _host_projection(self, cp_size, cp_rank, sp_size, sp_rank):
        """``edge_projection`` on the host: (local sources, slots, owned edges or None, U_max)."""
        return self.derive(
            ("host_edge_projection", cp_size, cp_rank, sp_size, sp_rank),
            lambda: self._build_host_projection(cp_size, cp_rank, sp_size, sp_rank),
        )

    def _build_host_projection(self, cp_size, cp_rank, sp_size, sp_rank):
        layout = self.layout
        sources, source_slot = np.unique(layout.edge_source, return_inverse=True)
        if cp_size == sp_size == 1:
            return sources, source_slot.reshape(-1), None, len(sources)
        from megatron.shared_prefix.context_parallel import (
            context_parallel_edges,
            context_parallel_tokens,
        )

        held = context_parallel_tokens(self.num_tokens, cp_size, cp_rank)
        chunk = len(held) // sp_size
        position = np.full(self.num_tokens, -1, dtype=np.int64)
        position[held] = np.arange(len(held))
        mine = position[sources] >= 0
        sources, source_position = sources[mine], position[sources[mine]]
        order = np.argsort(source_position, kind="stable")
        sources, source_position = sources[order], source_position[order]
        owner = source_position // chunk
        counts = np.bincount(owner, minlength=sp_size)
        width = max(int(counts.max()), 1)
        rank_in_owner = (
            np.arange(len(sources)) - np.concatenate([[0], np.cumsum(counts)[:-1]])[owner]
        )
        row_of_source = np.full(self.num_tokens, -1, dtype=np.int64)
        row_of_source[sources] = owner * width + rank_in_owner
        local = np.zeros(width, dtype=np.int64)
        on_this_rank = owner == sp_rank
        local[: int(on_this_rank.sum())] = source_position[on_this_rank] - sp_rank * chunk
        owned = context_parallel_edges(layout, cp_size, cp_rank) if cp_size > 1 else None
        slots = row_of_source[layout.edge_source if owned is None else layout.edge_source[owned]]
        return local, slots, owned, width

    def edge_projection_chunks(
        self,
        chunk_rows: int,
        cp_size: int = 1,
        cp_rank: int = 0,
        sp_size: int = 1,
        sp_rank: int = 0,
    ) -> tuple[tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...], torch.Tensor]:
        """``edge_projection`` split into chunks of at most ``chunk_rows`` of a rank's sources, for
        a loss that projects one chunk at a time (and recomputes it in the backward).

        Chunk ``j`` projects local sources ``[j * chunk_rows, stop_j)`` of every sequence-parallel
        rank, which the output layer's all-gather stacks into a block of ``sp`` equal parts, and
        takes the loss of the owned edges whose source is in it.

        Returns:
            (one (start, stop, [E_j] int64 row of each edge's source in the chunk's gathered block,
            [E_j] int64 target) per chunk, [E_own] int64 position of each owned edge, in owned-edge
            order, among the chunks' edges concatenated).
        """
        return self.derive(
            ("edge_projection_chunks", chunk_rows, cp_size, cp_rank, sp_size, sp_rank),
            lambda: self._projection_chunks(chunk_rows, cp_size, cp_rank, sp_size, sp_rank),
        )

    def _projection_chunks(self, chunk_rows, cp_size, cp_rank, sp_size, sp_rank):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        _, slots, owned, width = self._host_projection(cp_size, cp_rank, sp_size, sp_rank)
        targets = self.layout.edge_target if owned is None else self.layout.edge_target[owned]
        sp_rank_of_edge, row = np.divmod(slots, width)
        starts = np.arange(0, width, chunk_rows)
        chunk_of_edge = row // chunk_rows
        # Edges grouped by chunk, in owned-edge order within each: one sort, one copy per table.
        order = np.argsort(chunk_of_edge, kind="stable")
        chunk_start = starts[chunk_of_edge[order]]
        chunk_width = np.minimum(chunk_start + chunk_rows, width) - chunk_start
        in_chunk = sp_rank_of_edge[order] * chunk_width + row[order] - chunk_start
        counts = np.bincount(chunk_of_edge, minlength=len(starts)).tolist()
        position = np.empty(len(slots), dtype=np.int64)
        position[order] = np.arange(len(slots))
        in_chunk, chunk_targets, position = hosts_to_device(
            [in_chunk.astype(np.int64), np.asarray(targets[order], dtype=np.int64), position],
            self.device,
        )
        chunks = tuple(
            (int(start), int(min(start + chunk_rows, width)), slot, target)
            for start, slot, target in zip(
                starts, in_chunk.split(counts), chunk_targets.split(counts)
            )
        )
        return chunks, position

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
        subtree_end = self.host_subtree_end()
        blocks = []
        for start in range(0, self.num_tokens, block_size):
            end = min(start + block_size, self.num_tokens)
            blocks.append(np.flatnonzero(subtree_end[:end] > start).astype(np.int64))
        return hosts_to_device(blocks, self.device)

    def root_path_predecessors(self, window: int) -> torch.Tensor:
        """[T, window] packed index of the 1st..window-th previous token on each token's root path.

        Column ``j`` holds the token ``j + 1`` steps back along the path (parent segments included);
        -1 where the path is shorter. Used by the tree causal convolution.
        """
        return self.derive(
            ("root_path_predecessors", window),
            lambda: host_to_device(self.host_root_path_predecessors(window), self.device),
        )

    def host_root_path_predecessors(self, window: int) -> np.ndarray:
        """``root_path_predecessors`` as a host array, from the layout (no device round trip)."""
        return self.derive(
            ("host_root_path_predecessors", window), lambda: self._predecessors(window)
        )

    def host_subtree_end(self) -> np.ndarray:
        """``token_subtree_end`` as a host array, from the layout: tables built on the host read
        it without copying the device tensor back (a synchronization inside the forward)."""
        return self.derive(
            "host_subtree_end", lambda: _subtree_token_end(self.layout)[self.layout.token_segment]
        )

    def _predecessors(self, window: int) -> np.ndarray:
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
        return table


_PLAIN = (np.ndarray, np.generic, int, float, bool, str, bytes, type(None))


def _visit(value, on_tensor) -> None:
    """Call ``on_tensor(id, tensor)`` for every tensor inside ``value`` (``ForestTensors.to``)."""
    if isinstance(value, torch.Tensor):
        on_tensor(id(value), value)
    elif isinstance(value, dict):
        for item in value.values():
            _visit(item, on_tensor)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _visit(item, on_tensor)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _visit(getattr(value, field.name), on_tensor)
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"a forest table holds a {type(value).__name__}, which ForestTensors.to cannot move "
            "(keep tensors, arrays, scalars and tuples, lists, dicts or dataclasses of them)"
        )


def _rebuilt(value, replacement: dict, memo: dict):
    """``value`` with every tensor ``t`` replaced by ``replacement[id(t)]``; tuples and dataclasses
    are rebuilt only where something inside changed, dicts and lists always, and an object reached
    twice is rebuilt once."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        result = replacement[id(value)]
    elif isinstance(value, dict):  # mutable: always a new one (a forest's cache is not shared)
        result = {key: _rebuilt(item, replacement, memo) for key, item in value.items()}
    elif isinstance(value, list):
        result = [_rebuilt(item, replacement, memo) for item in value]
    elif isinstance(value, tuple):
        items = [_rebuilt(item, replacement, memo) for item in value]
        if all(new is old for new, old in zip(items, value)):
            result = value
        elif hasattr(value, "_fields"):  # a namedtuple
            result = type(value)(*items)
        else:
            result = tuple(items)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            field.name: _rebuilt(getattr(value, field.name), replacement, memo)
            for field in dataclasses.fields(value)
        }
        if all(fields[name] is getattr(value, name) for name in fields):
            result = value
        else:
            result = copy.copy(value)
            for name, item in fields.items():
                object.__setattr__(result, name, item)
    else:
        result = value
    memo[id(value)] = result
    return result


@dataclasses.dataclass(frozen=True)
class ForestTable:
    """A table that a model builds from every forest it runs, as a picklable request:
    ``build(forest, *args)`` builds it and caches it on the forest (``ForestTensors.derive``).

    ``build`` is a module-level function and ``args`` plain values, so the request crosses to a
    DataLoader worker, which builds the table ahead (:func:`prepare_forest`). Equal requests
    (same function and arguments) build the same table.
    """

    build: Callable[..., object]
    args: tuple = ()

    def __call__(self, forest: ForestTensors) -> None:
        self.build(forest, *self.args)


def prepare_forest(layout: ForestLayout, tables) -> ForestTensors:
    """``layout``'s ForestTensors on the CPU with every table of ``tables`` (ForestTable
    requests) built and cached: what a DataLoader worker hands the training process, which moves
    it to the GPU with ``ForestTensors.to`` and builds no table of it (only wrappers around them,
    such as FlexAttention's BlockMask; a table missing from ``tables`` is still built there, on
    first use)."""
    forest = ForestTensors.from_layout(layout, "cpu")
    for table in tables:
        table(forest)
    return forest
