"""Multiplicity-weighted router statistics of a forest row (upstream:
megatron/core/transformer/moe/moe_utils.py).

A packed token with multiplicity ``m`` stands for ``m`` identical dense tokens: the same hidden
state, the same router logits, the same experts. Every router statistic of the dense micro-batch is
therefore a weighted sum over packed tokens:

* per-expert token counts ``c_e = sum_t m_t * map[t, e]`` (expert-bias counts, aux-loss counts);
* probability mass ``P_e = sum_t m_t * scores[t, e]`` and the z-loss sum ``sum_t m_t * lse_t^2``;
* per-sequence counts ``c_ie`` for the sequence-level aux loss, where a shared token belongs to the
  root path of every sequence through it.

Counts are accumulated in int64: exact for any multiplicity (float32 stops counting exactly at
2**24) and independent of summation order. The per-sequence statistics use only gathers and
cumulative sums over index tables built once per forest on the host, so no order-sensitive
scatter is involved.
"""

import dataclasses

import numpy as np
import torch

from megatron.shared_prefix.tensors import ForestTensors, cumsum_over_tokens, hosts_to_device


def weighted_expert_counts(routing_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Exact per-expert counts of ``weights[t]`` copies of each routed token.

    Args:
        routing_map: [T, E] bool (or 0/1 integer) token-to-expert assignment.
        weights: [T] integer number of dense tokens each packed token stands for.

    Returns:
        [E] int64 ``sum_t weights[t] * routing_map[t, e]``, exact (integer arithmetic).
    """
    return (routing_map.to(torch.int64) * weights.to(torch.int64).unsqueeze(-1)).sum(dim=0)


def _sorted_ranges(keys: np.ndarray, lower: np.ndarray, upper: np.ndarray, num_values: int):
    """Sort ``keys`` (integers in ``[0, num_values)``) and return (order, start, stop): items with
    ``lower <= key < upper`` are ``order[start:stop]``; bounds lie in ``[0, num_values]``.

    ``start`` and ``stop`` count the keys below each bound, from one prefix sum of the keys'
    histogram: binary searches of the sorted keys took the host 0.3 ms per 20K bounds (a 2-core
    Xeon), at the start of a forward, while the GPU waited.
    """
    order = np.argsort(keys, kind="stable")
    below = np.zeros(num_values + 1, dtype=np.int64)  # below[v]: number of keys < v
    np.cumsum(np.bincount(keys, minlength=num_values), out=below[1:])
    return order, below[lower], below[upper]


@dataclasses.dataclass(frozen=True, eq=False)
class ForestRoutingTables:
    """Device tables for the router statistics of one forest row (``T`` tokens, ``n`` sequences).

    Attributes:
        multiplicity: [T] int64 number of the row's sequences through each token (0 for padding).
        padding: [T] bool, True for the row's padding tokens.
        num_sequences: n.
        num_dense_tokens: ``sum(multiplicity)``, the number of tokens of the dense micro-batch
            holding the row's sequences (a host int, so no device sync is needed).
        token_prefix_order, token_closed_before: a token ``v`` lies on the root path of ``t`` iff
            ``v <= t < subtree_end[v]``. Sorting tokens by ``subtree_end``
            (``token_prefix_order``), the tokens with ``subtree_end <= t`` are the first
            ``token_closed_before[t]`` of that order, so a root-path sum is a prefix sum minus a
            prefix sum in that order. [T] int64 each.
        sequence_last: [n] int64 last packed token of each sequence.
        sequence_order, sequence_start, sequence_stop: sequence ``i``'s root path contains ``t``
            iff ``t <= sequence_last[i] < subtree_end[t]``; with sequences sorted by last token
            (``sequence_order``, [n]), those are
            ``sequence_order[sequence_start[t]:sequence_stop[t]]``
            ([T] each).
    """

    multiplicity: torch.Tensor
    padding: torch.Tensor
    num_sequences: int
    num_dense_tokens: int
    token_prefix_order: torch.Tensor
    token_closed_before: torch.Tensor
    sequence_last: torch.Tensor
    sequence_order: torch.Tensor
    sequence_start: torch.Tensor
    sequence_stop: torch.Tensor

    @classmethod
    def build(cls, forest: ForestTensors) -> "ForestRoutingTables":
        """Index tables from the forest's host layout, copied to its device in one transfer."""
        layout = forest.layout
        num_tokens = layout.num_tokens
        subtree_end = forest.host_subtree_end()
        tokens = np.arange(num_tokens, dtype=np.int64)
        prefix_order, _, closed_before = _sorted_ranges(
            subtree_end, tokens, tokens + 1, num_tokens + 1
        )
        last = layout.sequence_last_index
        sequence_order, sequence_start, sequence_stop = _sorted_ranges(
            last, tokens, subtree_end, num_tokens + 1
        )

        tables = (prefix_order, closed_before, last, sequence_order, sequence_start, sequence_stop)
        (prefix_order, closed_before, last_on_device, sequence_order, sequence_start, sequence_stop) = (
            hosts_to_device([np.asarray(table, dtype=np.int64) for table in tables], forest.device)
        )
        return cls(
            multiplicity=forest.token_multiplicity,
            padding=forest.token_multiplicity == 0,
            num_sequences=len(last),
            num_dense_tokens=int(layout.token_multiplicity.sum()),
            token_prefix_order=prefix_order,
            token_closed_before=closed_before,
            sequence_last=last_on_device,
            sequence_order=sequence_order,
            sequence_start=sequence_start,
            sequence_stop=sequence_stop,
        )

    def count_weights(self, count_padding: bool) -> torch.Tensor:
        """[T] int64 dense tokens per packed token; padding counts once when ``count_padding``."""
        if count_padding:
            return self.multiplicity + self.padding.to(torch.int64)
        return self.multiplicity

    def root_path_sums(self, values: torch.Tensor) -> torch.Tensor:
        """[T, ...] sum of ``values`` over each token's root path (itself included).

        ``values`` is [T, ...] int64; the result is exact.
        """
        zero = values.new_zeros((1,) + values.shape[1:])
        inclusive = cumsum_over_tokens(values)
        closed = torch.cat([zero, cumsum_over_tokens(values[self.token_prefix_order])])
        return inclusive - closed[self.token_closed_before]

    def sequence_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[n, E] int64 per-expert token counts of each sequence (over its whole root path)."""
        return self.root_path_sums(routing_map.to(torch.int64))[self.sequence_last]

    def sum_over_sequences_through(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[T, ...] sum of ``per_sequence`` ([n, ...] int64) over the sequences through each
        token."""
        zero = per_sequence.new_zeros((1,) + per_sequence.shape[1:])
        prefix = torch.cat([zero, cumsum_over_tokens(per_sequence[self.sequence_order])])
        return prefix[self.sequence_stop] - prefix[self.sequence_start]


def forest_routing_tables(forest: ForestTensors) -> ForestRoutingTables:
    """The routing tables of ``forest``, built on first use and cached on it."""
    return forest.derive("routing_tables", lambda: ForestRoutingTables.build(forest))
