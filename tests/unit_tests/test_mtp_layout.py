"""MTP depth rows (mtp_layout.py) against their definition on the expanded sequences.

Depth ``d``'s state at position ``t`` of a sequence is a function of its tokens ``0 .. t + d``
(``END`` past its end), so a depth's row must hold exactly one token per distinct such key: the
dense computation, shared wherever sequences share it and nowhere else.
"""

import numpy as np
import pytest

from megatron.shared_prefix import plan_shared_prefix
from megatron.shared_prefix.mtp_layout import mtp_forests

END = None


def _keys(sequences, layout, depth):
    """packed index -> the key (tuple of tokens 0 .. t + depth, END past the end) of each real
    token of a depth's row (``depth`` 0: the main row), from every sequence's root path."""
    keys = {}
    for k, s in enumerate(layout.sequence_ids):
        tokens = list(sequences[int(s)]) + [END] * depth
        for t, index in enumerate(layout.root_path(k)):
            key = tuple(tokens[: t + depth + 1])
            assert keys.setdefault(int(index), key) == key, "a token stands for two keys"
    return keys


def _check(sequences, layout, num_depths, pad_multiple):
    rows = mtp_forests(layout, num_depths, pad_multiple)
    assert [row.depth for row in rows] == list(range(1, num_depths + 1))
    previous = _keys(sequences, layout, 0)
    # With share_supervised=False the main row keeps copies of one prefix; the depth rows
    # follow it, so each key is held once only where the main row holds each key once.
    shared_once = len(set(previous.values())) == len(previous)
    for row in rows:
        depth, forest = row.depth, row.layout
        forest.validate()
        assert forest.num_tokens % pad_multiple == 0
        assert np.array_equal(forest.sequence_ids, layout.sequence_ids)
        keys = _keys(sequences, forest, depth)
        real = forest.num_tokens - forest.num_padding
        assert sorted(keys) == list(range(real)), "a real token no sequence passes through"
        if shared_once:
            assert len(set(keys.values())) == real, "two tokens stand for one key (not shared)"
        for k, s in enumerate(forest.sequence_ids):
            sequence = list(sequences[int(s)])
            path = forest.root_path(k)
            assert len(path) == len(sequence)
            shifted = sequence[depth:] + [0] * min(depth, len(sequence))
            assert forest.tokens[path].tolist() == shifted
            expected = [t + depth if t + depth < len(sequence) else 0 for t in range(len(path))]
            assert row.embedding_position_ids[path].tolist() == expected
        # Each token's state input: the previous depth's token of the key one shorter.
        for index, key in keys.items():
            assert previous[int(row.input_index[index])] == key[:-1]
        padding = slice(real, forest.num_tokens)
        assert not row.input_index[padding].any() and not forest.token_multiplicity[padding].any()
        # Edges: the main edges with a target at this depth, read at the main source's key.
        has_target = np.flatnonzero(layout.edge_position >= depth + 1)
        assert np.array_equal(row.edge_index, has_target)
        assert np.array_equal(row.main_edge_slot[has_target], np.arange(len(has_target)))
        assert (row.main_edge_slot == -1).sum() == len(layout.edge_source) - len(has_target)
        main_keys = _keys(sequences, layout, 0)
        for e, main_edge in enumerate(has_target):
            source_key = main_keys[int(layout.edge_source[main_edge])]
            assert keys[int(forest.edge_source[e])] == source_key
            assert forest.edge_target[e] == layout.edge_target[main_edge]
            assert forest.edge_position[e] == layout.edge_position[main_edge] - depth
        previous = keys
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_depth_rows_hold_each_key_once(forest_sequences, seed):
    rng = np.random.default_rng(seed)
    sequences = forest_sequences(seed=seed, depth=1 + seed % 4)
    masks = [[False] + (rng.random(len(s) - 1) < 0.7).tolist() for s in sequences]
    plan = plan_shared_prefix(
        sequences, masks, capacity=96, pad_multiple=1 + seed % 3, share_supervised=seed % 2 == 0
    )
    for layout in plan.rows:
        _check(sequences, layout, num_depths=1 + seed % 5, pad_multiple=1 + seed % 4)
    real = sum(row.num_tokens - row.num_padding for row in plan.rows)
    assert seed % 2 or real < plan.logical_tokens, "no shared prefix to test"


def test_short_segments_are_copied_per_continuation():
    """The prompt's last tokens appear once per distinct continuation of the depth's length;
    a sequence shorter than the depth and sequences ending inside others get their end positions."""
    sequences = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7], [1, 2], [8], [1, 2, 3, 4]]
    layout = plan_shared_prefix(sequences, capacity=64).rows[0]
    rows = _check(sequences, layout, num_depths=3, pad_multiple=1)
    # Depth 1, position 1 (token 2): one copy per next token (3, 5, end of [1, 2]).
    depth_1 = rows[0].layout
    assert sorted(depth_1.tokens[depth_1.position_ids == 1].tolist()) == [0, 3, 5]
    # Depth 2, position 1: continuations (3, 4), (5, 6), (5, 7), and the end of [1, 2].
    depth_2 = rows[1].layout
    assert (depth_2.position_ids == 1).sum() == 4
    # The duplicate [1, 2, 3, 4] shares every token: multiplicity 2 along its whole path.
    k = list(depth_2.sequence_ids).index(0)
    assert depth_2.token_multiplicity[depth_2.root_path(k)].min() == 2


def test_row_without_targets():
    layout = plan_shared_prefix([[0]], [[False]], capacity=4, pad_multiple=4).rows[0]
    (row,) = mtp_forests(layout, 1, pad_multiple=4)
    row.layout.validate()
    assert row.layout.num_tokens == 4 and row.layout.num_padding == 3
    assert len(row.edge_index) == 0 and len(row.main_edge_slot) == 0


def test_bad_arguments_are_named():
    layout = plan_shared_prefix([[1, 2, 3]], capacity=8).rows[0]
    with pytest.raises(ValueError, match="num_depths"):
        mtp_forests(layout, 0)
    with pytest.raises(ValueError, match="pad_multiple"):
        mtp_forests(layout, 1, pad_multiple=0)
